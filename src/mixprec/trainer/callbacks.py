"""Trainer state, control and callbacks, with Hugging Face's event names and arguments."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "TrainerState",
    "TrainerControl",
    "TrainerCallback",
    "CallbackHandler",
    "EarlyStoppingCallback",
    "ProgressCallback",
    "JsonlLoggerCallback",
    "TensorBoardCallback",
]

EVENTS = ("on_init_end", "on_train_begin", "on_epoch_begin", "on_step_begin", "on_optimizer_step", "on_step_end",
          "on_evaluate", "on_predict", "on_save", "on_log", "on_epoch_end", "on_train_end")


@dataclass
class TrainerState:
    """Where training stands; saved as ``trainer_state.json`` in every checkpoint.

    Hugging Face's fields (``global_step``, ``epoch``, ``max_steps``, ``log_history``,
    ``best_metric``, ``best_model_checkpoint``, ...) plus mixprec's ``skipped_steps`` (optimizer
    steps skipped for inf/NaN gradients) and ``loss_scale`` (the current fp16 loss scale).
    """

    epoch: float = 0.0
    global_step: int = 0
    max_steps: int = 0
    num_train_epochs: int = 0
    logging_steps: int = 500
    eval_steps: int | None = None
    save_steps: int = 500
    train_batch_size: int = 0
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: float | None = None
    best_model_checkpoint: str | None = None
    is_world_process_zero: bool = True
    skipped_steps: int = 0
    loss_scale: float | None = None
    precision: str = "fp32"
    # The loss bookkeeping between logs, so that a resumed run logs what the uninterrupted one would.
    total_loss: float = 0.0
    loss_since_log: float = 0.0
    steps_since_log: int = 0

    def to_json_string(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    def save_to_json(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json_string())

    @classmethod
    def load_from_json(cls, path: str | Path) -> TrainerState:
        data = json.loads(Path(path).read_text())
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class TrainerControl:
    """What the callbacks ask the loop to do next; reset by the loop once done."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False


class TrainerCallback:
    """Base class: override only the events you need (every method here does nothing).

    Each event receives ``(args, state, control, **kwargs)`` with ``model``, ``optimizer``,
    ``lr_scheduler``, ``train_dataloader``, ``eval_dataloader`` in ``kwargs`` (and ``metrics`` for
    ``on_evaluate``/``on_predict``, ``logs`` for ``on_log``). Returning a ``TrainerControl`` (or
    setting fields on the one passed) steers the loop.

    Example:
        >>> class StopAt(TrainerCallback):
        ...     def on_step_end(self, args, state, control, **kwargs):
        ...         control.should_training_stop = state.global_step >= 10
    """


for _event in EVENTS:
    setattr(TrainerCallback, _event, lambda self, args, state, control, **kwargs: None)


