"""``mixprec doctor``: measure underflow and overflow in a model, explain them, recommend a precision."""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from mixprec.cli.run_config import ConfigError, load_config
from mixprec.precision import PrecisionPerformanceWarning, resolve_precision

EXAMPLES = """Examples:
  mixprec doctor --task pycode --size tiny
  mixprec doctor --task digits --arch cnn --steps 30
  PYTHONPATH=examples mixprec doctor --model user_task:model --data user_task:data
  mixprec doctor --precision fp8 --task pycode --size small --write-filter fp8.json
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", allow_abbrev=False, usage="mixprec doctor [CONFIG.toml] [--steps N] [--task NAME ...]",
                       help="probe a model in fp32, fp16 and bf16: where its numbers underflow or overflow, and why",
                       description="Train a fresh copy of the model for a few steps in fp32, fp16-mixed and "
                       "bf16-mixed with the gradient statistics and the overflow tracer on; write report.md, "
                       "report.json and three plots; recommend a precision and an initial fp16 loss scale.",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="steps per precision (default: 20)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--cpu", action="store_true", help="probe on the CPU even where CUDA is available")
    p.add_argument("--out", default=None, help="report folder (default: runs/doctor-<time>)")
    p.add_argument("--precision", default=None,
                   help="fp8: measure, per Linear layer, what torchao's float8 casts do to it (on the CPU), "
                        "which layers must stay bf16, and the loss of fp8 against bf16-mixed")
    p.add_argument("--recipes", default="tensorwise,rowwise",
                   help="with --precision fp8: the float8 recipes to measure (default: tensorwise,rowwise)")
    p.add_argument("--write-filter", metavar="FILE", default=None,
                   help="with --precision fp8: write the recommended layers and recipe as the fp8 precision's "
                        "filter (PrecisionConfig(**mixprec.precision.fp8.load_fp8_filter(FILE)))")
    p.set_defaults(func=run, accepts_overrides=True, config=None)  # CONFIG.toml: taken by mixprec.cli.main


def run(args: argparse.Namespace, overrides: list[str] | None = None) -> int:
    from mixprec.apps.doctor import DoctorConfig, run_doctor
    from mixprec.cli.train import build_task

    try:
        cfg = load_config(args.config, overrides or [])
        task = build_task(cfg.task)
        doctor = DoctorConfig(steps=args.steps, batch_size=args.batch_size, learning_rate=args.learning_rate, cpu=args.cpu)
    except (ConfigError, ValueError) as e:
        print(f"mixprec doctor: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out or f"runs/doctor-{time.strftime('%Y%m%d-%H%M%S')}")
    if args.precision is not None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", PrecisionPerformanceWarning)
                float8 = resolve_precision(args.precision, "cpu").float8_linears
        except ValueError as e:
            print(f"mixprec doctor: error: {e}", file=sys.stderr)
            return 2
        if not float8:
            print(f"mixprec doctor: error: --precision takes fp8 (the doctor probes fp32, fp16-mixed and bf16-mixed "
                  f"without it), got {args.precision!r}", file=sys.stderr)
            return 2
        return _run_fp8(args, task, out)
    print(f"mixprec doctor: {task.name}, {args.steps} steps each in fp32, fp16-mixed, bf16-mixed ...")
    try:
        report = run_doctor(task.build_model, task.train_dataset, out, collate=task.collate_fn, config=doctor,
                            task_name=task.name)
    except ValueError as e:  # e.g. a model that returns no loss (mixprec.models.loss_of says what it must return)
        print(f"mixprec doctor: error: {e}", file=sys.stderr)
        return 2
    rec = report["recommendation"]
    print(f"\nrecommendation: {rec['precision']}")
    for reason in rec["reasons"]:
        print(f"  - {reason}")
    print(f"initial loss scale for fp16: {rec['fp16_init_scale']:g}")
    print(f"\nreport: {out / 'report.md'}  ({out / 'report.json'})")
    for path in report["plots"].values():
        print(f"plot:   {path}")
    return 0


def _run_fp8(args: argparse.Namespace, task: Any, out: Path) -> int:
    from mixprec.apps.fp8_doctor import Fp8DoctorConfig, run_fp8_doctor

    try:
        config = Fp8DoctorConfig(steps=args.steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
                                 recipes=tuple(r.strip() for r in args.recipes.split(",") if r.strip()))
    except ValueError as e:
        print(f"mixprec doctor: error: {e}", file=sys.stderr)
        return 2
    print(f"mixprec doctor: {task.name}, fp8: {args.steps} steps of a bf16-mixed probe with every Linear's float8 "
          f"casts measured ({', '.join(config.recipes)}), then loss probes ...")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionPerformanceWarning)
        report = run_fp8_doctor(task.build_model, task.train_dataset, out, collate=task.collate_fn, config=config,
                                task_name=task.name, write_filter=args.write_filter)
    rec = report["recommendation"]
    print(f"\nrecommendation: fp8 ({rec['recipe']}), {len(rec['converted'])} Linear layers in float8, "
          f"{len(rec['keep_in_bf16'])} kept in bf16:")
    for name, why in rec["keep_in_bf16"].items():
        print(f"  - {name}: {why}")
    for run, gap in report["loss_gap"].items():
        print(f"loss of {run} against bf16-mixed: {gap:+.2%}")
    if "filter" in report:
        print(f"\nfilter: {report['filter']}  (PrecisionConfig(**mixprec.precision.fp8.load_fp8_filter(...)))")
    print(f"report: {out / 'report.md'}  ({out / 'report.json'})")
    for path in report["plots"].values():
        print(f"plot:   {path}")
    return 0
