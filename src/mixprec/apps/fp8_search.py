"""The fp8 doctor's proof: a recommendation is a claim that loss probes verify, a miss starts a
search, and a search that finds nothing ends in a refusal that names the layers and the signal.

**Tolerance.** A filter passes when its fp8 loss probe ends at most ``tolerance`` above
bf16-mixed's, relative: ``(fp8 - bf16) / bf16 <= tolerance``, both from the same seed (the same
initialisation and batches). The tolerance is the noise between two bf16-mixed seeds on the same
probe, ``|bf16(seed + 1) - bf16(seed)| / bf16(seed)``, held between :data:`TOLERANCE_FLOOR` (2%)
and :data:`TOLERANCE_CAP` (5%): fp8 passes when it moves the loss by no more than choosing another
seed does. One pair of seeds can land close by chance, or far apart on a short noisy probe, so
both bounds are measured: the floor is fp8's own price on healthy models (+0.55% on pycode
``small`` after 10 steps; +1.8% +- 0.4% on average over 16 seeds of the issue's four-layer MLP,
``benchmarks/fp8_mlp_gap.py``), and the cap is the largest paired gap the first-and-last filter
showed there over those 16 seeds, either recipe (+4.6%, rowwise; tensorwise +3.9%): a paired gap
beyond it is a failure, however noisy the seeds.

**Signals.** Every layer the filter converts is scored by each signal the probe measures (for
the recipe chosen), as a severity where 1 is the level at which the signal is suspect:

- the fraction of its input, weight and output gradient flushed to zero or saturated after
  scaling: 1% (on pycode ``small`` at most 0.003% of an input and 0.008% of a gradient flush);
- the relative error of its output and of the input gradient it sends back, in fp8 against
  bf16: ``ERROR_RATIO`` (4) times the median over the measured layers;
- its range: the binades from a tensor's median magnitude up to its amax, against the format's
  normal range (e4m3 14.8 binades, e5m2 29.8): beyond it, the median value is subnormal or lost.

A layer's score is its worst severity; the layers are ranked by it (ties by the sum).

**Search.** If the recommended filter misses, the ranked layers are kept in bf16 one more at a
time (the worst first) and each filter is probed, until one passes or ``max_probes`` probes are
spent; a passing filter is then pruned, while the budget lasts, of layers added before the one
that made it pass whose removal still passes. Keeping every layer is bf16-mixed, not fp8, so it is
never a candidate: if nothing passes, the verdict is against fp8.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ERROR_RATIO", "TOLERANCE_CAP", "TOLERANCE_FLOOR", "loss_tolerance", "rank_float8_layers",
           "verify_float8"]

#: A layer's fp8 error is suspect at this many times the median over the measured layers.
ERROR_RATIO = 4.0

#: The smallest tolerance (relative loss gap to bf16-mixed) a filter is held to; see the module's docstring.
TOLERANCE_FLOOR = 0.02
#: The largest: a paired gap beyond it fails however far apart two bf16-mixed seeds land.
TOLERANCE_CAP = 0.05
#: Flushed or saturated fractions above this are suspect (severity 1).
FRACTION_LIMIT = 0.01
#: Binades of each float8 format's normal numbers: log2(max / smallest normal).
NORMAL_BINADES = {"e4m3": math.log2(448 / 2 ** -6), "e5m2": math.log2(57344 / 2 ** -14)}
_TENSORS = (("input", "input"), ("weight", "weight"), ("grad_output", "output gradient"))
_ERRORS = (("output_error", "output error"), ("grad_input_error", "input-gradient error"))


def loss_tolerance(bf16_loss: float, other_seed_loss: float, *, floor: float = TOLERANCE_FLOOR,
                   cap: float = TOLERANCE_CAP, override: float | None = None) -> dict[str, Any]:
    """The tolerance a filter's fp8 loss gap is held to: two bf16-mixed seeds' relative gap, held
    between ``floor`` and ``cap`` (or ``override`` where the user set one). Returns ``{"value",
    "seed_gap", "floor", "cap", "rule"}``.

    Example:
        >>> round(loss_tolerance(2.0, 2.06)["value"], 6)
        0.03
    """
    seed_gap = abs(other_seed_loss - bf16_loss) / abs(bf16_loss) if bf16_loss else 0.0
    out = {"seed_gap": seed_gap, "floor": floor, "cap": cap}
    if override is not None:
        return {**out, "value": override, "rule": "set by the user"}
    rule = f"two bf16-mixed seeds' losses differ by {seed_gap:.2%}"
    if seed_gap < floor:
        rule += f", below the floor of {floor:.0%}"
    elif seed_gap > cap:
        rule += f", above the cap of {cap:.0%}: a noisy probe, which more steps make a tighter test"
    return {**out, "value": min(max(seed_gap, floor), cap), "rule": rule}


def _medians(layers: dict[str, dict[str, Any]], recipe: str) -> dict[str, float]:
    out = {}
    for key, _ in _ERRORS:
        values = [row[recipe][key] for row in layers.values() if key in row.get(recipe, {})]
        out[key] = statistics.median(values) if values else 0.0
    return out


def _signals(row: dict[str, Any], medians: dict[str, float], error_ratio: float) -> dict[str, dict[str, Any]]:
    """Each signal of one layer under one recipe: its value, severity (1: suspect) and a sentence."""
    out: dict[str, dict[str, Any]] = {}
    for key, label in _TENSORS:
        s = row.get(key)
        if not s:
            continue
        for what, verb in (("flushed", "flushes to zero"), ("saturated", "saturates")):
            out[f"{label} {what}"] = {"value": s[what], "severity": s[what] / FRACTION_LIMIT,
                                      "why": f"{s[what]:.1%} of its {label} {verb} in {s['format']}"}
        if s.get("range") is not None:
            normal = NORMAL_BINADES[s["format"]]
            out[f"{label} range"] = {"value": s["range"], "severity": s["range"] / normal,
                                     "why": f"its {label} spans {s['range']:.1f} binades from its median magnitude "
                                            f"to its amax ({s['amax']:.3g}), against {s['format']}'s normal range "
                                            f"of {normal:.1f}"}
    for key, label in _ERRORS:
        if key in row and medians[key] > 0:
            v = row[key]
            out[label] = {"value": v, "severity": v / (error_ratio * medians[key]),
                          "why": f"its {label} in fp8 is {v:.3g}, {v / medians[key]:.1f}x the median layer's "
                                 f"({medians[key]:.3g})"}
    return out


def rank_float8_layers(layers: dict[str, dict[str, Any]], names: list[str], recipe: str,
                       error_ratio: float = ERROR_RATIO) -> list[dict[str, Any]]:
    """``names`` ranked by their worst fp8 signal under ``recipe`` (see the module's docstring), worst
    first: ``[{"layer", "score", "signal", "value", "why", "severities": {signal: severity}}]``."""
    medians = _medians(layers, recipe)
    ranked = []
    for n in names:
        signals = _signals(layers[n].get(recipe, {}), medians, error_ratio)
        if not signals:
            continue
        worst = max(signals, key=lambda s: signals[s]["severity"])
        ranked.append({"layer": n, "score": signals[worst]["severity"], "signal": worst,
                       "value": signals[worst]["value"], "why": signals[worst]["why"],
                       "severities": {s: v["severity"] for s, v in signals.items()},
                       "_sum": sum(v["severity"] for v in signals.values())})
    ranked.sort(key=lambda r: (-r["score"], -r.pop("_sum")))
    return ranked


def verify_float8(layers: dict[str, dict[str, Any]], recommendation: dict[str, Any],
                  fp8_loss: Callable[[list[str]], float], *, bf16_loss: float, tolerance: float,
                  max_probes: int = 4, error_ratio: float = ERROR_RATIO) -> dict[str, Any]:
    """Verify ``recommendation`` (from :func:`mixprec.apps.fp8_doctor.recommend_float8`) with
    ``fp8_loss(keep_in_bf16)`` probes against ``bf16_loss``, search when it misses, refuse fp8
    when nothing passes.

    Returns ``{"fp8", "recipe", "keep_in_bf16": {name: why}, "converted", "reason", "probes",
    "ranking", "max_probes"}``; ``probes``: one ``{"label", "keep_in_bf16", "loss", "gap",
    "within", "seconds"}`` per fp8 probe run, in order.
    """
    recipe = recommendation["recipe"]
    default = {n: row["default"] for n, row in layers.items() if row["default"] is not None}
    keep = dict(recommendation["keep_in_bf16"])
    probes: list[dict[str, Any]] = []
    if all(n in keep for n in layers):
        return {"recipe": recipe, "ranking": [], "max_probes": max_probes, "probes": probes, "fp8": False,
                "keep_in_bf16": keep, "converted": [],
                "reason": "no Linear layer is left to convert to float8 (" + "; ".join(
                    f"`{n}`: {why}" for n, why in keep.items()) + "). Train this model in bf16-mixed."}

    def probe(label: str, kept: list[str] | dict[str, str]) -> dict[str, Any]:
        t0 = time.perf_counter()
        loss = fp8_loss(sorted(kept))
        gap = (loss - bf16_loss) / abs(bf16_loss)
        probes.append({"label": label, "keep_in_bf16": sorted(kept), "loss": loss, "gap": gap,
                       "within": gap <= tolerance, "seconds": time.perf_counter() - t0})
        return probes[-1]

    first = probe("fp8, torchao's default filter (the first and the last Linear in bf16)", default)
    note = ""
    if set(keep) != set(default):
        measured = probe("fp8, recommended filter (+ " + ", ".join(sorted(set(keep) - set(default))) + ")", keep)
        if measured["within"] or not first["within"]:
            first = measured
        else:  # the default passes where the measured rule's superset did not: the verified filter wins
            keep = default
            note = f" (the measured rule's filter ended {measured['gap']:+.2%}, so torchao's default is kept)"
    converted = [n for n in layers if n not in keep]
    ranking = rank_float8_layers(layers, converted, recipe, error_ratio)
    result = {"recipe": recipe, "ranking": ranking, "max_probes": max_probes, "probes": probes}
    if first["within"]:
        return {**result, "fp8": True, "keep_in_bf16": keep, "converted": converted,
                "reason": f"its loss probe ends {first['gap']:+.2%} against bf16-mixed, within the tolerance "
                          f"of {tolerance:.2%}{note}"}
    # The search: the worst-ranked layers kept one more at a time; never all of them (that is bf16-mixed).
    why = {r["layer"]: r["why"] for r in ranking}
    added: list[str] = []
    spent, found = 0, None
    for n in [r["layer"] for r in ranking][:-1]:
        if spent >= max_probes:
            break
        added.append(n)
        spent += 1
        got = probe(f"search {spent}: + {n}", [*keep, *added])
        if got["within"]:
            found = got
            break
    if found is not None:
        for n in added[:-1]:  # layers added before the one that made it pass: needed?
            if spent >= max_probes:
                break
            spent += 1
            rest = [a for a in added if a != n]
            got = probe(f"prune {spent}: - {n}", [*keep, *rest])
            if got["within"]:
                added, found = rest, got
        final = {**keep, **{n: f"kept by the search: {why[n]}" for n in added}}
        return {**result, "fp8": True, "keep_in_bf16": final, "converted": [n for n in layers if n not in final],
                "reason": f"the recommended filter missed ({first['gap']:+.2%} against bf16-mixed, tolerance "
                          f"{tolerance:.2%}); keeping {_names(added)} in bf16 as well brings it to "
                          f"{found['gap']:+.2%}"}
    best = min(probes, key=lambda p: p["gap"])
    named = [r for r in ranking if r["score"] >= 1]
    reason = (f"no filter came within {tolerance:.2%} of bf16-mixed's loss in {len(probes)} fp8 probes "
              f"({spent} of them the search's, at most {max_probes}); the closest, keeping "
              f"{_names(best['keep_in_bf16'])} in bf16, ended {best['gap']:+.2%}")
    if len(ranking) <= 1 or len(added) == len(ranking) - 1:
        reason += "; keeping one more layer would leave nothing in float8"
    if named:
        reason += ". What the probe measured: " + "; ".join(f"`{r['layer']}`: {r['signal']} ({r['why']})"
                                                          for r in named)
    elif ranking:  # the loss says no, and no signal is suspect: say so, and the worst of them
        worst = ranking[0]
        reason += (f". No signal the probe measured is suspect (the worst: `{worst['layer']}`, {worst['signal']}, "
                   f"severity {worst['score']:.2f}: {worst['why']})")
    return {**result, "fp8": False, "converted": [], "reason": reason + ". Train this model in bf16-mixed.",
            "keep_in_bf16": {n: "bf16-mixed: fp8 is not recommended for this model" for n in layers}}


def _names(names: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in names)
