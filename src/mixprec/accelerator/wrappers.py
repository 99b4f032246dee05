"""What ``Accelerator.prepare`` hands back: the model's forward in the run's *current* precision
(read at call time), an optimizer whose ``step()`` goes through the precision plugin, and a
scheduler that skips when the step did. This module alone names what it sets on a user's model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from mixprec.models import ORIGINAL_FORWARD
from mixprec.precision import PrecisionPlugin

__all__ = ["AcceleratedOptimizer", "AcceleratedScheduler", "OptimizerHooks", "PreparedDDP", "patch_forward",
           "precision_forward", "repoint_forward", "unpatch_forward", "unwrap", "unwrap_keeping_compile"]

_ORIGINAL = ORIGINAL_FORWARD  # models.original_forward reads it
_PRECISION = "_mixprec_precision"  # a function returning the owner's current plugin


class _PrecisionForward:
    """A prepared model's ``forward``: the model's own, run in the plugin its owner's
    ``current_precision()`` returns at each call (its inputs and outputs converted by it).

    An object rather than a bound function so that it pickles as what it is: unpickled (with
    its owner), the copy's forward is this again, over the copy's own weights, in the same
    precision (a bound method pickles as ``getattr(copy, "forward")``, which on the half-built copy
    finds the class's plain forward: fp32, in silence). ``inspect.signature`` shows the model's own
    arguments (``__wrapped__`` is its original bound forward: the Trainer reads the signature).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        # Off (by the caller, for one call) when the caller keeps only the loss and converts that
        # itself: the Trainer's training step (see :func:`precision_forward`).
        self.converts_output = True

    @property
    def __wrapped__(self) -> Any:  # read when asked: an unpickled model's attributes come after this
        return getattr(self.model, _ORIGINAL, None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        plugin: PrecisionPlugin = getattr(model, _PRECISION)()
        if plugin.converts_input:
            args, kwargs = plugin.convert_input(args), plugin.convert_input(kwargs)
        with plugin.forward_context():
            out = getattr(model, _ORIGINAL)(*args, **kwargs)
        return plugin.convert_output(out) if self.converts_output else out

    def __reduce__(self) -> tuple:
        return _PrecisionForward, (self.model,)

    @property
    def __self__(self) -> torch.nn.Module:  # as a bound method's: the model it belongs to
        return self.model

    @property
    def __func__(self) -> Any:  # as a bound method's: the model's own forward function
        original = getattr(self.model, _ORIGINAL, None)
        return getattr(original, "__func__", original)


def patch_forward(model: torch.nn.Module, current_precision: Callable[[], PrecisionPlugin]) -> None:
    """Run ``model.forward`` in the plugin ``current_precision()`` returns at each call.

    The model object stays the same (its attributes, ``isinstance`` checks and ``state_dict`` are
    untouched); only the instance's ``forward`` is replaced, by a :class:`_PrecisionForward` over
    the model (so a ``copy.deepcopy`` or an unpickled copy of it runs its own weights, in the same
    owner's precision), and :func:`unpatch_forward` undoes it. Patching twice keeps the first.
    """
    if hasattr(model, _ORIGINAL):
        return
    original = model.forward
    setattr(model, _PRECISION, current_precision)
    setattr(model, _ORIGINAL, original)
    model.forward = _PrecisionForward(model)


def precision_forward(model: torch.nn.Module) -> _PrecisionForward | None:
    """The forward :func:`patch_forward` gave ``model`` (or the module inside its DDP / compile
    wrappers); ``None`` if it has none.

    A caller that keeps only the loss of a call may turn its ``converts_output`` off for that call
    and convert the loss alone (``plugin.convert_output(loss)``): in bf16 or fp16 the outputs it
    drops are then not cast to fp32 (a cast, and an autograd node, per output tensor).
    """
    forward = unwrap(model).__dict__.get("forward")
    return forward if isinstance(forward, _PrecisionForward) else None


def repoint_forward(model: torch.nn.Module, current_precision: Callable[[], PrecisionPlugin]) -> None:
    """Run ``model`` (or the module inside its DDP / compile wrappers) in ``current_precision()``
    from now on: a model another Accelerator prepared, prepared again."""
    target = unwrap(model)
    if hasattr(target, _ORIGINAL):
        setattr(target, _PRECISION, current_precision)
    else:
        patch_forward(target, current_precision)


def unpatch_forward(model: torch.nn.Module) -> torch.nn.Module:
    """Give ``model`` its own forward back."""
    if hasattr(model, _ORIGINAL):
        del model.forward  # the instance attribute; the class's forward shows through again
        delattr(model, _ORIGINAL)
        delattr(model, _PRECISION)
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside ``DistributedDataParallel`` and ``torch.compile`` wrappers."""
    while True:
        if isinstance(model, (DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


def unwrap_keeping_compile(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module without DDP (or ``DataParallel``) wrappers, still compiled if it was:
    the outermost ``torch.compile`` wrapper comes back, now around the unwrapped module."""
    compiled = model if isinstance(getattr(model, "_orig_mod", None), torch.nn.Module) else None
    inner = unwrap(model._orig_mod if compiled is not None else model)
    while isinstance(inner, torch.nn.DataParallel):
        inner = unwrap(inner.module)
    if compiled is None:
        return inner
    compiled._orig_mod = inner
    return compiled


@dataclass(frozen=True)
class OptimizerHooks:
    """How a prepared optimizer reaches its owner (the Accelerator sets them in ``prepare``).

    Args:
        step: ``step(wrapped, closure)``: the whole step (or a no-op on accumulation steps).
        zero_grad: ``zero_grad(wrapped, set_to_none)``.
        precision: returns the owner's current precision plugin.
    """

    step: Callable[[AcceleratedOptimizer, Any], Any]
    zero_grad: Callable[[AcceleratedOptimizer, bool], None]
    precision: Callable[[], PrecisionPlugin]


class AcceleratedOptimizer(torch.optim.Optimizer):
    """The user's optimizer, whose ``step()`` unscales, checks for inf/NaN, steps or skips, and
    updates the loss scale (all in the precision plugin), and which does nothing on accumulation
    steps that don't sync.

    ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's own, so schedulers
    built on the original optimizer keep working. It answers ``isinstance`` for the wrapped
    optimizer's class too (``isinstance(opt, torch.optim.AdamW)``), as well as for this one.

    Args:
        optimizer: the optimizer stepped (the precision plugin's conversion of ``original``).
        hooks: how ``step`` and ``zero_grad`` reach the owner.
        original: what the user passed (default: ``optimizer``).
        accelerator_state, gradient_state: the owner's (Accelerate's attributes of these names).
        device_placement: whether the owner placed the optimizer's state on its device.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, hooks: OptimizerHooks,
                 original: torch.optim.Optimizer | None = None, *, accelerator_state: Any = None,
                 gradient_state: Any = None, device_placement: bool = True) -> None:
        # Deliberately no super().__init__: this object is a view of ``optimizer``.
        self.optimizer = optimizer
        self.original_optimizer = original if original is not None else optimizer  # what the user passed
        self.hooks = hooks
        self.accelerator_state, self.gradient_state = accelerator_state, gradient_state
        self.device_placement = device_placement
        self._skipped: bool | None = None  # known on the host (a collapse), else asked of the plugin

    def __getattr__(self, name: str) -> Any:
        """Every attribute and method this wrapper does not define is the wrapped optimizer's
        (custom attributes), as in Accelerate."""
        if name.startswith("__") or name in ("optimizer", "original_optimizer", "hooks"):
            raise AttributeError(name)  # not set yet (unpickling, copying): no recursion
        return getattr(self.optimizer, name)

    def __dir__(self) -> list[str]:
        return _names(self, self.__dict__.get("optimizer"))

    def __reduce_ex__(self, protocol: Any) -> tuple:
        return _reduce(self)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        """The wrapped optimizer's class, so that ``isinstance(prepared, type(user_optimizer))``
        holds; ``type(prepared)`` is still this wrapper's."""
        return _class_of(self, "optimizer")

    def train(self) -> None:
        """Put the optimizer in training mode, where it has one (schedule-free optimizers)."""
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()

    def eval(self) -> None:
        """Put the optimizer in evaluation mode, where it has one (schedule-free optimizers)."""
        if callable(getattr(self.optimizer, "eval", None)):
            self.optimizer.eval()

    @property
    def scaler(self) -> Any:
        """The run's loss scaler (``None`` without one, or after a precision fallback)."""
        return self.hooks.precision().scaler

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients, except on accumulation steps that don't sync (they keep adding up)."""
        self.hooks.zero_grad(self, set_to_none)

    def step(self, closure: Any = None) -> Any:
        """Step (or skip on inf/NaN); the scale is updated once per iteration. A no-op on non-sync
        accumulation steps."""
        self._skipped = None
        return self.hooks.step(self, closure)

    def mark_skipped(self, skipped: bool = True) -> None:
        """Record on the host whether the last step was skipped (the owner knows it: a collapse, or
        a precision that checks nothing), so that reading it asks the plugin nothing."""
        self._skipped = skipped

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``step()`` was skipped for inf/NaN gradients. Syncs with a loss scaler."""
        if self._skipped is None:
            return self.hooks.precision().step_was_skipped(self.optimizer)
        return self._skipped

    @property
    def skip_flag(self) -> bool | torch.Tensor:
        """Whether the last ``step()`` was skipped, without a sync: a ``bool`` where the host knows it
        (a read already made, or no check in this precision), else a 0-dim device tensor, non-zero
        when skipped, to read later (the Trainer reads a log's worth at once)."""
        if self._skipped is None:
            return self.hooks.precision().skip_flag(self.optimizer)
        return self._skipped

    @property
    def _is_overflow(self) -> bool:  # Accelerate's name for the flag; its tests set it
        return self.step_was_skipped

    @_is_overflow.setter
    def _is_overflow(self, value: bool) -> None:
        self._skipped = bool(value)

    @property
    def skipped_steps(self) -> int:
        """How many of this optimizer's steps were skipped for inf/NaN gradients. Syncs."""
        return self.hooks.precision().skipped_steps(self.optimizer)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"


def _names(wrapper: Any, inner: Any) -> list[str]:
    """``dir()`` of a wrapper whose ``__class__`` is the wrapped object's: its own class's names
    and attributes, and the wrapped object's (reached through ``__getattr__``)."""
    return sorted(set(dir(type(wrapper))) | set(wrapper.__dict__) | (set(dir(inner)) if inner is not None else set()))


def _reduce(wrapper: Any) -> tuple:
    """How a wrapper pickles and copies: as its own type (pickle's default reads ``__class__``,
    which names the wrapped object's class), with its attributes."""
    return object.__new__, (type(wrapper),), dict(wrapper.__dict__)


def _class_of(wrapper: Any, attribute: str) -> type:
    """What a wrapper's ``__class__`` answers: the class of the object it wraps, once set (before
    that, while it is made, copied or unpickled, its own)."""
    inner = wrapper.__dict__.get(attribute)
    return type(wrapper) if inner is None else inner.__class__


class AcceleratedScheduler:
    """The user's LR scheduler, stepped only when the optimizer step was applied. It answers
    ``isinstance`` for the wrapped scheduler's class (``isinstance(s, ReduceLROnPlateau)``), and
    every name the wrapped scheduler has (``base_lrs``, ``last_epoch``, ``get_lr``) is its.

    Args:
        scheduler: the user's scheduler.
        optimizers: the prepared optimizers it follows.
        gradient_state: the owner's ``GradientState`` (``sync_gradients``, ``adjust_scheduler``).
        step_with_optimizer: ``False`` steps the schedule at every call, whatever the optimizers did.
        steps_per_call: schedule steps per applied optimizer step (Accelerate's: the number of
            processes, so a schedule written for one process's count of batches ends on time).
        split_batches: the owner's ``split_batches`` (Accelerate's attribute of this name).
    """

    def __init__(self, scheduler: Any, optimizers: list[AcceleratedOptimizer], gradient_state: Any, *,
                 step_with_optimizer: bool = True, steps_per_call: int = 1, split_batches: bool = False) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.gradient_state = gradient_state
        self.step_with_optimizer = step_with_optimizer
        self.steps_per_call = steps_per_call
        self.split_batches = split_batches

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Advance the schedule, unless this is a non-sync accumulation step or the step was skipped."""
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            if self.gradient_state.adjust_scheduler and hasattr(self.scheduler, "_step_count"):
                self.scheduler._step_count += 1  # as Accelerate counts it; the rate does not change
            return
        for opt in self.optimizers:
            if opt.step_was_skipped:
                return
        total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR refuses to step past its end
        for _ in range(self.steps_per_call):
            if total is not None and self.scheduler._step_count > total:
                break
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        # Attributes the wrapper does not define (last_epoch, base_lrs, ...) are the scheduler's.
        if name.startswith("__") or name in ("scheduler", "optimizers", "gradient_state", "step_with_optimizer",
                                             "steps_per_call", "split_batches"):
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __dir__(self) -> list[str]:
        return _names(self, self.__dict__.get("scheduler"))

    def __reduce_ex__(self, protocol: Any) -> tuple:
        return _reduce(self)

    def print_lr(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped scheduler's ``print_lr`` (Accelerate's wrapper has the name too)."""
        return self.scheduler.print_lr(*args, **kwargs)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        """The wrapped scheduler's class, so that ``isinstance(prepared, LambdaLR)`` holds as it
        does for the scheduler the user made; ``type(prepared)`` is still this wrapper's."""
        return _class_of(self, "scheduler")


class PreparedDDP(DistributedDataParallel):
    """torch's ``DistributedDataParallel``, through which every attribute the wrapper does not
    have reaches the wrapped model (``model.config``, custom methods and attributes), so a loop
    reads the prepared model as it read the model in one process. Plain DDP (and Accelerate's
    prepared model) raise ``AttributeError`` there; ``unwrap_model`` still gives the module."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # parameters, buffers and submodules of the wrapper
        except AttributeError:
            if name.startswith("__") or name == "module" or "module" not in self._modules:
                raise
            return getattr(self._modules["module"], name)
