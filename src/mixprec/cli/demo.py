"""``mixprec demo``: what mixed precision does for training here, in about three minutes.

Trains the built-in ``pycode`` GPT in mixed precision beside fp32, for the same seconds on the
same data, then prints a summary and writes a run folder. Where ``auto`` finds no native 16-bit
format, the mixed run is fp16-mixed, so the loss scaler's work is shown on every machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from mixprec.apps.demo import (
    EVAL_BLOCKS,
    demo_task,
    held_out_line,
    next_byte_accuracy,
    predicted_line,
    train_in_fresh_process,
)
from mixprec.tasks import TASKS

EXAMPLES = """Examples:
  mixprec demo                              # ~2.5 minutes of training, whatever the machine
  mixprec demo --seconds 40                 # a quick look
  mixprec demo --precision fp16 --out runs/fp16-demo
"""

#: The model of the lesson run (fp16 where nothing 16-bit is native): its fp16 matrix products are
#: emulated, measured 16x slower than fp32 on a CPU held to AVX2; a smaller model still takes
#: hundreds of steps in the seconds given, enough to watch the loss scaler.
LESSON_SIZE = "tiny"

#: The generated sample: a prompt every Python file has plenty of, at a temperature low enough that
#: a few minutes' model writes recognisable Python (at 1.0 it samples its uncertainty: noise).
SAMPLE_PROMPT = "def "
SAMPLE_TEMPERATURE = 0.5

#: What an NVIDIA H200 gives: fp16-mixed against fp32 on pycode ``small`` (benchmarks/RESULTS.md,
#: "The first GPU figures": batch 64 x 256 tokens, 13.9 ms against 62.5 ms a step).
GPU_FIGURE = "on an NVIDIA H200, fp16-mixed trained pycode/small 4.4x as fast as fp32 (benchmarks/RESULTS.md)"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train a small GPT in mixed precision beside fp32 and show what it changes",
                       description="Train the built-in pycode GPT (the Python standard library's source, byte by "
                       "byte) in mixed precision and in fp32, for the same number of seconds on the same data; "
                       "print throughput, peak memory and validation loss for each, and what the loss scaler did "
                       "where fp16 runs; write a run folder with the checkpoint, metrics.jsonl, a plot and a "
                       "generated sample. Where no 16-bit format is native (auto would pick fp32), the mixed run "
                       "is fp16-mixed: real fp16 with the loss scaler, the numerics mixed precision is about.",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default=None, choices=TASKS["pycode"].variants,
                   help=f"model size (default: {TASKS['pycode'].defaults['size']}; {LESSON_SIZE} where the mixed run is "
                   "fp16 without native 16-bit support, whose emulated matrix products are many times slower)")
    p.add_argument("--precision", default="auto", help="the mixed run's precision (default: auto; where auto "
                   "would pick fp32, fp16-mixed)")
    p.add_argument("--seconds", type=float, default=150.0,
                   help="training seconds of the two runs together, half each (default: %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="a fixed number of optimizer steps for the mixed run "
                   "instead of --seconds")
    p.add_argument("--fp32-steps", type=int, default=None, help="with --steps: the fp32 run's (default: steps / 3)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--train-bytes", type=int, default=None, help="bytes of training text to read (default: 4 MB)")
    p.add_argument("--eval-bytes", type=int, default=None, help="bytes of validation text (default: 200 kB; each "
                   f"evaluation reads its first {EVAL_BLOCKS} blocks)")
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


def _loss_scaling_lines(mixed: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    """What the loss scaler did in the fp16 run, in words a newcomer can check in the plot."""
    history = mixed["scale_history"]
    scales = [s for _, s, _ in history]
    lines = [f"loss scale: {scales[0]:g} after the first step, {scales[-1]:g} at the end (lowest {min(scales):g}); "
             f"{mixed['skipped_steps']} of {mixed['steps']} steps skipped for inf/NaN gradients (the scaler "
             "halved the scale and tried again)"]
    if mixed["flush"]:
        step, unscaled, at_scale, module = max(mixed["flush"], key=lambda r: r[1])
        lines.append(f"underflow: without the scale, {unscaled:.1%} of the gradient values of layer `{module}` "
                     f"would have flushed to zero in fp16 (step {step}); at the scale used, "
                     f"{max(r[2] for r in mixed['flush']):.1%} at worst in any layer")
    gap = mixed["final_eval_loss"] / reference["final_eval_loss"] - 1
    lines.append(f"val loss: {mixed['final_eval_loss']:.3f} in fp16-mixed against {reference['final_eval_loss']:.3f} "
                 f"in fp32 ({gap:+.1%}) after the same {mixed['training_seconds']:.0f} s of training")
    same = _loss_at(reference["train"], mixed["steps"])
    if mixed["steps"] < reference["steps"] and same is not None and mixed["train"]:
        step, theirs = same
        ours = mixed["train"][-1][1]
        lines.append(f"  in those seconds fp32 took {reference['steps']} steps and fp16-mixed {mixed['steps']}; step for "
                     f"step: training loss {ours:.3f} at step {mixed['train'][-1][0]} against fp32's {theirs:.3f} at "
                     f"step {step} ({ours / theirs - 1:+.1%}; fp32's learning rate was still high there, its schedule "
                     "following its own seconds)")
    return lines


def _loss_at(points: list[tuple[int, float]], step: int) -> tuple[int, float] | None:
    """The logged ``(step, loss)`` nearest to ``step`` at or before it."""
    before = [p for p in points if p[0] <= step]
    return before[-1] if before else None


def _what_it_learned(task: Any, model: torch.nn.Module) -> dict[str, Any]:
    """The trained ``model``'s byte-by-byte guesses on a held-out line, and its next-byte accuracy
    on the evaluation slice beside an untrained model's and the most common byte's (a space)."""
    blocks = torch.utils.data.Subset(task.eval_dataset, range(min(EVAL_BLOCKS, len(task.eval_dataset))))
    text = torch.cat([task.eval_dataset[i]["input_ids"] for i in range(min(len(task.eval_dataset), 400))])
    context, line = held_out_line(text, model.config.block_size)
    torch.manual_seed(0)
    untrained = task.build_model()
    targets = torch.cat([blocks[i]["input_ids"][1:] for i in range(len(blocks))])
    return {"line": line.decode("ascii"), "guess": predicted_line(model, context, line),
            "trained": next_byte_accuracy(model, blocks), "untrained": next_byte_accuracy(untrained, blocks),
            "space": float((targets == ord(" ")).float().mean())}


def run(args: argparse.Namespace) -> int:
    import warnings

    from mixprec.apps.plots import plot_demo
    from mixprec.precision import PrecisionPerformanceWarning, resolve_precision
    from mixprec.tasks import generate_sample

    warnings.simplefilter("ignore", PrecisionPerformanceWarning)  # the demo says what is fast here itself

    if args.steps is not None and args.steps < 4:
        print("mixprec demo: error: --steps must be at least 4", file=sys.stderr)
        return 2
    if args.steps is None and not args.seconds >= 4:
        print("mixprec demo: error: --seconds must be at least 4", file=sys.stderr)
        return 2
    try:
        policy = resolve_precision(args.precision)
    except ValueError as e:
        print(f"mixprec demo: error: {e}", file=sys.stderr)
        return 2
    lesson = not policy.is_low_precision and args.precision == "auto"
    if lesson:  # nothing 16-bit is fast here: run the numerics the lesson is about, and say so
        policy = resolve_precision("fp16-mixed")
    args.size = args.size or (LESSON_SIZE if lesson else TASKS["pycode"].defaults["size"])
    out = Path(args.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    if args.steps is None:
        budgets = (args.seconds / 2, args.seconds / 2)
        plan = f"{args.seconds / 2:.0f} s of training each"
    else:
        budgets = (args.fp32_steps or max(4, args.steps // 3), args.steps)
        plan = f"{budgets[1]} and {budgets[0]} steps"
    print(f"mixprec demo: pycode/{args.size} in {policy.name} beside fp32, {plan}")
    print(f"  {policy.name}: " + (f"auto would pick fp32 here ({resolve_precision('auto').reason}); fp16-mixed "
                                  "runs instead, to show what loss scaling does" if lesson else
                                  policy.reason or "as asked"))
    data = (args.train_bytes, args.eval_bytes)
    task = demo_task(args.size, *data)
    print(f"data: {len(task.train_dataset)} training blocks of {task.train_dataset.block_size} bytes from the "
          f"standard library's source; evaluated on {min(EVAL_BLOCKS, len(task.eval_dataset))} validation blocks")
    # Each run in a fresh process: its peak memory is its own, not what an earlier run left.
    try:
        reference = train_in_fresh_process(args.size, data, "fp32", budgets[0], str(out / "fp32"), args.batch_size,
                                           not args.no_progress, "fp32")
        mixed = train_in_fresh_process(args.size, data, policy.name, budgets[1], str(out), args.batch_size,
                                       not args.no_progress, policy.name)
    except ValueError as e:  # a setting the Trainer refuses (its message says the fix)
        print(f"mixprec demo: error: {e}", file=sys.stderr)
        return 2
    print()
    print(_table([reference, mixed]))
    print(f"(speed-up: tokens/s against fp32; memory: {mixed['memory_kind']})")
    if mixed["scale_history"]:
        print("\n".join(_loss_scaling_lines(mixed, reference)))
    if lesson:
        print("speed: no 16-bit format is native on this CPU, so fp16 runs no faster than fp32 here; mixed "
              f"precision's speed needs native 16-bit hardware (AMX or AVX512-BF16 CPUs, GPU tensor cores): {GPU_FIGURE}")
    elif mixed["tokens_per_second"] < 1.1 * reference["tokens_per_second"]:
        print(f"speed: {mixed['precision']} ran no faster than fp32 on this model and machine (a small model's "
              f"casts can cost what its matrix products save; `mixprec bench` measures larger ones): {GPU_FIGURE}")
    plot = plot_demo(reference, mixed, out / "demo.png", title=f"pycode/{args.size}: fp32 against {mixed['precision']}")
    import safetensors.torch

    from mixprec.accelerator.accelerator import Accelerator

    model = Accelerator(mixed_precision=policy.name).prepare(task.build_model())
    safetensors.torch.load_model(model, str(Path(mixed["checkpoint"]) / "model_0.safetensors"))
    sample = generate_sample(model, prompt=SAMPLE_PROMPT, max_new_tokens=240, temperature=SAMPLE_TEMPERATURE,
                             generator=torch.Generator().manual_seed(0))
    (out / "sample.txt").write_text(sample if isinstance(sample, str) else str(sample))
    learned = _what_it_learned(task, model)
    mixed["next_byte_accuracy"] = learned["trained"]
    summary = {k: {kk: vv for kk, vv in r.items() if kk not in ("train", "eval", "seconds", "scale_history")}
               for k, r in (("fp32", reference), ("mixed", mixed))}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nwhat the {mixed['precision']} model learned: its guess of each next byte of a line of the standard "
          "library it never trained on, from the real bytes before it")
    print(f"  code:       {learned['line']}\n  its guess:  {learned['guess']}")
    print(f"  next bytes guessed right on the validation slice: {learned['trained']:.1%} (the untrained model: "
          f"{learned['untrained']:.1%}; always guessing a space: {learned['space']:.1%})")
    print(f"\nwhat it writes after {SAMPLE_PROMPT.strip()!r} (temperature {SAMPLE_TEMPERATURE}; a few minutes of CPU "
          "training give a model that has learned indentation, names and punctuation, not yet Python):\n"
          + "\n".join(line for line in sample.splitlines()[:6] if line.strip()))
    print(f"\nrun folder: {out}")
    for what, path in [("checkpoint", mixed["checkpoint"]), ("metrics", out / "metrics.jsonl"), ("plot", plot),
                       ("sample", out / "sample.txt"), ("summary", out / "summary.json")]:
        print(f"  {what:<10} {path}")
    return 0
