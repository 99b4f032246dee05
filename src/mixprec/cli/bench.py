"""``mixprec bench``: the same training job under each precision, interleaved in one run.

The measuring is :func:`mixprec.apps.bench.run_bench`'s; this module parses the flags and presents
the result: a table on the terminal, ``bench.json`` and ``bench.png`` in the output folder.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from mixprec.apps.bench import DEFAULT_PRECISIONS, BenchConfig, run_bench
from mixprec.apps.plots import plot_bench_result
from mixprec.apps.progress import Progress
from mixprec.nested import tree_map
from mixprec.precision import PLUGINS
from mixprec.tasks import DATA_CONTRACT, PYCODE_SIZES, TASKS

__all__ = ["register", "run", "format_table", "write_json"]

_EPILOG = """Examples:
  mixprec bench --size tiny --steps 5 --rounds 2
  mixprec bench --task pycode --size small --steps 10 --rounds 3 --out /tmp/bench-small
  mixprec bench --precisions fp32,bf16-mixed --compare torch,trainer,hf,accelerate --profile
  mixprec bench --precisions bf16-mixed,bf16-true --bf16-true-compensation kahan,stochastic,none --compile
  PYTHONPATH=. mixprec bench --model mymod:build_model --data mymod:build_data

Each precision trains its own model (same initial weights, same data order) through
mixprec.Accelerator; in each round every precision runs --steps steps in turn, so a change in
the machine's speed hits all alike. Speed-ups are throughput ratios against fp32 measured in
the same run. On the CPU, peak memory is measured in a fresh process per precision."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="measure one training job under each precision: speed, memory, TFLOP/s and loss",
        description="Train the same job under each precision, interleaved in rounds, and report the median "
        "step time, samples/s and tokens/s, the speed-up over fp32, peak memory, achieved TFLOP/s against "
        "the device's measured matrix-product peak, and the final losses against fp32's.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--task", default="pycode", help=f"built-in task: {' or '.join(TASKS)} (default pycode)")
    p.add_argument("--size", default=None, help=f"pycode's size: {', '.join(PYCODE_SIZES)} (default mini)")
    p.add_argument("--arch", default="mlp", help="digits' model: mlp (default) or cnn")
    p.add_argument("--model", metavar="MODULE:FACTORY", help="your model factory (forward returns .loss)")
    p.add_argument("--data", metavar="MODULE:FACTORY", help=f"your data factory, returning {DATA_CONTRACT}")
    p.add_argument("--precisions", default=None,
                   help=f"comma-separated precisions (default: {','.join(DEFAULT_PRECISIONS)}, less those whose matrix "
                   "products fall back to a generic kernel here, said at the start: fp16-mixed on a CPU without "
                   "AMX-FP16 or AVX512-FP16, bf16-mixed and bf16-true on one without AVX512)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per precision in each round (default 20)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of interleaving (default 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per precision first (default 2)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per step (default 8)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, mps (default: CUDA, then MPS, then CPU)")
    p.add_argument("--compare", default="", metavar="torch,trainer,hf,accelerate",
                   help="also run the job as a hand-written torch.autocast loop (torch), through mixprec's Trainer "
                   "(trainer), the Hugging Face Trainer (hf) and/or Accelerate (accelerate)")
    p.add_argument("--bf16-true-compensation", default="kahan,none", metavar="kahan,none",
                   help="bf16-true's optimizer updates, a row each: kahan, stochastic, none (default kahan,none)")
    p.add_argument("--bf16-true-state-dtype", default="fp32", help="bf16-true's optimizer moments: fp32 (default) or bf16")
    p.add_argument("--compile", action="store_true", help="compile every contestant (the warm-up absorbs it)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    p.add_argument("--matmul-size", type=int, default=None,
                   help="side of the peak-measuring matmul (default: sized to the device per dtype, doubling from 256 "
                   "to the first side whose one product takes at least 0.05 s, at most 2048 on the CPU, 4096 "
                   "elsewhere)")
    p.add_argument("--profile", action="store_true", help="print the top operators of one step per precision")
    p.add_argument("--out", default=None, metavar="DIR", help="output folder (default runs/bench-<time>)")
    p.set_defaults(func=run)


