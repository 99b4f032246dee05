"""What the fp8 doctor tells a person: ``report.md``, and the lines ``mixprec doctor --precision fp8``
prints, from the report :func:`mixprec.apps.fp8_doctor.run_fp8_doctor` returns. Both show the
evidence: every probe it ran, with the layers it kept in bf16 and its loss gap."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["report_markdown", "summary_lines"]


def _verdict(r: dict[str, Any]) -> str:
    rec = r["recommendation"]
    if not rec["fp8"]:
        return "not fp8: train this model in bf16-mixed"
    n = len(rec["converted"])
    return f"fp8 ({rec['recipe']}), {n} Linear layer{'s' * (n != 1)} in float8, {len(rec['keep_in_bf16'])} kept in bf16"


def _kept(p: dict[str, Any]) -> str:
    return "every layer (no float8)" if p["keep_in_bf16"] is None else ", ".join(p["keep_in_bf16"]) or "none"


def _passes(p: dict[str, Any]) -> str:
    return "" if p["within"] is None else ("yes" if p["within"] else "no")


def summary_lines(r: dict[str, Any]) -> list[str]:
    """The lines the CLI prints: the tolerance, each probe with its gap, the verdict and its reason."""
    rec, tol = r["recommendation"], r["tolerance"]
    lines = [f"tolerance: fp8 may end {tol['value']:.2%} above bf16-mixed's loss ({tol['rule']})",
             f"probes ({r['config']['steps']} steps each; the search: at most {r['config']['max_probes']} fp8 probes):"]
    for p in r["probes"]:
        mark = "" if p["within"] is None else ("  within" if p["within"] else "  MISSES")
        gap = "" if p["keep_in_bf16"] is None and p["gap"] == 0 else f"{p['gap']:+8.2%}"
        kept = "" if p["keep_in_bf16"] is None else f" [bf16: {_kept(p)}]"
        lines.append(f"  {p['label']}{kept}: loss {p['loss']:.4f} {gap}{mark}  ({p['seconds']:.0f} s)")
    lines.append(f"\nverdict: {_verdict(r)}")
    lines.append(f"  {rec['reason']}")
    if rec["fp8"]:
        lines += [f"  - {name}: {why}" for name, why in rec["keep_in_bf16"].items()]
    s = r["seconds"]
    lines.append(f"took {s['total']:.0f} s: measuring {s['measuring']:.0f} s, the second bf16-mixed seed "
                 f"{s['tolerance']:.0f} s, fp8 probes {s['fp8 probes']:.0f} s (the search's {s['search']:.0f} s)")
    return lines


def report_markdown(r: dict[str, Any]) -> str:
    """``report.md``: the verdict and why, every probe, the layers ranked by their worst signal, the
    per-layer measurements, the plots."""
    rec, tol, cfg = r["recommendation"], r["tolerance"], r["config"]
    lines = [f"# mixprec doctor --precision fp8: {r['task']}", "",
             f"{cfg['steps']} steps per probe, batch {cfg['batch_size']}, learning rate {cfg['learning_rate']:g}; "
             f"recipes measured: {', '.join(cfg['recipes'])}; the search: at most {cfg['max_probes']} fp8 probes. "
             f"Took {r['seconds']['total']:.0f} s.", "", f"## Verdict: {_verdict(r)}", "",
             rec["reason"][:1].upper() + rec["reason"][1:].rstrip(".") + ".", ""]
    if rec["fp8"]:
        lines += [f"Keep in bf16 ({len(rec['keep_in_bf16'])}):", ""]
        lines += [f"- `{n}`: {why}" for n, why in rec["keep_in_bf16"].items()]
        lines += ["", f"Convert to float8 ({len(rec['converted'])}): " + ", ".join(f"`{n}`" for n in rec["converted"])]
    lines += [""] + [f"- {reason}" for reason in rec["reasons"]]
    lines += ["", "## The probes", "",
              f"A filter passes when its fp8 loss ends at most **{tol['value']:.2%}** above bf16-mixed's from the same "
              f"seed: the relative gap between two bf16-mixed seeds' losses, held between {tol['floor']:.0%} and "
              f"{tol['cap']:.0%} ({tol['rule']}). Each loss is the mean of a probe's last 3 steps.", "",
              "| # | probe | kept in bf16 | loss | gap to bf16-mixed | passes | seconds |", "|---|---|---|---|---|---|---|"]
    for i, p in enumerate(r["probes"], 1):
        gap = "-" if i == 1 else f"{p['gap']:+.2%}"
        lines.append(f"| {i} | {p['label']} | {_kept(p)} | {p['loss']:.4f} | {gap} | {_passes(p)} | {p['seconds']:.1f} |")
    if r["ranking"]:
        lines += ["", f"## The converted layers, ranked by their worst fp8 signal ({rec['recipe']})", "",
                  "Severity 1 is where a signal is suspect: 1% of a tensor flushed or saturated, an error 4x the "
                  "median layer's, a range as wide as the format's normal numbers. The search keeps them in bf16 "
                  "in this order.", "", "| rank | layer | worst signal | severity | measured |", "|---|---|---|---|---|"]
        lines += [f"| {i} | `{x['layer']}` | {x['signal']} | {x['score']:.2f} | {x['why']} |"
                  for i, x in enumerate(r["ranking"], 1)]
    recipes = cfg["recipes"]
    lines += ["", "## Per layer (errors: mean over the steps; amax, range and fractions: worst step)", "",
              "| layer | shape | " + " | ".join(f"{x} output error" for x in recipes)
              + " | input-gradient error | input amax | input range | input flushed | grad amax | grad range "
                "| grad flushed |", "|---" * (9 + len(recipes)) + "|"]
    for n, row in r["layers"].items():
        ref = row.get(rec["recipe"], {})
        if not ref:
            continue
        x, g = ref["input"], ref.get("grad_output", {})
        lines.append(f"| `{n}` | {row['shape'][0]}x{row['shape'][1]} | "
                     + " | ".join(f"{row[k]['output_error']:.3g}" for k in recipes)
                     + f" | {ref.get('grad_input_error', 0):.3g} | {x['amax']:.3g} | {_binades(x)} | {x['flushed']:.2%} "
                       f"| {g.get('amax', 0):.3g} | {_binades(g)} | {g.get('flushed', 0):.2%} |")
    lines += ["", "## Plots", ""] + [f"- `{Path(p).name}`" for p in r["plots"].values()]
    return "\n".join(lines) + "\n"


def _binades(stats: dict[str, Any]) -> str:
    return "-" if stats.get("range") is None else f"{stats['range']:.1f}"
