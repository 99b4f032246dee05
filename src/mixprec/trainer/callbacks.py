"""Trainer callbacks: the base class, the handler that calls them, the flow and early stopping,
with Hugging Face's event names, arguments and control-flag rules."""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from typing import Any

from mixprec.trainer.logs import trainer_logger
from mixprec.trainer.trainer_state import ExportableState, TrainerControl, TrainerState

__all__ = [
    "TrainerState",  # re-exported from trainer_state
    "TrainerControl",
    "ExportableState",
    "TrainerCallback",
    "CallbackHandler",
    "DefaultFlowCallback",
    "EarlyStoppingCallback",
    "hf_compatible",
]

log = logging.getLogger("mixprec.trainer")

EVENTS = ("on_init_end", "on_train_begin", "on_epoch_begin", "on_step_begin", "on_pre_optimizer_step",
          "on_optimizer_step", "on_substep_end", "on_step_end", "on_evaluate", "on_predict", "on_save", "on_log",
          "on_prediction_step", "on_epoch_end", "on_train_end", "on_push_begin")


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


def _no_op(self: Any, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
    return None


def _no_op_with_metrics(self: Any, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
    return None  # (transformers' on_predict takes metrics by position: a subclass's super() call may pass it so)


for _event in EVENTS:
    setattr(TrainerCallback, _event, _no_op_with_metrics if _event == "on_predict" else _no_op)


def _does_nothing(cb: Any, event: str) -> bool:
    """Whether ``cb``'s ``event`` is the base class's no-op (mixprec's or transformers' TrainerCallback),
    or missing: then the handler need not call it."""
    kind = type(cb)
    if event in getattr(cb, "__dict__", {}) or hasattr(kind, "__getattr__") \
            or kind.__getattribute__ is not object.__getattribute__:
        return False  # set on the instance, or resolved at call time: call it
    for klass in kind.__mro__:
        if event in vars(klass):
            f = vars(klass)[event]
            return f in (_no_op, _no_op_with_metrics) or (getattr(f, "__qualname__", "") == f"TrainerCallback.{event}"
                                   and getattr(f, "__module__", "").startswith("transformers."))
    return True

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
        # Which callbacks do something on each event, worked out once for the callbacks there are
        # (the list may be changed directly: it is keyed by the callbacks it was worked out for).
        self._listening: dict[str, list[Any]] = {}
        self._listening_for: tuple[int, ...] = ()

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
            trainer_logger("trainer_callback").warning(f"You are adding a {type(cb).__name__} to the callbacks of this Trainer, but there is already "
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

    def listeners(self, event: str) -> list[Any]:
        """The callbacks whose ``event`` does something (not the base class's no-op), in order.
        Worked out once for the callbacks there are, again when they change (and at each
        ``on_train_begin``, for methods set on an instance since)."""
        key = tuple(map(id, self.callbacks))
        if key != self._listening_for or event == "on_train_begin":
            self._listening, self._listening_for = {}, key
        found = self._listening.get(event)
        if found is None:
            found = self._listening[event] = [cb for cb in self.callbacks if not _does_nothing(cb, event)]
        return found

    def call(self, event: str, args: Any, state: Any, control: TrainerControl, **kwargs: Any) -> TrainerControl:
        """Run ``event`` on every callback that does something on it, after clearing the flags it
        clears; returns the control."""
        return self.call_listeners(event, self.listeners(event), args, state, control, **kwargs)

    def call_listeners(self, event: str, listening: list[Any], args: Any, state: Any, control: TrainerControl,
                       **kwargs: Any) -> TrainerControl:
        """:meth:`call` for ``listening``, the event's :meth:`listeners` as the caller just read them."""
        clear_flags(event, control)
        if not listening:
            return control
        objects = {k: getattr(self, k) for k in ("model", "processing_class", "optimizer", "lr_scheduler",
                                                 "train_dataloader", "eval_dataloader")}
        objects.update(kwargs)
        for cb in listening:
            method = getattr(cb, event, None)
            if method is None:  # a duck-typed callback from an older library without this event
                continue
            result = method(args, state, control, **objects)
            if result is not None:
                control = result
        return control

    call_event = call


def clear_flags(event: str, control: TrainerControl) -> TrainerControl:
    """Clear the flags of ``control`` that ``event`` clears before its callbacks run (transformers'
    rule: ``should_log``, ``should_evaluate`` and ``should_save`` at each step's start, ...)."""
    for flag in _CLEARS.get(event, ()):
        setattr(control, flag, False)
    return control


def restore_states(callbacks: list[Any], control: TrainerControl, saved: dict[str, Any]) -> TrainerControl:
    """Rebuild, in place in ``callbacks``, each callback whose class name ``saved`` (a checkpoint's
    ``stateful_callbacks``) holds, as ``type(cb)(**args)`` with its ``attributes`` set (several of
    one class: in order); returns the control, rebuilt likewise. Warns naming the saved ones
    that are not among ``callbacks``."""
    not_found = []
    for name, data in saved.items():
        same = [cb for cb in [*callbacks, control] if type(cb).__name__ == name]
        if not same:
            not_found.append(name)
        for cb, state in zip(same, data if isinstance(data, list) else [data]):
            new = type(cb)(**state.get("args", {}))
            for k, v in state.get("attributes", {}).items():
                setattr(new, k, v)
            if cb is control:
                control = new
            else:
                callbacks[next(i for i, c in enumerate(callbacks) if c is cb)] = new
    if not_found:
        trainer_logger().warning(f"Checkpoint included callbacks not included in current configuration. Ignoring. "
                                 f"({', '.join(not_found)})")
    return control


#: The events whose handler method takes one more argument by position, as transformers' do
#: (``callback_handler.on_evaluate(args, state, control, metrics)``).
_POSITIONAL = {"on_evaluate": "metrics", "on_predict": "metrics", "on_log": "logs"}


def _handler_method(event: str) -> Any:
    extra = _POSITIONAL.get(event)
    if extra is not None:
        def method(self: CallbackHandler, args: Any, state: Any, control: TrainerControl, *value: Any,
                   **kwargs: Any) -> TrainerControl:
            if len(value) > 1:
                raise TypeError(f"{event}() takes args, state, control and {extra}; got {3 + len(value)} positional "
                                "arguments")
            return self.call(event, args, state, control, **dict(zip([extra], value)), **kwargs)

        method.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
            *(inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ("self", "args", "state", "control")),
            inspect.Parameter(extra, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
            inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
    else:
        def method(self: CallbackHandler, args: Any, state: Any, control: TrainerControl,
                   **kwargs: Any) -> TrainerControl:
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
        self.check_metric_value(args, state, control, metrics[key])
        if self.early_stopping_patience_counter >= self.early_stopping_patience:
            control.should_training_stop = True

    def check_metric_value(self, args, state, control, metric_value: float) -> None:
        """Count an evaluation without improvement on the best metric so far (by more than the
        threshold), or reset the count: transformers' method, which subclasses override."""
        better = (lambda a, b: a > b) if args.greater_is_better else (lambda a, b: a < b)
        if state.best_metric is None or (
            better(metric_value, state.best_metric)
            and abs(metric_value - state.best_metric) > self.early_stopping_threshold
        ):
            self.early_stopping_patience_counter = 0
        else:
            self.early_stopping_patience_counter += 1

    def state(self) -> dict[str, Any]:
        """Patience and threshold (rebuilt on resume) and the evaluations without improvement so far."""
        return {"args": {"early_stopping_patience": self.early_stopping_patience,
                         "early_stopping_threshold": self.early_stopping_threshold},
                "attributes": {"early_stopping_patience_counter": self.early_stopping_patience_counter}}
