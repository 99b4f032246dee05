"""``mixprec demo``: the mixed-precision lesson, measured in this run, in about two and a half minutes.

The lesson in its order: 16-bit makes training faster where the hardware has it; fp16's range is
narrow; small gradient values fall to zero (underflow); scaling the loss keeps them. Where a
16-bit format is native, fp32 and it race for the same seconds; where none is, they run the same
steps and the demo says how much slower the emulation was, and where the speed is to be had.
Then, on every machine, fp32 and fp16 with and without its loss scaler train the same steps,
their loss averaged as in a large optimizer step, and the demo shows what flushed to zero and
what that cost, and the loss scale growing and backing off. It ends with the conclusion.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from mixprec.apps.demo import (
    EVAL_BLOCKS,
    DemoRun,
    demo_task,
    held_out_line,
    next_byte_accuracy,
    predicted_line,
    train_in_fresh_process,
)
from mixprec.tasks import TASKS

EXAMPLES = """Examples:
  mixprec demo                              # ~2.5 minutes, whatever the machine
  mixprec demo --seconds 10                 # a quicker look
  mixprec demo --lesson-steps 0             # the speed comparison alone
  mixprec demo --precision fp16 --out runs/fp16-demo
"""

#: The lesson's model: fp16's matrix products are emulated on most CPUs (measured 9x slower than
#: fp32 on pycode/tiny on a CPU held to AVX2), and this size still takes a few hundred steps in the
#: seconds given, enough for underflow to cost and for the loss scale to move.
LESSON_SIZE = "tiny"

#: The tokens each lesson step's loss is averaged over: GPT-2's batch (512 sequences of 1024).
#: Averaged over its own 512 tokens, the lesson's gradients stay inside fp16's range and an fp16
#: run without loss scaling trains as fp32 does (benchmarks/RESULTS.md, "The demo's lesson").
STEP_TOKENS = 2**19

#: The loss scaler's growth interval in the lesson: the scale doubles after this many clean steps
#: (torch's default, 2000, would never be reached in a demo of a few hundred).
GROWTH_INTERVAL = 10

#: The default seconds of each timed run where a 16-bit format is native (the race's two and the
#: lesson's first), and where none is (the lesson's first, the only one): the demo takes about
#: the same time on either machine, two and a half minutes on 2 cores (benchmarks/RESULTS.md).
RACE_SECONDS = 25.0
LESSON_ALONE_SECONDS = 40.0

#: The generated sample: a prompt every Python file has plenty of, at a temperature low enough that
#: a few minutes' model writes recognisable Python (at 1.0 it samples its uncertainty: noise).
SAMPLE_PROMPT = "def "
SAMPLE_TEMPERATURE = 0.5

#: What an NVIDIA H200 gives: fp16-mixed against fp32 on pycode ``small`` (benchmarks/RESULTS.md,
#: "The first GPU figures": batch 64 x 256 tokens, 13.9 ms against 62.5 ms a step).
GPU_FIGURE = "on an NVIDIA H200, fp16-mixed trained pycode/small 4.4x as fast as fp32 (benchmarks/RESULTS.md)"

#: What CPUs with native bf16 give: this demo's own race of ``mini`` on 2 cores of an AMD EPYC with
#: AVX512-BF16 (three runs, benchmarks/RESULTS.md "Issue 49, section 1"), and the previous demo's
#: race, the same model for 75 s each, on an Intel Xeon with AMX-BF16 ("Issue 35").
CPU_FIGURE = ("on 2 cores of an AMD EPYC with AVX512-BF16, bf16-mixed trained pycode/mini 1.2-1.6x as fast as fp32 "
              "in this demo's race, on an Intel Xeon with AMX-BF16 2.2x (benchmarks/RESULTS.md)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the mixed-precision lesson, measured here: speed, underflow, loss scaling",
                       description="Train the built-in pycode GPT (the Python standard library's source, byte by "
                       "byte) to show the mixed-precision lesson as this run's measurements: where a 16-bit format is "
                       "native, fp32 and it for the same seconds (the speed-up); where none is, the same steps (how "
                       "much slower the emulation is, and where the speed is to be had); then fp32 and fp16 with and "
                       "without the loss scaler for the same steps (what flushed to zero, what it cost, the scale "
                       "growing and backing off). Writes a run folder with the checkpoints, metrics, one plot, a "
                       "generated sample and summary.json.",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default=None, choices=TASKS["pycode"].variants,
                   help=f"model size of the race where a 16-bit format is native (default: "
                   f"{TASKS['pycode'].defaults['size']}); the lesson's model is {LESSON_SIZE}")
    p.add_argument("--precision", default="auto", help="the precision set against fp32 for speed (default: auto; "
                   "where auto would pick fp32, fp16-mixed)")
    p.add_argument("--seconds", type=float, default=None, help="training seconds of each timed run: the race's two "
                   "and the lesson's loss-scaled fp16 run; the lesson's others take as many steps (default: "
                   f"{RACE_SECONDS:g} where the race runs, {LESSON_ALONE_SECONDS:g} where it does not: about the same "
                   "length on every machine)")
    p.add_argument("--steps", type=int, default=None, help="a fixed number of optimizer steps for the speed "
                   "comparison's runs instead of --seconds")
    p.add_argument("--lesson-steps", type=int, default=None, help="a fixed number of steps for the lesson's runs "
                   "instead of --seconds; 0 leaves the lesson out")
    p.add_argument("--step-tokens", type=int, default=STEP_TOKENS, help="the lesson's loss is averaged over this "
                   "many tokens a step, as in an optimizer step that large (default: %(default)s, GPT-2's batch)")
    p.add_argument("--growth-interval", type=int, default=GROWTH_INTERVAL, help="the lesson's loss scaler doubles "
                   "the scale after this many clean steps (default: %(default)s; torch's is 2000)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--train-bytes", type=int, default=None, help="bytes of training text to read (default: 4 MB)")
    p.add_argument("--eval-bytes", type=int, default=None, help="bytes of validation text (default: 200 kB; each "
                   f"evaluation reads its first {EVAL_BLOCKS} blocks)")
    p.add_argument("--out", default=None, help="run folder (default: runs/demo-<time>)")
    p.add_argument("--no-progress", action="store_true", help="no progress lines")
    p.set_defaults(func=run)


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


def _errors(args: argparse.Namespace) -> str | None:
    if args.steps is not None and args.steps < 4:
        return "--steps must be at least 4"
    if args.lesson_steps is not None and 0 < args.lesson_steps < 4 or (args.lesson_steps or 0) < 0:
        return "--lesson-steps must be 0 (no lesson) or at least 4"
    if args.seconds is not None and not args.seconds >= 4:
        return "--seconds must be at least 4"
    if args.step_tokens < 1 or args.growth_interval < 1:
        return "--step-tokens and --growth-interval must be at least 1"
    return None


class _Runner:
    """Trains each run in a fresh process (its peak memory its own) and says what it is."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.data, self.batch, self.progress, self.out = (args.train_bytes, args.eval_bytes), args.batch_size, \
            not args.no_progress, out

    def __call__(self, run: DemoRun) -> dict[str, Any]:
        return train_in_fresh_process(dataclasses.replace(run, out=str(self.out / run.out)), self.data, self.batch,
                                      self.progress)


