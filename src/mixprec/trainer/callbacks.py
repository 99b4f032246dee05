"""Trainer state, control and callbacks, with Hugging Face's event names and arguments."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "TrainerState",
    "TrainerControl",
    "TrainerCallback",
    "CallbackHandler",
    "DefaultFlowCallback",
    "EarlyStoppingCallback",
    "ExportableState",
    "PrinterCallback",
    "ProgressCallback",
    "JsonlLoggerCallback",
    "TensorBoardCallback",
]

log = logging.getLogger("mixprec.trainer")

EVENTS = ("on_init_end", "on_train_begin", "on_epoch_begin", "on_step_begin", "on_pre_optimizer_step",
          "on_optimizer_step", "on_substep_end", "on_step_end", "on_evaluate", "on_predict", "on_save", "on_log",
          "on_prediction_step", "on_epoch_end", "on_train_end", "on_push_begin")

# mixprec's own bookkeeping in TrainerState: saved beside trainer_state.json (in
# mixprec_trainer_state.json), so that Hugging Face's TrainerState.load_from_json reads the file.
MIXPREC_STATE_FIELDS = ("skipped_steps", "loss_scale", "precision", "total_loss", "loss_since_log", "steps_since_log")


@dataclass
class TrainerState:
    """Where training stands; saved as ``trainer_state.json`` in every checkpoint.

    Hugging Face's fields (``global_step``, ``epoch``, ``max_steps``, ``log_history``,
    ``best_metric``, ``best_model_checkpoint``, ``stateful_callbacks``, ...) plus mixprec's
    ``skipped_steps`` (optimizer steps skipped for inf/NaN gradients) and ``loss_scale`` (the
    current fp16 loss scale). ``trainer_state.json`` holds Hugging Face's fields only (its
    ``TrainerState.load_from_json`` reads it); :meth:`mixprec_json_string` holds the rest.
    """

    epoch: float = 0.0
    global_step: int = 0
    max_steps: int = 0
    logging_steps: float = 500
    eval_steps: float = 500
    save_steps: float = 500
    train_batch_size: int | None = None
    num_train_epochs: int = 0
    num_input_tokens_seen: int = 0
    total_flos: float = 0
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None
    stateful_callbacks: dict[str, Any] = field(default_factory=dict)
    skipped_steps: int = 0
    loss_scale: float | None = None
    precision: str = "fp32"
    # The loss bookkeeping between logs, so that a resumed run logs what the uninterrupted one would.
    total_loss: float = 0.0
    loss_since_log: float = 0.0
    steps_since_log: int = 0

    def compute_steps(self, args: Any, max_steps: int) -> None:
        """``logging_steps``, ``eval_steps``, ``save_steps`` from ``args``, fractions below 1 of ``max_steps``."""
        for kind in ("logging", "eval", "save"):
            n = getattr(args, f"{kind}_steps")
            if n is not None:
                setattr(self, f"{kind}_steps", math.ceil(max_steps * n) if n < 1 else n)

    def to_json_string(self) -> str:
        """Hugging Face's fields as JSON (what ``trainer_state.json`` holds)."""
        data = {k: v for k, v in dataclasses.asdict(self).items() if k not in MIXPREC_STATE_FIELDS}
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    def mixprec_json_string(self) -> str:
        """mixprec's own fields as JSON (``mixprec_trainer_state.json`` beside ``trainer_state.json``)."""
        return json.dumps({k: getattr(self, k) for k in MIXPREC_STATE_FIELDS}, indent=2, sort_keys=True) + "\n"

    def save_to_json(self, path: str | Path) -> None:
        """Write :meth:`to_json_string` to ``path``."""
        Path(path).write_text(self.to_json_string())

    @classmethod
    def load_from_json(cls, path: str | Path) -> TrainerState:
        """Read ``trainer_state.json`` (and ``mixprec_trainer_state.json`` beside it, where present)."""
        path = Path(path)
        data = json.loads(path.read_text())
        extra = path.with_name("mixprec_trainer_state.json")
        if extra.is_file():
            data.update(json.loads(extra.read_text()))
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class ExportableState:
    """A callback (or the control) whose settings a checkpoint keeps (Hugging Face's protocol).

    :meth:`state` returns ``{"args": ..., "attributes": ...}``: the object is rebuilt as
    ``type(obj)(**args)`` with ``attributes`` set on it when a run resumes with
    ``restore_callback_states_from_checkpoint=True``. Any callback with such a ``state()``
    method qualifies (Hugging Face's own callbacks too).
    """

    def state(self) -> dict[str, Any]:
        raise NotImplementedError("an ExportableState must implement state()")

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Any:
        """The object :meth:`state` describes."""
        obj = cls(**state.get("args", {}))
        for k, v in state.get("attributes", {}).items():
            setattr(obj, k, v)
        return obj


