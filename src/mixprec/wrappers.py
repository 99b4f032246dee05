"""What ``Accelerator.prepare`` hands back: the model's forward under the policy, an optimizer
whose ``step()`` does the loss scaler's work, and a scheduler that skips when the step did."""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

import torch

from .data import send_to_device
from .fallback import on_loss_scale_collapse
from .scaler import LossScaleCollapse

if TYPE_CHECKING:  # pragma: no cover
    from .accelerator import Accelerator

__all__ = ["AcceleratedOptimizer", "AcceleratedScheduler", "patch_forward", "unpatch_forward"]

_ORIGINAL = "_mixprec_original_forward"


def _autocast_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    policy, device, cast = self._mixprec_autocast
    if cast is not None:
        args = send_to_device(args, device, float_dtype=cast)
        kwargs = send_to_device(kwargs, device, float_dtype=cast)
    with policy.autocast(device):
        return getattr(self, _ORIGINAL)(*args, **kwargs)


def patch_forward(model: torch.nn.Module, accelerator: Accelerator) -> None:
    """Run ``model.forward`` under the accelerator's autocast (and, for bf16-true, cast float inputs).

    The model object stays the same (its attributes, ``isinstance`` checks and ``state_dict`` are
    untouched); only the instance's ``forward`` is replaced, as a method bound to the model (so a
    ``copy.deepcopy`` of it runs its own weights), and :func:`unpatch_forward` undoes it.
    """
    if hasattr(model, _ORIGINAL):
        return
    policy = accelerator.policy
    cast = policy.param_dtype if policy.param_dtype != torch.float32 else None
    original = model.forward
    model._mixprec_autocast = (policy, accelerator.device, cast)
    setattr(model, _ORIGINAL, original)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return _autocast_forward(self, *args, **kwargs)

    # inspect.signature(model.forward) then shows the model's own arguments (the Trainer reads it).
    forward.__wrapped__ = getattr(original, "__func__", original)
    forward.__doc__ = original.__doc__
    model.forward = types.MethodType(forward, model)


def unpatch_forward(model: torch.nn.Module) -> torch.nn.Module:
    """Give ``model`` its own forward back."""
    if hasattr(model, _ORIGINAL):
        del model.forward  # the instance attribute; the class's forward shows through again
        delattr(model, _ORIGINAL)
        del model._mixprec_autocast
    return model


class AcceleratedOptimizer(torch.optim.Optimizer):
    """The user's optimizer, whose ``step()`` unscales, checks for inf/NaN, steps or skips, and
    updates the loss scale, and which does nothing on accumulation steps that don't sync.

    ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's own, so schedulers
    built on the original optimizer keep working.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, accelerator: Accelerator) -> None:
        # Deliberately no super().__init__: this object is a view of ``optimizer``.
        self.optimizer = optimizer
        self.original_optimizer = optimizer  # what the user passed (differs for bf16-true's compensated one)
        self.accelerator = accelerator
        self._step_was_skipped = False

    @property
    def scaler(self) -> Any:
        """The accelerator's loss scaler (``None`` without one, or after a precision fallback)."""
        return self.accelerator.scaler

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
        if self.accelerator.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> Any:
        """Step (or skip on inf/NaN) and update the loss scale; a no-op on non-sync accumulation steps."""
        acc = self.accelerator
        if not acc.sync_gradients:
            return None
        acc._before_optimizer_step(self)
        scaler = self.scaler
        if scaler is None:
            out = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
            self._step_was_skipped = False
        else:
            if closure is not None:
                raise ValueError("closures are not supported with a loss scaler (torch.amp.GradScaler has the same limit)")
            out = scaler.step(self.optimizer)
            try:
                scaler.update()
                self._step_was_skipped = None  # read lazily: knowing it costs a host-device sync
            except LossScaleCollapse as e:
                self._step_was_skipped = True
                on_loss_scale_collapse(acc, e)  # raises, or falls back to another precision
        if self.original_optimizer is not self.optimizer:
            # A scheduler built on the user's optimizer checks that *it* stepped (torch's flag).
            self.original_optimizer._opt_called = True
        acc._after_optimizer_step(self)
        return out

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``step()`` was skipped for inf/NaN gradients. Syncs with fp16."""
        if self._step_was_skipped is None:
            self._step_was_skipped = not self.scaler.last_step_applied
        return self._step_was_skipped

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"


class AcceleratedScheduler:
    """The user's LR scheduler, stepped only when the optimizer step was applied."""

    def __init__(self, scheduler: Any, optimizers: list[AcceleratedOptimizer], accelerator: Accelerator) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.accelerator = accelerator

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Advance the schedule, unless this is a non-sync accumulation step or the step was skipped."""
        if not self.accelerator.sync_gradients:
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
        if name in ("scheduler", "optimizers", "accelerator"):
            raise AttributeError(name)
        return getattr(self.scheduler, name)
