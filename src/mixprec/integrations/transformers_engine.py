"""mixprec as the engine under transformers' own Trainer: :func:`patch_transformers`.

Libraries that subclass transformers' ``Trainer`` (trl's ``SFTTrainer``, ``DPOTrainer``,
``GRPOTrainer``...; sentence-transformers) cannot base their classes on mixprec's Trainer. They all
build their ``accelerate.Accelerator`` in one place, ``Trainer.create_accelerator_and_postprocess``,
through the name ``transformers.trainer.Accelerator``. The switch is that one name: after
:func:`patch_transformers`, it builds a :class:`mixprec.Accelerator` from the same arguments, and
everything else is the Accelerator keeping Accelerate's contract. One callback is added to
transformers' default callbacks (``transformers.trainer.DEFAULT_CALLBACKS``), because nothing else
can put what mixprec's Trainer shows into transformers' logs: the precision really in force in the
first training log (``precision_in_force``), the loss scale and the skipped steps, and a warning
when steps are skipped. Each Trainer built under the switch gets mixprec's checkpoints, resume and
preemption (:mod:`mixprec.integrations.engine_checkpoints`, which says what it hooks), and
``get_last_checkpoint`` in ``transformers.trainer`` (what ``resume_from_checkpoint=True`` calls)
takes the newest checkpoint that verifies. No method of transformers is rewritten.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from typing import Any

from mixprec.accelerator.accelerator import Accelerator
from mixprec.integrations.engine_checkpoints import EngineCheckpoints, newest_good_checkpoint
from mixprec.precision import resolve_precision

__all__ = ["EnginePatch", "patch_transformers", "unpatch_transformers"]

_log = logging.getLogger("mixprec.trainer")
_lock = threading.Lock()
#: The Accelerators the switch built, by ``id`` of their ``state`` (what a prepared optimizer holds):
#: the callback finds its Trainer's Accelerator there.
_BUILT: weakref.WeakValueDictionary[int, Accelerator] = weakref.WeakValueDictionary()


class _SwitchedName(type):
    """The metaclass of :class:`EngineAccelerator`: calling the class builds a mixprec Accelerator,
    and ``isinstance(x, EngineAccelerator)`` holds for every mixprec Accelerator."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Accelerator:
        patch = _active
        if patch is not None:
            if patch.precision is not None:
                kwargs["mixed_precision"] = patch.precision
            kwargs.update(patch.options)
        accelerator = Accelerator(*args, **kwargs)
        _BUILT[id(accelerator.state)] = accelerator
        # transformers builds it in Trainer.create_accelerator_and_postprocess(self): that Trainer
        # gets mixprec's checkpoints (a subclass's overrides included: the hooks wrap its methods).
        owner = sys._getframe(1).f_locals.get("self")
        hf_trainer = sys.modules.get("transformers.trainer")
        if patch is not None and hf_trainer is not None and isinstance(owner, hf_trainer.Trainer):
            EngineCheckpoints.attach(owner)
        return accelerator

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, Accelerator)


class EngineAccelerator(metaclass=_SwitchedName):
    """What ``transformers.trainer.Accelerator`` names while the switch is on: called with
    Accelerate's arguments (as ``create_accelerator_and_postprocess`` calls it), it returns a
    :class:`mixprec.Accelerator`, its precision the switch's if one was given."""


class EnginePatch:
    """The switch, as :func:`patch_transformers` returns it: :meth:`undo` (or leaving its ``with``
    block) gives transformers back Accelerate's Accelerator.

    Attributes:
        precision: the precision every Trainer trains in (a canonical mixprec name), or ``None``:
            what its TrainingArguments say (``fp16=True`` is real fp16-mixed, also on the CPU).
        options: mixprec's own Accelerator arguments given to every Accelerator built
            (``loss_scaler``, ``on_loss_scale_collapse``, ``precision_config``, ``diagnostics``...).
    """

    def __init__(self, precision: str | None, options: dict[str, Any]) -> None:
        self.precision = precision
        self.options = options

    @property
    def active(self) -> bool:
        """Whether this switch is the one in force."""
        return _active is self

    def undo(self) -> None:
        """Restore Accelerate's Accelerator in transformers' Trainer (idempotent)."""
        unpatch_transformers()

    def __enter__(self) -> EnginePatch:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.undo()

    def __repr__(self) -> str:
        return f"EnginePatch(precision={self.precision!r}, active={self.active})"


