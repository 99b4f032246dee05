"""``mixprec demo``: what mixed precision does for training here, in about three minutes.

Trains the built-in ``pycode`` GPT with the precision ``auto`` picks, beside a short fp32
reference run on the same data, then prints a summary and writes a run folder.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from mixprec.apps.demo import demo_task, train_in_fresh_process
from mixprec.tasks import TASKS

EXAMPLES = """Examples:
  mixprec demo                              # ~3 minutes on 2 CPU cores
  mixprec demo --size tiny --steps 40       # a quick look
  mixprec demo --precision fp16 --out runs/fp16-demo
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train a small GPT in mixed precision beside fp32 and show what it changes",
                       description="Train the built-in pycode GPT (the Python standard library's source, byte by "
                       "byte) with the precision 'auto' picks, beside a short fp32 run on the same data; print "
                       "throughput, peak memory and validation loss for each; write a run folder with the "
                       "checkpoint, metrics.jsonl, plots and a generated sample.",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default=TASKS["pycode"].defaults["size"], choices=TASKS["pycode"].variants,
                   help="model size (default: %(default)s)")
    p.add_argument("--precision", default="auto", help="the mixed run's precision (default: auto)")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps of the mixed run (default: 600)")
    p.add_argument("--fp32-steps", type=int, default=None, help="steps of the fp32 reference (default: steps / 3)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--train-bytes", type=int, default=None, help="bytes of training text to read (default: 4 MB)")
    p.add_argument("--eval-bytes", type=int, default=None, help="bytes of validation text (default: 200 kB)")
    p.add_argument("--out", default=None, help="run folder (default: runs/demo-<time>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def _table(rows: list[dict[str, Any]]) -> str:
    head = f"{'run':<12} {'steps':>6} {'tokens/s':>10} {'speed-up':>9} {'peak RSS MB':>12} {'val loss':>9} {'bits/byte':>9}"
    base = rows[0]["tokens_per_second"]
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['precision']:<12} {r['steps']:>6} {r['tokens_per_second']:>10.0f} "
                     f"{r['tokens_per_second'] / base:>8.2f}x {r['peak_memory_mb']:>12.0f} "
                     f"{r['final_eval_loss']:>9.3f} {r['final_bits_per_byte']:>9.3f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from mixprec.apps.plots import plot_loss_curves, plot_loss_scale
    from mixprec.precision import resolve_precision
    from mixprec.tasks import generate_sample

    if args.steps < 4:
        print("mixprec demo: error: --steps must be at least 4", file=sys.stderr)
        return 2
    try:
        policy = resolve_precision(args.precision)
    except ValueError as e:
        print(f"mixprec demo: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    fp32_steps = args.fp32_steps or max(4, args.steps // 3)
    print(f"mixprec demo: pycode/{args.size}, mixed run in {policy.name}"
          + (f" ({policy.reason})" if policy.reason else "") + f", fp32 reference for {fp32_steps} steps")
    data = (args.train_bytes, args.eval_bytes)
    task = demo_task(args.size, *data)
    print(f"data: {len(task.train_dataset)} training blocks of {task.train_dataset.block_size} bytes from the "
          f"standard library's source; {len(task.eval_dataset)} validation blocks")
    # Each run in a fresh process: its peak memory is its own, not what an earlier run left.
    try:
        reference = train_in_fresh_process(args.size, data, "fp32", fp32_steps, str(out / "fp32"), args.batch_size,
                                      not args.no_progress)
        mixed = train_in_fresh_process(args.size, data, policy.name, args.steps, str(out), args.batch_size,
                                  not args.no_progress)
    except ValueError as e:  # a setting the Trainer refuses (its message says the fix)
        print(f"mixprec demo: error: {e}", file=sys.stderr)
        return 2
    rows = [reference, mixed]
    print()
    print(_table(rows))
    print(f"(speed-up: tokens/s against fp32; memory: {mixed['memory_kind']})")
    if mixed["skipped_steps"]:
        print(f"{mixed['skipped_steps']} fp16 steps were skipped for overflow (the loss scaler backed off)")
    # Two curves, even where auto chose fp32 for the mixed run too.
    names = {"fp32" if mixed["precision"] != "fp32" else "fp32 (reference)": reference, mixed["precision"]: mixed}
    plots = [plot_loss_curves({n: r["train"] for n, r in names.items()}, out / "loss_curve.png",
                              evaluation={n: r["eval"] for n, r in names.items()},
                              seconds={n: r["seconds"] for n, r in names.items()},
                              title=f"pycode/{args.size}: fp32 against {mixed['precision']}")]
    if mixed["scale_history"]:
        plots.append(plot_loss_scale(mixed["scale_history"], out / "loss_scale.png"))
    import safetensors.torch

    from mixprec.accelerator.accelerator import Accelerator

    model = Accelerator(mixed_precision=policy.name).prepare(task.build_model())
    safetensors.torch.load_model(model, str(Path(mixed["checkpoint"]) / "model_0.safetensors"))
    sample = generate_sample(model, prompt="def ", max_new_tokens=300, generator=torch.Generator().manual_seed(0))
    (out / "sample.txt").write_text(sample if isinstance(sample, str) else str(sample))
    summary = {k: {kk: vv for kk, vv in r.items() if kk not in ("train", "eval", "seconds", "scale_history")}
               for k, r in (("fp32", reference), ("mixed", mixed))}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nsample ({mixed['precision']} model, prompt 'def '):\n" + "\n".join(sample.splitlines()[:8]))
    print(f"\nrun folder: {out}")
    for what, path in [("checkpoint", mixed["checkpoint"]), ("metrics", out / "metrics.jsonl"),
                       *[("plot", p) for p in plots], ("sample", out / "sample.txt"), ("summary", out / "summary.json")]:
        if path is not None:
            print(f"  {what:<10} {path}")
    return 0