def _split(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def run(args: argparse.Namespace) -> int:
    try:
        config = BenchConfig(task=args.task, size=args.size, arch=args.arch, model=args.model, data=args.data,
                             precisions=_split(args.precisions) if args.precisions is not None else None, steps=args.steps, rounds=args.rounds,
                             warmup=args.warmup, batch_size=args.batch_size, device=args.device,
                             compare=_split(args.compare), bf16_true_compensation=_split(args.bf16_true_compensation),
                             bf16_true_state_dtype=args.bf16_true_state_dtype, compile=args.compile,
                             memory=not args.no_memory,
                             matmul_size=args.matmul_size, profile=args.profile)
    except ValueError as exc:
        print(f"mixprec bench: error: {exc}", file=sys.stderr)
        return 2
    progress = Progress("bench")  # stderr: what runs now, round k of n, the time left
    try:
        result = run_bench(config, progress)
    except ValueError as exc:
        progress.close()
        print(f"mixprec bench: error: {exc}", file=sys.stderr)
        return 2
    finally:
        progress.close("measured")
    out = Path(args.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    result["command"] = _command(config, out)
    write_json(result, out / "bench.json")
    plot_bench_result(result, out / "bench.png")
    print(format_table(result))
    for name, prof in result["profile"].items():
        print(f"\nprofile of one {name} step: {prof['matmul_fraction']:.0%} of the operators' self time in "
              f"matrix products (mm/addmm/bmm/attention), {prof['self_time_ms']:.1f} ms in all\n{prof['table']}")
    print(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")
    return 0


def _command(config: BenchConfig, out: Path) -> str:
    words = ["mixprec", "bench"]
    if config.model:
        words += ["--model", config.model, "--data", config.data]
    else:
        words += ["--task", config.task] + (["--size", config.size] if config.size else []) + (
            ["--arch", config.arch] if config.task == "digits" else [])
    words += (["--precisions", ",".join(config.precisions)] if config.precisions else []) + [
        "--steps", str(config.steps), "--rounds",
              str(config.rounds), "--warmup", str(config.warmup), "--batch-size", str(config.batch_size)]
    words += (["--device", config.device] if config.device else []) + (
        ["--compare", ",".join(config.compare)] if config.compare else [])
    if any(PLUGINS[p].variant_field for p in (config.precisions or DEFAULT_PRECISIONS)):  # bf16-true's compensations
        state_dtype = config.bf16_true_state_dtype  # (written out only where it is not the default)
        words += ["--bf16-true-compensation", ",".join(config.bf16_true_compensation)] + (
            ["--bf16-true-state-dtype", state_dtype] if state_dtype != BenchConfig.bf16_true_state_dtype else [])
    words += ["--compile"] if config.compile else []
    words += (["--no-memory"] if not config.memory else []) + (
        ["--matmul-size", str(config.matmul_size)] if config.matmul_size else [])
    return shlex.join(words + (["--profile"] if config.profile else []) + ["--out", str(out)])


def _num(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:{fmt}}{suffix}"


def _loss(row: dict[str, Any], key: str) -> str:
    rel = row.get(f"{key}_rel_diff")
    return _num(row.get(key), ".4f") + (f" ({rel:+.2%})" if rel is not None and math.isfinite(rel) else "")


def format_table(result: dict[str, Any]) -> str:
    """The bench result as an aligned text table, with the machine, the peaks and the notes."""
    task, machine, base = result["task"], result["machine"], result["baseline"] or "-"
    rows = result["results"]
    tokens = task["tokens_per_sample"]
    cfg = result["config"]
    sides = result["matmul_size"]
    peaks = ", ".join(f"{k} {v:.3g} ({sides[k]}^3)" for k, v in result["matmul_peak_tflops"].items())
    lines = [
        f"{task['name']}: {task['description']}",
        f"{task['parameters']:,} parameters, batch {task['batch_size']}"
        + (f" x {tokens} tokens" if tokens else "")
        + f"; {cfg['steps']} steps x {cfg['rounds']} rounds per precision, interleaved, after {cfg['warmup']} warm-up",
        f"machine: {machine['device']} ({machine['device_name']}), torch {machine['torch']}, "
        f"{machine['threads']} threads",
        f"matmul peak (measured after each round, best; each dtype's side "
        f"{'given' if cfg.get('matmul_size') else 'sized to the device'}): {peaks} TFLOP/s",
        "",
    ]
    vs_mixprec = any(r["runner"] != "mixprec" for r in rows.values())
    vs_loop = any(r.get("throughput_vs_torch_loop") is not None for r in rows.values())
    rss = any(r.get("peak_rss_bytes") is not None for r in rows.values())
    header = ["precision", "step ms", "samples/s", "tokens/s", "speed-up", "peak MiB"] + (["RSS MiB"] if rss else []) \
        + ["TFLOP/s", "% of peak", "syncs", f"train loss (vs {base})", f"eval loss (vs {base})"] \
        + (["vs mixprec"] if vs_mixprec else []) + (["vs torch loop"] if vs_loop else [])
    left_aligned = {0, header.index(f"train loss (vs {base})"), header.index(f"eval loss (vs {base})")}
    table = [header]
    skipped = []
    for name, r in rows.items():
        if r.get("status") != "ok":
            skipped.append(f"{name}: skipped: {r.get('reason', '')}")
            continue
        mib = [_num(r[k] / 2**20 if r.get(k) is not None else None, ".1f")
               for k in ("peak_memory_bytes", "peak_rss_bytes")[:1 + rss]]
        table.append([name, _num(r["step_time_s"] * 1e3, ".1f"), _num(r["samples_per_s"], ".2f"),
                      _num(r["tokens_per_s"], ",.0f"), _num(r["speedup"], ".2f", "x"), *mib, _num(r["tflops"], ".3f"),
                      _num(r["fraction_of_peak"] * 100 if r["fraction_of_peak"] else None, ".1f", "%"),
                      _num(r.get("host_syncs_per_step"), "d"), _loss(r, "train_loss"), _loss(r, "eval_loss")]
                     + ([_num(r.get("throughput_vs_mixprec"), ".2f", "x")] if vs_mixprec else [])
                     + ([_num(r.get("throughput_vs_torch_loop"), ".2f", "x")] if vs_loop else []))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        lines.append("  ".join(c.ljust(w) if i in left_aligned else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    notes = skipped + list(result["notes"])
    if result["memory_method"]:
        notes.append(f"peak memory: {result['memory_method']}")
    notes.append(f"speed-up: throughput over {base}'s, the median over rounds of each round's ratio; TFLOP/s: "
                 "forward+backward FLOPs / median step time; % of peak: of the compute dtype's matmul peak "
                 "measured after the same round (median over rounds); syncs: host-device syncs in one step "
                 "(mixprec.diagnostics.count_host_syncs: on the CPU, the reads that would wait for an accelerator)")
    return "\n".join(lines + ([""] + [f"note: {n}" for n in notes] if notes else []))


def _finite(value: Any) -> Any:
    # JSON has no NaN or infinity
    return tree_map(lambda v: None if isinstance(v, float) and not math.isfinite(v) else v, value)


def write_json(result: dict[str, Any], path: Path) -> None:
    """Write the result as strict JSON (non-finite numbers become ``null``)."""
    path.write_text(json.dumps(_finite(result), indent=2) + "\n")