def is_exportable(obj: Any) -> bool:
    """Whether ``obj`` has ``state()`` in Hugging Face's sense (mixprec's or transformers' ExportableState)."""
    return isinstance(obj, ExportableState) or any(c.__name__ == "ExportableState" for c in type(obj).__mro__)


def export_states(objects: list[Any]) -> dict[str, Any]:
    """``{class name: state()}`` of the exportable ``objects`` (a list where a class has several)."""
    out: dict[str, Any] = {}
    for obj in objects:
        if not is_exportable(obj):
            continue
        name, st = type(obj).__name__, obj.state()
        if name in out:
            out[name] = (out[name] if isinstance(out[name], list) else [out[name]]) + [st]
        else:
            out[name] = st
    return out


@dataclass
class TrainerControl(ExportableState):
    """What the callbacks ask the loop to do next.

    As in Hugging Face: ``should_training_stop`` is cleared when training begins,
    ``should_epoch_stop`` when an epoch begins, ``should_log``/``should_evaluate``/``should_save``
    when a step begins and when that log, evaluation or save has happened.
    """

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def _new_training(self) -> None:
        self.should_training_stop = False

    def _new_epoch(self) -> None:
        self.should_epoch_stop = False

    def _new_step(self) -> None:
        self.should_save = self.should_evaluate = self.should_log = False

    def state(self) -> dict[str, Any]:
        """The flags, for the checkpoint."""
        return {"args": dataclasses.asdict(self), "attributes": {}}


class TrainerCallback:
    """Base class: override only the events you need (every method here does nothing).

    Each event receives ``(args, state, control, **kwargs)`` with ``model``, ``processing_class``,
    ``optimizer``, ``lr_scheduler``, ``train_dataloader``, ``eval_dataloader`` in ``kwargs`` (and
    ``metrics`` for ``on_evaluate``/``on_predict``, ``logs`` for ``on_log``). Returning a
    ``TrainerControl`` (or setting fields on the one passed) steers the loop. Hugging Face's
    callbacks (``transformers.TrainerCallback`` subclasses) work too.

    Example:
        >>> class StopAt(TrainerCallback):
        ...     def on_step_end(self, args, state, control, **kwargs):
        ...         control.should_training_stop = state.global_step >= 10
    """


for _event in EVENTS:
    setattr(TrainerCallback, _event, lambda self, args, state, control, **kwargs: None)

# What each event clears before the callbacks see it (Hugging Face's CallbackHandler does the same).
_CLEARS = {"on_train_begin": ("should_training_stop",), "on_epoch_begin": ("should_epoch_stop",),
           "on_step_begin": ("should_log", "should_evaluate", "should_save"), "on_evaluate": ("should_evaluate",),
           "on_save": ("should_save",), "on_log": ("should_log",)}


class CallbackHandler:
    """Calls every callback for an event, in order, and returns the control.

    Each event is also a method (``handler.on_log(args, state, control, logs=...)``), as in
    Hugging Face; the objects the callbacks receive (``model``, ``optimizer``, ...) are this
    handler's attributes of those names, kept current by the Trainer.
    """

    def __init__(self, callbacks: list[TrainerCallback | type], model: Any = None, processing_class: Any = None,
                 optimizer: Any = None, lr_scheduler: Any = None) -> None:
        self.callbacks: list[TrainerCallback] = []
        for cb in callbacks:
            self.add_callback(cb)
        self.model, self.processing_class = model, processing_class
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.train_dataloader = self.eval_dataloader = None

    @property
    def callback_list(self) -> str:
        """The callbacks' class names, one a line."""
        return "\n".join(type(cb).__name__ for cb in self.callbacks)

    def add_callback(self, callback: TrainerCallback | type) -> None:
        """Add a callback (an instance, or a class to instantiate); warns if one of its class is there."""
        cb = callback() if isinstance(callback, type) else callback
        if not isinstance(cb, TrainerCallback) and not any(callable(getattr(cb, e, None)) for e in EVENTS):
            raise TypeError(f"{type(cb).__name__} is not a TrainerCallback; subclass mixprec.TrainerCallback")
        if type(cb) in [type(c) for c in self.callbacks]:
            log.warning(f"You are adding a {type(cb).__name__} to the callbacks of this Trainer, but there is already "
                        f"one. The current list of callbacks is:\n{self.callback_list}")
        self.callbacks.append(cb)

    def _find(self, callback: TrainerCallback | type) -> TrainerCallback | None:
        for cb in self.callbacks:
            if (isinstance(callback, type) and isinstance(cb, callback)) or cb is callback:
                return cb
        return None

    def pop_callback(self, callback: TrainerCallback | type) -> TrainerCallback | None:
        """Remove and return the first callback of that class (or that instance); None if absent."""
        cb = self._find(callback)
        if cb is not None:
            self.callbacks.remove(cb)
        return cb

    def remove_callback(self, callback: TrainerCallback | type) -> None:
        """Remove the first callback of that class (or that instance)."""
        self.pop_callback(callback)

    def call(self, event: str, args: Any, state: Any, control: TrainerControl, **kwargs: Any) -> TrainerControl:
        """Run ``event`` on every callback, after clearing the flags it clears; returns the control."""
        for flag in _CLEARS.get(event, ()):
            setattr(control, flag, False)
        objects = {k: getattr(self, k) for k in ("model", "processing_class", "optimizer", "lr_scheduler",
                                                 "train_dataloader", "eval_dataloader")}
        objects.update(kwargs)
        for cb in self.callbacks:
            method = getattr(cb, event, None)
            if method is None:  # a duck-typed callback from an older library without this event
                continue
            result = method(args, state, control, **objects)
            if result is not None:
                control = result
        return control

    call_event = call