_active: EnginePatch | None = None
_saved: dict[str, Any] = {}


def _transformers_trainer() -> Any:
    try:
        import transformers.trainer as hf_trainer
    except ImportError as e:
        raise ImportError("mixprec.patch_transformers() switches transformers' Trainer to mixprec's Accelerator, "
                          "and transformers is not installed: pip install transformers (or use mixprec.Trainer, "
                          "which needs no transformers)") from e
    return hf_trainer


#: The Accelerator's arguments that are mixprec's own (Accelerate's Trainer passes the others).
ENGINE_OPTIONS = ("loss_scaler", "skip_nonfinite_steps", "on_loss_scale_collapse", "bf16_true_compensation",
                  "bf16_true_state_dtype", "precision_config", "diagnostics", "ddp_comm_hook")


def patch_transformers(precision: str | None = None, **options: Any) -> EnginePatch:
    """Make transformers' ``Trainer``, and every subclass of it (trl's, sentence-transformers'),
    train through :class:`mixprec.Accelerator`.

    Replaces the name transformers' Trainer builds its Accelerator from
    (``transformers.trainer.Accelerator``) and the one ``resume_from_checkpoint=True`` finds its
    checkpoint with (``transformers.trainer.get_last_checkpoint``: the newest that verifies), and
    adds one callback to its default callbacks (the precision in force in the first training log,
    the loss scale, skipped steps). Each Trainer built under it commits its checkpoints atomically,
    verifies what it resumes from and stops cleanly on SIGTERM (exit 75): see
    :mod:`mixprec.integrations.engine_checkpoints`. Calling it again keeps one switch and takes the
    new ``precision``.

    Args:
        precision: any name :func:`~mixprec.resolve_precision` takes (``"bf16-true"``, ``"fp8"``,
            ``"auto"``, ``"fp16"``...), used over what the TrainingArguments say. ``None``:
            ``fp16=True`` / ``bf16=True`` decide, meaning what they mean in mixprec (fp16 on the
            CPU is real fp16, where Accelerate silently trains in fp32).
        **options: mixprec's own :class:`~mixprec.Accelerator` arguments, for every Accelerator
            built: ``loss_scaler`` (a dict: ``hysteresis``, ``min_scale``, ``max_consecutive_skips``...),
            ``on_loss_scale_collapse="fallback"``, ``skip_nonfinite_steps``, ``precision_config``,
            ``bf16_true_compensation``, ``bf16_true_state_dtype``, ``diagnostics``, ``ddp_comm_hook``.

    Returns:
        the :class:`EnginePatch` in force: ``.undo()`` restores Accelerate, and it is a context manager.

    Raises:
        ImportError: transformers is not installed.
        ValueError: ``precision`` is not a precision name (the error lists the valid ones).
        TypeError: an option that is not one of mixprec's own Accelerator arguments (listing them).

    Example:
        >>> import mixprec
        >>> with mixprec.patch_transformers("bf16"):              # doctest: +SKIP
        ...     trl.SFTTrainer(model=model, args=args, train_dataset=data).train()
    """
    global _active
    if unknown := sorted(set(options) - set(ENGINE_OPTIONS)):
        raise TypeError(f"patch_transformers() got {', '.join(unknown)}: it takes mixprec's own Accelerator "
                        f"arguments, {', '.join(ENGINE_OPTIONS)}; what Accelerate's Accelerator takes comes from "
                        "the TrainingArguments")
    if precision is not None:
        precision = resolve_precision(precision).name if precision != "auto" else "auto"
    hf_trainer = _transformers_trainer()
    with _lock:
        if _active is None:
            _saved["Accelerator"] = hf_trainer.Accelerator
            _saved["get_last_checkpoint"] = hf_trainer.get_last_checkpoint
            hf_trainer.Accelerator = EngineAccelerator
            hf_trainer.get_last_checkpoint = newest_good_checkpoint
            if _callback_class() not in hf_trainer.DEFAULT_CALLBACKS:
                hf_trainer.DEFAULT_CALLBACKS.append(_callback_class())
        _active = EnginePatch(precision, options) if _active is None else _active
        _active.precision, _active.options = precision, options
        return _active


