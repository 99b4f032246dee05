"""What ``Accelerator.prepare`` hands back: the model's forward in the run's *current* precision
(read at call time), an optimizer whose ``step()`` goes through the precision plugin, and a
scheduler that skips when the step did. This module alone names what it sets on a user's model.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from .precision import PrecisionPlugin

__all__ = ["AcceleratedOptimizer", "AcceleratedScheduler", "OptimizerHooks", "patch_forward", "unpatch_forward",
           "original_forward", "unwrap"]

_ORIGINAL = "_mixprec_original_forward"
_PRECISION = "_mixprec_precision"  # a function returning the owner's current plugin


def _precision_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    plugin: PrecisionPlugin = getattr(self, _PRECISION)()
    with plugin.forward_context():
        return getattr(self, _ORIGINAL)(*plugin.convert_input(args), **plugin.convert_input(kwargs))


def patch_forward(model: torch.nn.Module, current_precision: Callable[[], PrecisionPlugin]) -> None:
    """Run ``model.forward`` in the plugin ``current_precision()`` returns at each call.

    The model object stays the same (its attributes, ``isinstance`` checks and ``state_dict`` are
    untouched); only the instance's ``forward`` is replaced, as a method bound to the model (so a
    ``copy.deepcopy`` of it runs its own weights, in the same owner's precision), and
    :func:`unpatch_forward` undoes it. Patching twice keeps the first.
    """
    if hasattr(model, _ORIGINAL):
        return
    original = model.forward
    setattr(model, _PRECISION, current_precision)
    setattr(model, _ORIGINAL, original)

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return _precision_forward(self, *args, **kwargs)

    # inspect.signature(model.forward) then shows the model's own arguments (the Trainer reads it).
    forward.__wrapped__ = getattr(original, "__func__", original)
    forward.__doc__ = original.__doc__
    model.forward = types.MethodType(forward, model)


def unpatch_forward(model: torch.nn.Module) -> torch.nn.Module:
    """Give ``model`` its own forward back."""
    if hasattr(model, _ORIGINAL):
        del model.forward  # the instance attribute; the class's forward shows through again
        delattr(model, _ORIGINAL)
        delattr(model, _PRECISION)
    return model


def original_forward(model: torch.nn.Module) -> Callable[..., Any]:
    """``model``'s own forward, without the precision around it (its ``forward`` if unpatched)."""
    return getattr(model, _ORIGINAL, model.forward)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside ``DistributedDataParallel`` and ``torch.compile`` wrappers."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


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
    built on the original optimizer keep working.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, hooks: OptimizerHooks,
                 original: torch.optim.Optimizer | None = None) -> None:
        # Deliberately no super().__init__: this object is a view of ``optimizer``.
        self.optimizer = optimizer
        self.original_optimizer = original if original is not None else optimizer  # what the user passed
        self.hooks = hooks
        self._skipped: bool | None = None  # known on the host (a collapse), else asked of the plugin

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

    def mark_skipped(self) -> None:
        """Record that the last step was skipped (the owner knows it on the host: a collapse)."""
        self._skipped = True

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``step()`` was skipped for inf/NaN gradients. Syncs with a loss scaler."""
        if self._skipped is None:
            return self.hooks.precision().step_was_skipped(self.optimizer)
        return self._skipped

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


class AcceleratedScheduler:
    """The user's LR scheduler, stepped only when the optimizer step was applied."""

    def __init__(self, scheduler: Any, optimizers: list[AcceleratedOptimizer], sync_gradients: Callable[[], bool]) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.sync_gradients = sync_gradients

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Advance the schedule, unless this is a non-sync accumulation step or the step was skipped."""
        if not self.sync_gradients():
            return
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        # Attributes the wrapper does not define (last_epoch, base_lrs, ...) are the scheduler's.
        if name in ("scheduler", "optimizers", "sync_gradients"):
            raise AttributeError(name)
        return getattr(self.scheduler, name)
