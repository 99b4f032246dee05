"""``mixprec run``: run a training script, a module or a command with mixprec as the engine under
transformers' Trainer (:func:`mixprec.patch_transformers`), with no change to its code."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import shutil
import subprocess
import sys
import warnings
from importlib import metadata
from pathlib import Path

from mixprec.cli.engine_boot import sitecustomize as boot
from mixprec.precision import PrecisionPerformanceWarning, precision_names, resolve_precision

EXAMPLES = """Examples:
  mixprec run train.py --output_dir out                  # a script that trains with transformers' Trainer
  mixprec run --precision bf16-true train.py ...          # over what its TrainingArguments say
  mixprec run -m my_package.train --epochs 3              # a module, as python -m runs it
  mixprec run trl sft --model_name_or_path ... --bf16     # a command (trl's command line)
  torchrun --nproc_per_node 2 -m mixprec.cli run train.py # every process
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run", allow_abbrev=False, usage="mixprec run [--precision P] (SCRIPT.py | -m MODULE | COMMAND) [ARGS...]",
        help="run a script, module or command with transformers' Trainer (and trl's, ...) on mixprec's Accelerator",
        description="Turn on mixprec.patch_transformers() and run the script, module (-m) or installed command "
        "with its arguments, in this process and in every Python process it starts (trl's command line and "
        "accelerate launch start new ones). transformers' Trainer and every subclass of it (trl's "
        "SFTTrainer, DPOTrainer, GRPOTrainer...) then train through mixprec's Accelerator: fp16 on the CPU "
        "is real fp16, the first log says the precision in force.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precision", default=None,
                   help="train in this precision whatever the TrainingArguments say: "
                        f"{', '.join(precision_names())} (default: what fp16=/bf16= say)")
    p.add_argument("--on-loss-scale-collapse", choices=("raise", "fallback"), default=None,
                   help="when the fp16 loss scale collapses: raise (default) or fall back to bf16-mixed (else fp32)")
    p.add_argument("-m", dest="module", default=None, metavar="MODULE", help="run a module, as python -m does")
    p.add_argument("target", nargs="*", metavar="SCRIPT.py | COMMAND [ARGS...]",
                   help="the script or command and its arguments (with -m, the module's arguments)")
    p.set_defaults(func=run)


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """``mixprec run``'s own arguments and the target's: everything from the script or command
    (or after ``-m MODULE``) on is the target's, however it looks (``--output_dir``, ``-m``...)."""
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg in ("--precision", "--on-loss-scale-collapse"):
            i += 2
        elif arg.startswith(("--precision=", "--on-loss-scale-collapse=")) or arg in ("-h", "--help"):
            i += 1
        elif arg == "-m":
            return argv[:i + 2], argv[i + 2:]
        else:
            return argv[:i], argv[i:]
    return argv, []


def _command(name: str):
    """The installed console command ``name`` (``trl``, ...), as its entry point."""
    found = metadata.entry_points(group="console_scripts", name=name)
    return next(iter(found), None)


def run(args: argparse.Namespace) -> int:
    target = list(args.target)
    if args.module is None and not target:
        print("mixprec run: give a script, -m MODULE, or a command to run (mixprec run --help)", file=sys.stderr)
        return 2
    precision = None
    if args.precision is not None:
        try:
            with warnings.catch_warnings():  # checked here, said where it trains (a child process, for a launcher)
                warnings.simplefilter("ignore", PrecisionPerformanceWarning)
                precision = resolve_precision(args.precision).name if args.precision != "auto" else "auto"
        except ValueError as e:
            print(f"mixprec run: {e}", file=sys.stderr)
            return 2
    options = {} if args.on_loss_scale_collapse is None else {"on_loss_scale_collapse": args.on_loss_scale_collapse}
    spec = {"precision": precision, "options": options}
    # The processes the target starts (accelerate launch, torchrun, trl's command line) turn it on too.
    os.environ[boot.ENV] = json.dumps(spec)
    here = str(Path(boot.__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])
    boot.install(spec)
    try:
        if args.module is not None:
            sys.argv = [args.module, *target]
            runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        elif target[0].endswith(".py") or (Path(target[0]).is_file() and not os.access(target[0], os.X_OK)):
            if not Path(target[0]).is_file():
                print(f"mixprec run: no such script: {target[0]}", file=sys.stderr)
                return 2
            sys.argv = target
            sys.path.insert(0, str(Path(target[0]).resolve().parent))  # as python script.py puts its folder first
            runpy.run_path(target[0], run_name="__main__")
        elif (entry := _command(target[0])) is not None:  # a Python command (trl, accelerate): here
            sys.argv = target
            result = entry.load()()
            return int(result or 0) if isinstance(result, (int, type(None))) else 0
        elif shutil.which(target[0]) is not None:  # any other program (python, torchrun...): its Python
            return subprocess.call(target)  # processes turn the switch on (PYTHONPATH, above)
        else:
            print(f"mixprec run: {target[0]!r} is neither a script nor a command found on PATH; give a .py file, "
                  "-m MODULE, or a command such as trl or torchrun", file=sys.stderr)
            return 2
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0