def run(args: argparse.Namespace) -> int:
    import warnings

    from mixprec.apps.demo_report import conclusion, lesson_lines, scale_lines, speed_lines, table
    from mixprec.apps.plots import plot_demo
    from mixprec.hardware import detect_capability
    from mixprec.precision import PrecisionPerformanceWarning, resolve_precision

    warnings.simplefilter("ignore", PrecisionPerformanceWarning)  # the demo says what is fast here itself
    if (error := _errors(args)) is not None:
        print(f"mixprec demo: error: {error}", file=sys.stderr)
        return 2
    try:
        policy = resolve_precision(args.precision)
    except ValueError as e:
        print(f"mixprec demo: error: {e}", file=sys.stderr)
        return 2
    cap = detect_capability(None)
    auto_fp32 = not policy.is_low_precision and args.precision == "auto"
    if auto_fp32:  # nothing 16-bit is fast here: run the numerics the lesson is about, and say so
        policy = resolve_precision("fp16-mixed")
    raced = not auto_fp32 and (not policy.is_low_precision or cap.is_native(policy.name))
    why = (policy.reason or f"{policy.name} is native on {cap.device}") if raced else (
        cap.reasons.get(policy.name) or f"{policy.name} is not native on {cap.device}")
    out = Path(args.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    size = args.size or TASKS["pycode"].defaults["size"]
    timed = float(args.seconds or (RACE_SECONDS if raced else LESSON_ALONE_SECONDS))
    lesson_budget = args.lesson_steps if args.lesson_steps is not None else timed
    train = _Runner(args, out)

    print("mixprec demo: the mixed-precision lesson, measured in this run, on the pycode GPT (the standard library's "
          "source, byte by byte)")
    if auto_fp32:
        print(f"  auto would pick fp32 here ({resolve_precision('auto').reason}); fp16-mixed runs instead, to show "
              "what 16-bit costs here and what loss scaling does")
    if raced:
        plan = f"{args.steps} steps" if args.steps else f"{timed:.0f} s of training"
        print(f"  1. speed: fp32 against {policy.name} on pycode/{size}, {plan} each")
    else:
        print(f"  1. speed: fp32 against {policy.name} on pycode/{LESSON_SIZE}, step for step")
    if lesson_budget:
        plan = f"{lesson_budget} steps" if isinstance(lesson_budget, int) else f"{timed:.0f} s of training"
        print(f"  2.-4. fp16's range, underflow and loss scaling: fp16 with its loss scaler for {plan} on "
              f"pycode/{LESSON_SIZE}, then fp16 without one and fp32 for as many steps")
    sizes = dict.fromkeys([size] if raced else []) | dict.fromkeys([LESSON_SIZE] if lesson_budget or not raced else [])
    for name in sizes:
        task = demo_task(name, *train.data)
        print(f"  data of pycode/{name}: {len(task.train_dataset)} training blocks of {task.train_dataset.block_size} "
              f"bytes of the standard library's source; evaluated on {min(EVAL_BLOCKS, len(task.eval_dataset))} "
              "validation blocks")
    speed: list[dict[str, Any]] = []
    lesson: dict[str, dict[str, Any]] = {}
    try:
        if raced:
            budget = args.steps or timed
            names = dict.fromkeys(("fp32", policy.name))  # (fp32 alone where it was asked for)
            speed = [train(DemoRun(name=n, label=f"race-{n}", precision=n, size=size, budget=budget, out=f"race-{n}"))
                     for n in names]
        if lesson_budget:
            lesson = _lesson(train, args, lesson_budget)
        if not raced:
            speed = _step_for_step(train, args, policy.name, lesson, timed)
    except ValueError as e:  # a setting the Trainer refuses (its message says the fix)
        print(f"mixprec demo: error: {e}", file=sys.stderr)
        return 2

    natives = [GPU_FIGURE, CPU_FIGURE]
    print("\n1. Speed")
    print(table(speed))
    print(f"(speed-up: tokens/s against fp32, from the median step; seconds: of training, evaluations and checkpoints "
          f"left out; memory: {speed[-1]['memory_kind']})")
    print("\n".join(speed_lines(speed, raced, why, natives)))
    if lesson:
        intro, results = lesson_lines(lesson)
        print()
        print("\n".join(intro))
        print(table(list(lesson.values())))
        print("\n".join(results))
        if raced and not cap.is_native("fp16-mixed"):
            print(f"   (fp16 is not native here: {cap.reasons.get('fp16-mixed', 'it is emulated')}; these runs show "
                  "its numerics, and their seconds what emulating it costs)")
        print()
        print("\n".join(scale_lines(lesson["fp16-mixed"], args.growth_interval)))
    plot = plot_demo(speed, lesson or None, out / "demo.png", raced=raced, native_figure=natives[0],
                     title=f"mixprec demo: fp32 against {policy.name}" + (", and fp16's loss scaling" if lesson else ""))
    sampled = speed[-1]
    learned = _show_what_it_learned(sampled, train.data, out)
    summary = {"raced": raced, "speed": [_summary(r) for r in speed],
               "lesson": {n: _summary(r) for n, r in lesson.items()} or None,
               "scale_history": lesson["fp16-mixed"]["scale_history"] if lesson else None,
               "sampled": {"run": sampled["name"], "checkpoint": sampled["checkpoint"],
                           "next_byte_accuracy": learned["trained"]}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nrun folder: {out}")
    for what, path in [("checkpoint", sampled["checkpoint"]), ("plot", plot), ("sample", out / "sample.txt"),
                       ("summary", out / "summary.json")]:
        print(f"  {what:<10} {path}")
    print()
    print("\n".join(conclusion(speed, raced, lesson or None, _native(cap, policy) if raced else
                                "this CPU emulates 16-bit arithmetic" if cap.type == "cpu" else why)))
    return 0


def _lesson(train: _Runner, args: argparse.Namespace, budget: float | int) -> dict[str, dict[str, Any]]:
    """fp16-mixed with its loss scaler for ``budget``, then fp16 without one and fp32 for as many steps."""
    # The gradients recorded every 10 steps (then every 50), or 5 times in a shorter run: at the same
    # steps in the three runs.
    every = 10 if isinstance(budget, float) or budget >= 50 else max(1, budget // 5)
    common = {"size": LESSON_SIZE, "step_tokens": args.step_tokens, "observe_every": every}
    scaled = train(DemoRun(name="fp16-mixed", precision="fp16-mixed", budget=budget, out="fp16-mixed",
                           loss_scaler={"growth_interval": args.growth_interval}, **common))
    # The others: its steps at its learning rates (a timed run's schedule follows its clock).
    common.update(budget=scaled["steps"], lr_factors=scaled["lr_factors"])
    bare = train(DemoRun(name="fp16-unscaled", precision="fp16-mixed", out="fp16-unscaled",
                         loss_scaler={"enabled": False}, **common))
    ref = train(DemoRun(name="fp32", precision="fp32", out="fp32", **common))
    return {"fp32": ref, "fp16-mixed": scaled, "fp16-unscaled": bare}


def _step_for_step(train: _Runner, args: argparse.Namespace, name: str, lesson: dict[str, dict[str, Any]],
                   timed: float) -> list[dict[str, Any]]:
    """fp32 and ``name`` for the same steps on the lesson's model: the lesson's own runs where it ran
    fp16-mixed; else ``name`` for ``--steps`` (or the seconds) and fp32 for as many."""
    if lesson and name in lesson:  # the lesson ran this precision already, beside fp32
        return [lesson["fp32"], lesson[name]]
    common = {"size": LESSON_SIZE, "step_tokens": args.step_tokens if lesson else None}
    if lesson:
        budget = lesson["fp32"]["steps"]
    else:
        budget = args.steps or timed
    if lesson:
        common["lr_factors"] = lesson["fp32"]["lr_factors"]
    mixed = train(DemoRun(name=name, precision=name, budget=budget, out=name, **common))
    ref = lesson["fp32"] if lesson else train(DemoRun(name="fp32", precision="fp32", budget=mixed["steps"],
                                                      out="fp32", lr_factors=mixed["lr_factors"], **common))
    return [ref, mixed]


def _native(cap: Any, policy: Any) -> str:
    """What makes ``policy``'s precision fast on ``cap``'s device, in a few words."""
    name = policy.name
    if not policy.is_low_precision:
        return f"{name} is native everywhere"
    if cap.type != "cpu":
        return f"{name} is native on {cap.name}"
    flags = [f.upper().replace("_", "-") for f in ("amx_bf16", "avx512_bf16", "amx_fp16") if cap.flags.get(f)]
    return f"{name} is native on this CPU: {', '.join(flags) or 'as detected'}"


def _summary(r: dict[str, Any]) -> dict[str, Any]:
    """A run's result for summary.json: without its curves and histogram."""
    row = {k: v for k, v in r.items() if k not in ("train", "eval", "seconds", "scale_history", "grads", "lr_factors")}
    if r.get("grads"):
        row["grads"] = {k: v for k, v in r["grads"].items() if k != "histogram"}
    return row


def _show_what_it_learned(run: dict[str, Any], data: tuple[int | None, int | None], out: Path) -> dict[str, Any]:
    """Print the sampled run's guesses on a held-out line, its next-byte accuracy and a sample
    (written to ``out/sample.txt``)."""
    import safetensors.torch

    from mixprec.tasks import generate_sample

    task = demo_task(run["size"], *data)
    # Its fp32 master weights, run in fp32: what it learned, shown quickly where 16-bit is emulated.
    model = task.build_model()
    safetensors.torch.load_model(model, str(Path(run["checkpoint"]) / "model_0.safetensors"))
    sample = generate_sample(model, prompt=SAMPLE_PROMPT, max_new_tokens=240, temperature=SAMPLE_TEMPERATURE,
                             generator=torch.Generator().manual_seed(0))
    (out / "sample.txt").write_text(sample if isinstance(sample, str) else str(sample))
    learned = _what_it_learned(task, model)
    print(f"\nwhat the {run['name']} run's model learned (its weights, run in fp32): its guess of each next byte of a "
          "line of the standard library it never trained on, from the real bytes before it")
    print(f"  code:       {learned['line']}\n  its guess:  {learned['guess']}")
    print(f"  next bytes guessed right on the validation slice: {learned['trained']:.1%} (the untrained model: "
          f"{learned['untrained']:.1%}; always guessing a space: {learned['space']:.1%}); a sample it wrote is in "
          "sample.txt")
    return learned
