"""``mixprec doctor``: measure underflow and overflow in a model, explain them, recommend a precision."""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from mixprec.apps.progress import Progress
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
                        "recommend which layers stay bf16, and verify it: the filter's fp8 loss must come within "
                        "a tolerance of bf16-mixed's, else the doctor searches, else it recommends against fp8")
    p.add_argument("--recipes", default="tensorwise,rowwise",
                   help="with --precision fp8: the float8 recipes to measure (default: tensorwise,rowwise)")
    p.add_argument("--write-filter", metavar="FILE", default=None,
                   help="with --precision fp8: write the verified layers and recipe as the fp8 precision's "
                        "filter (PrecisionConfig(**mixprec.precision.fp8.load_fp8_filter(FILE))); nothing is "
                        "written when the doctor recommends against fp8")
    p.add_argument("--max-probes", type=int, default=4, metavar="N",
                   help="with --precision fp8: when the recommended filter's loss misses the tolerance, keep the "
                        "worst-ranked layers in bf16 one more at a time and probe each, at most N fp8 probes "
                        "(default: 4; one probe is --steps steps of fp8, emulated on a CPU: about 28 s at --steps "
                        "10 on pycode small on 2 cores, where the whole doctor takes about 2 minutes without a "
                        "search)")
    p.add_argument("--tolerance", type=float, default=None, metavar="FRACTION",
                   help="with --precision fp8: how far above bf16-mixed's loss a filter may end, relative (0.02: "
                        "2%%) (default: the gap between two bf16-mixed seeds' losses, held between 2%% and 5%%)")
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
    print(f"mixprec doctor: {task.name}, {args.steps} steps each in fp32, fp16-mixed, bf16-mixed ...", flush=True)
    progress = Progress("doctor")  # stderr: which probe runs, its step, the time left
    try:
        report = run_doctor(task.build_model, task.train_dataset, out, collate=task.collate_fn, config=doctor,
                            task_name=task.name, progress=progress)
    except ValueError as e:  # e.g. a model that returns no loss (mixprec.models.loss_of says what it must return)
        progress.close()
        print(f"mixprec doctor: error: {e}", file=sys.stderr)
        return 2
    finally:
        progress.close("probed")
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
    from mixprec.apps.fp8_report import summary_lines

    try:
        config = Fp8DoctorConfig(steps=args.steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
                                 recipes=tuple(r.strip() for r in args.recipes.split(",") if r.strip()),
                                 max_probes=args.max_probes, tolerance=args.tolerance)
    except ValueError as e:
        print(f"mixprec doctor: error: {e}", file=sys.stderr)
        return 2
    print(f"mixprec doctor: {task.name}, fp8: {args.steps} steps of a bf16-mixed probe with every Linear's float8 "
          f"casts measured ({', '.join(config.recipes)}), a second bf16-mixed seed for the tolerance, then fp8 "
          f"loss probes (a search of at most {config.max_probes} if the recommended filter misses) ...")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionPerformanceWarning)
        report = run_fp8_doctor(task.build_model, task.train_dataset, out, collate=task.collate_fn, config=config,
                                task_name=task.name, write_filter=args.write_filter)
    print()
    for line in summary_lines(report):
        print(line)
    if report["filter"] is not None:
        print(f"\nfilter: {report['filter']}  (PrecisionConfig(**mixprec.precision.fp8.load_fp8_filter(...)))")
    elif args.write_filter is not None:
        print(f"\nfilter: none written to {args.write_filter} (the verdict is against fp8)")
    print(f"report: {out / 'report.md'}  ({out / 'report.json'})")
    for path in report["plots"].values():
        print(f"plot:   {path}")
    return 0