class CallbackHandler:
    """Calls every callback for an event, in order, and returns the control."""

    def __init__(self, callbacks: list[TrainerCallback | type]) -> None:
        self.callbacks: list[TrainerCallback] = []
        for cb in callbacks:
            self.add_callback(cb)

    def add_callback(self, callback: TrainerCallback | type) -> None:
        cb = callback() if isinstance(callback, type) else callback
        if not isinstance(cb, TrainerCallback) and not all(hasattr(cb, e) for e in EVENTS):
            raise TypeError(f"{type(cb).__name__} is not a TrainerCallback; subclass mixprec.TrainerCallback")
        self.callbacks.append(cb)

    def pop_callback(self, callback: TrainerCallback | type) -> TrainerCallback | None:
        for cb in self.callbacks:
            if cb is callback or (isinstance(callback, type) and isinstance(cb, callback)):
                self.callbacks.remove(cb)
                return cb
        return None

    def call(self, event: str, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> TrainerControl:
        for cb in self.callbacks:
            result = getattr(cb, event)(args, state, control, **kwargs)
            if result is not None:
                control = result
        return control


class EarlyStoppingCallback(TrainerCallback):
    """Stop when ``metric_for_best_model`` has not improved for ``early_stopping_patience`` evaluations.

    Args:
        early_stopping_patience: evaluations without improvement before stopping.
        early_stopping_threshold: how much better than the best a metric must be to count.
    """

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float = 0.0) -> None:
        if early_stopping_patience < 1:
            raise ValueError(f"early_stopping_patience must be >= 1, got {early_stopping_patience}")
        self.early_stopping_patience = early_stopping_patience
        self.early_stopping_threshold = early_stopping_threshold
        self.early_stopping_patience_counter = 0

    def on_train_begin(self, args, state, control, **kwargs):
        if args.metric_for_best_model is None:
            raise ValueError("EarlyStoppingCallback needs TrainingArguments.metric_for_best_model (e.g. 'loss')")
        if args.eval_strategy == "no":
            raise ValueError("EarlyStoppingCallback needs evaluation: set eval_strategy to 'steps' or 'epoch'")

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        name = args.metric_for_best_model
        key = name if name.startswith("eval_") else f"eval_{name}"
        if not metrics or key not in metrics:
            return
        value = metrics[key]
        better = (lambda a, b: a > b) if args.greater_is_better else (lambda a, b: a < b)
        if state.best_metric is None or (
            better(value, state.best_metric) and abs(value - state.best_metric) > self.early_stopping_threshold
        ):
            self.early_stopping_patience_counter = 0
        else:
            self.early_stopping_patience_counter += 1
        if self.early_stopping_patience_counter >= self.early_stopping_patience:
            control.should_training_stop = True


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


class ProgressCallback(TrainerCallback):
    """A tqdm bar over optimizer steps, showing loss, learning rate, loss scale and skipped steps.

    Skipped steps are summarised once per log ("3 steps skipped for overflow since the last log,
    scale 2048"), never one line per step.
    """

    def __init__(self) -> None:
        self.bar = None
        self._skipped_at_last_log = 0

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="train", dynamic_ncols=True)
            self._skipped_at_last_log = state.skipped_steps

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is None or not logs:
            return
        shown = {k: logs[k] for k in ("loss", "learning_rate", "loss_scale", "skipped_steps") if k in logs}
        self.bar.set_postfix({k: _fmt(v) for k, v in shown.items()}, refresh=False)
        new = state.skipped_steps - self._skipped_at_last_log
        if new > 0:
            self.bar.write(f"{new} step{'s' if new > 1 else ''} skipped for overflow since the last log, "
                           f"scale {state.loss_scale:g}")
        self._skipped_at_last_log = state.skipped_steps
        if any(k.startswith("eval_") for k in logs):
            self.bar.write(" ".join(f"{k}={_fmt(v)}" for k, v in logs.items()))

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class JsonlLoggerCallback(TrainerCallback):
    """Append every log (training and evaluation) as one JSON line to ``output_dir/metrics.jsonl``."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        path = Path(args.output_dir) / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        row = {"step": state.global_step, "epoch": state.epoch, **logs}
        with open(path, "a") as fh:
            fh.write(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                 for k, v in row.items()}) + "\n")


class TensorBoardCallback(TrainerCallback):
    """Write every numeric log value to TensorBoard via ``torch.utils.tensorboard``."""

    def __init__(self) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # tensorboard is an optional dependency
            raise ImportError("report_to='tensorboard' needs the tensorboard package: pip install tensorboard, "
                              "or set report_to='jsonl'") from e
        self._writer_cls = SummaryWriter
        self.writer = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if self.writer is None:
            self.writer = self._writer_cls(log_dir=str(Path(args.output_dir) / "runs"))
        for k, v in logs.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                tag = k.replace("eval_", "eval/", 1) if k.startswith("eval_") else f"train/{k}"
                self.writer.add_scalar(tag, v, state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None