def _handler_method(event: str) -> Any:
    def method(self: CallbackHandler, args: Any, state: Any, control: TrainerControl, **kwargs: Any) -> TrainerControl:
        return self.call(event, args, state, control, **kwargs)

    method.__name__ = event
    method.__doc__ = f"Run ``{event}`` on every callback."
    return method


for _event in EVENTS:
    setattr(CallbackHandler, _event, _handler_method(_event))


def hf_compatible(cls: type) -> type:
    """``cls``, or, where the program has imported transformers' callbacks, a subclass of ``cls``
    and of transformers' class of the same name (mixprec's methods first).

    Code written for Hugging Face tests or removes the default callbacks by transformers'
    classes (``trainer.remove_callback(transformers.PrinterCallback)``,
    ``isinstance(cb, transformers.DefaultFlowCallback)``); with this, it finds mixprec's. Nothing
    is imported: without transformers in ``sys.modules``, ``cls`` itself is returned.
    """
    module = sys.modules.get("transformers.trainer_callback")
    theirs = getattr(module, cls.__name__, None) if module is not None else None
    return _mixed(cls, theirs) if isinstance(theirs, type) and not issubclass(cls, theirs) else cls


@functools.cache
def _mixed(ours: type, theirs: type) -> type:
    return type(ours.__name__, (ours, theirs), {"__module__": ours.__module__, "__qualname__": ours.__qualname__,
                                                "__doc__": ours.__doc__})


class DefaultFlowCallback(TrainerCallback):
    """Decides when to log, evaluate and save, from ``args``' strategies (Hugging Face's rules).

    After each optimizer step: log every ``logging_steps`` (and at step 1 with
    ``logging_first_step``), evaluate every ``eval_steps`` once ``eval_delay`` has passed, save
    every ``save_steps``; at the last step stop, evaluate (step strategy, if that step was not an
    evaluation step) and save (step strategy). At an epoch's end, the ``"epoch"`` strategies.
    Removing it leaves the loop with no logging, evaluation or saving of its own.
    """

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if (step == 1 and args.logging_first_step) or (args.logging_strategy == "steps"
                                                      and step % state.logging_steps == 0):
            control.should_log = True
        steps_eval = args.eval_strategy == "steps" and args.eval_delay <= step
        if steps_eval and step % state.eval_steps == 0:
            control.should_evaluate = True
        if args.save_strategy == "steps" and state.save_steps > 0 and step % state.save_steps == 0:
            control.should_save = True
        if step >= state.max_steps:
            control.should_training_stop = True
            if steps_eval and step % state.eval_steps != 0:
                control.should_evaluate = True
            if args.save_strategy == "steps":
                control.should_save = True
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if args.logging_strategy == "epoch":
            control.should_log = True
        if args.eval_strategy == "epoch" and args.eval_delay <= state.epoch:
            control.should_evaluate = True
        if args.save_strategy == "epoch":
            control.should_save = True
        return control


class EarlyStoppingCallback(TrainerCallback, ExportableState):
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

    def state(self) -> dict[str, Any]:
        """Patience and threshold (rebuilt on resume) and the evaluations without improvement so far."""
        return {"args": {"early_stopping_patience": self.early_stopping_patience,
                         "early_stopping_threshold": self.early_stopping_threshold},
                "attributes": {"early_stopping_patience_counter": self.early_stopping_patience_counter}}


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


class PrinterCallback(TrainerCallback):
    """Print every log (the Trainer's progress display when ``disable_tqdm=True``)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_local_process_zero and logs:
            print({k: _fmt(v) if isinstance(v, float) else v for k, v in logs.items() if k != "total_flos"})


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