def unpatch_transformers() -> None:
    """Give transformers' Trainer Accelerate's Accelerator back (a no-op when the switch is off)."""
    global _active
    with _lock:
        if _active is None:
            return
        hf_trainer = _transformers_trainer()
        hf_trainer.Accelerator = _saved.pop("Accelerator")
        hf_trainer.get_last_checkpoint = _saved.pop("get_last_checkpoint")
        while _callback_class() in hf_trainer.DEFAULT_CALLBACKS:
            hf_trainer.DEFAULT_CALLBACKS.remove(_callback_class())
        _active = None


def is_patched() -> bool:
    """Whether transformers' Trainer builds mixprec's Accelerator now."""
    return _active is not None


def _accelerator_of(optimizer: Any) -> Accelerator | None:
    state = getattr(optimizer, "accelerator_state", None)
    return _BUILT.get(id(state)) if state is not None else None


def _callback_class() -> type:
    """:class:`PrecisionLogCallback`'s class, a ``transformers.TrainerCallback`` (made once, when
    transformers is imported)."""
    global _callback
    if _callback is None:
        from transformers import TrainerCallback

        _callback = type("PrecisionLogCallback", (_PrecisionLog, TrainerCallback), {"__module__": __name__})
    return _callback


_callback: type | None = None


#: The keys ``speed_metrics`` adds after a prefix (``eval_runtime``, ``test_samples_per_second``,
#: ``train_runtime``...): an evaluation's metrics, whatever their ``metric_key_prefix``, or the summary
#: of a finished ``train()``.
_SPEED_KEYS = ("_runtime", "_samples_per_second", "_steps_per_second")


def _is_training_log(logs: dict[str, Any]) -> bool:
    """Whether ``logs`` is a training log (what ``_maybe_log_save_evaluate`` logs every
    ``logging_steps``), whatever a subclass calls its loss: transformers' ``loss``, setfit's and
    sentence-transformers' ``embedding_loss``, any ``*_loss``; not an evaluation's metrics
    (``eval_``/``test_`` or any prefix with its speed metrics) nor the summary of ``train()``."""
    if "total_flos" in logs or any(k.startswith(("eval_", "test_")) or k.endswith(_SPEED_KEYS) for k in logs):
        return False
    return any(k == "loss" or k.endswith("_loss") for k in logs)


class _PrecisionLog:
    """Puts into the logs of a transformers Trainer switched to mixprec what mixprec's Trainer logs:
    ``precision_in_force`` in the first training log; ``loss_scale`` and ``skipped_steps`` where a
    loss scaler runs; and a warning when steps were skipped. Observes only."""

    def __init__(self) -> None:
        self._accelerator: Accelerator | None = None
        self._reported = False
        self._skipped = 0
        self._fallbacks = 0  # the Accelerator's precision switches seen so far

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self._accelerator = _accelerator_of(optimizer)
        self._reported = any("precision_in_force" in row for row in state.log_history)  # a resumed run's
        self._skipped = next((row["skipped_steps"] for row in reversed(state.log_history) if "skipped_steps" in row), 0)
        self._fallbacks = len(self._accelerator.precision_fallbacks) if self._accelerator is not None else 0

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        acc = self._accelerator
        if acc is None or logs is None or not _is_training_log(logs):
            return
        extra = acc.precision.log_values()  # the loss scale and skips, where a scaler runs (syncs)
        if not self._reported:
            self._reported = True
            report = acc.precision_report()  # observed in the steps so far, against the contract
            extra["precision_in_force"] = report.line()
            if not report.ok and acc.is_main_process:
                _log.warning("mixprec: %s", report.line())
        skipped = extra.get("skipped_steps", 0)
        if skipped > self._skipped and acc.is_main_process:
            _log.warning("mixprec: %d optimizer step(s) skipped since the last log for inf/NaN gradients; the loss "
                         "scale is now %s", skipped - self._skipped, extra.get("loss_scale"))
        self._skipped = skipped
        if len(acc.precision_fallbacks) > self._fallbacks:  # a loss-scale collapse made the run fall back
            self._fallbacks = len(acc.precision_fallbacks)
            extra["precision"] = acc.policy.name
        logs.update(extra)  # the reporters and printers after this callback see them
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)
