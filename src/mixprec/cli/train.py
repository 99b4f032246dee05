"""``mixprec train CONFIG.toml [--key VALUE ...]``: a whole Trainer run from a config file."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mixprec.apps.progress import Progress
from mixprec.cli.run_config import ConfigError, RunConfig, TaskConfig, load_config
from mixprec.distributed.preemption import PREEMPTED_EXIT_CODE
from mixprec.tasks import Task
from mixprec.trainer import Trainer, TrainerCallback
from mixprec.trainer.checkpoints import list_checkpoints

EXAMPLES = """Examples:
  mixprec train examples/pycode-tiny.toml
  mixprec train examples/digits-mlp.toml --max-steps 200 --precision bf16
  mixprec train examples/pycode-tiny.toml --resume          # continue the newest checkpoint
  mixprec train --task digits --arch cnn --output-dir runs/cnn --num-train-epochs 3

Flags override the file: --table.key VALUE for any key, or --FIELD VALUE for the
TrainingArguments field a [training], [precision] or [diagnostics] key sets (--max-steps,
--precision, --loss-scaler, --diagnostics-steps, --trace-overflow, --drift-steps), and --task,
--model, --data, --size, --arch, --max-bytes for [task]. Ctrl-C saves a checkpoint
and exits (status 130); so does SIGTERM, a scheduler's preemption (status 75); --resume
continues from it.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", allow_abbrev=False, usage="mixprec train [CONFIG.toml] [--resume] [--key VALUE ...]",
                       help="run a whole Trainer run from a TOML config (and --flags)",
                       description="Train a built-in task or your own model/data with the mixprec Trainer, "
                       "as a TOML config file and --flags describe it.",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output_dir")
    # CONFIG.toml (a TOML file with [task], [training], [precision], [diagnostics]) is taken by
    # mixprec.cli.main before parsing, so that override flags cannot be mistaken for it.
    p.set_defaults(func=run, accepts_overrides=True, config=None)


BuiltTask = Task  # the name this module used for the one Task record


def build_task(task: TaskConfig | Mapping[str, Any]) -> Task:
    """The :class:`~mixprec.tasks.Task` a ``[task]`` table names (built-in, or the user's factories).

    Args:
        task: A :class:`~mixprec.cli.run_config.TaskConfig`, or a ``[task]`` table as a dict.

    Raises:
        ConfigError: when the table is wrong, or a user factory cannot be imported or its data
            does not follow :data:`mixprec.tasks.DATA_CONTRACT`.
    """
    try:
        if not isinstance(task, TaskConfig):
            specs = {k: task[k] for k in ("name", "model", "data") if k in task}
            task = TaskConfig(**specs, options={k: v for k, v in task.items() if k not in specs})
        return task.load()
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        raise ConfigError(f"[task]: {e}") from None


class _Interrupt(TrainerCallback):
    """Ctrl-C: finish the current step, save a checkpoint, stop. A second Ctrl-C stops at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._previous = signal.signal(signal.SIGINT, self._handler)

    def _handler(self, signum, frame):
        self.requested = True
        signal.signal(signal.SIGINT, self._previous or signal.default_int_handler)
        print("\ninterrupted: saving a checkpoint after this step (Ctrl-C again to stop now)", file=sys.stderr)

    def on_step_end(self, args, state, control, **kwargs):
        if self.requested:
            control.should_save = True
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


class _SetUpShown(TrainerCallback):
    """Ends the set-up's progress line when training begins (the Trainer's own bar takes over)."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress

    def on_train_begin(self, args, state, control, **kwargs):
        self.progress.close()


def train_from_config(cfg: RunConfig, resume: bool = False) -> tuple[Trainer, str | None]:
    """Build the task and the Trainer from ``cfg`` and train; returns the trainer and what stopped it
    early after writing a checkpoint: ``"Ctrl-C"``, ``"SIGTERM"`` (a preemption) or ``None``.

    Until the Trainer's progress bar starts, a line on stderr says what the set-up does (loading
    the task, building the Trainer), on the main process and unless ``disable_tqdm``.
    """
    main_process = int(os.environ.get("RANK", "0")) == 0  # torchrun's: one line, not one per process
    progress = Progress("train", enabled=main_process and not cfg.training.disable_tqdm)
    try:
        task = cfg.task.name or cfg.task.model or "the task"
        progress.stage("loading the task", task)
        built = build_task(cfg.task)
        precision = cfg.training.precision
        progress.stage("building the Trainer", f"{built.name}'s model" + (f", precision {precision}" if precision else ""))
        interrupt = _Interrupt()
        trainer = Trainer(model=built.build_model(), args=cfg.training, train_dataset=built.train_dataset,
                          eval_dataset=built.eval_dataset, data_collator=built.collate_fn,
                          compute_metrics=built.compute_metrics,
                          preprocess_logits_for_metrics=built.preprocess_logits_for_metrics,
                          callbacks=[interrupt, _SetUpShown(progress)])
        progress.stage("starting the run", "from the newest checkpoint" if resume else "")
        try:
            trainer.train(resume_from_checkpoint=True if resume else None)
        except SystemExit as e:  # the Trainer's exit after a SIGTERM, its checkpoint written
            if e.code != PREEMPTED_EXIT_CODE:
                raise
            return trainer, "SIGTERM"
    finally:
        progress.close()
    return trainer, "Ctrl-C" if interrupt.requested else None


def run(args: argparse.Namespace, overrides: list[str] | None = None) -> int:
    try:
        cfg = load_config(args.config, overrides or [])
        trainer, stopped_by = train_from_config(cfg, resume=args.resume)
    except ConfigError as e:
        print(f"mixprec train: error: {e}", file=sys.stderr)
        return 2
    out = Path(cfg.training.output_dir)
    ckpts = list_checkpoints(out)
    if stopped_by is not None:
        print(f"stopped by {stopped_by} at step {trainer.state.global_step}; checkpoint: {ckpts[-1] if ckpts else '-'}\n"
              f"continue with: mixprec train {args.config or ''} --resume".replace("  ", " "))
        return 130 if stopped_by == "Ctrl-C" else PREEMPTED_EXIT_CODE
    history = trainer.state.log_history
    shown = dict(history[-1])
    shown.update(next((h for h in reversed(history) if any(k.startswith("eval_") for k in h)), {}))
    print(f"done: {trainer.state.global_step} steps, precision {trainer.accelerator.policy.name}; "
          + ", ".join(f"{k}={v:.4g}" for k, v in shown.items()
                      if isinstance(v, float) and not k.endswith(("_runtime", "_per_second"))))
    print(f"output: {out} (metrics.jsonl{', ' + ckpts[-1].name if ckpts else ''})")
    return 0
