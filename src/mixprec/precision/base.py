"""What a precision is (:class:`PrecisionPolicy`) and what it does (:class:`PrecisionPlugin`).

A plugin is asked at call time by everything that runs a training step (the prepared model's
forward, ``Accelerator.backward``, the prepared optimizer's ``step``, ``clip_grad_norm_``,
``save_state``), so switching a run to another precision is one assignment of the plugin. The
base class is the fp32 behaviour: every hook a no-op or the plain torch call, and a precision
overrides only what it changes (Lightning Fabric's ``plugins/precision`` is the shape).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PrecisionPolicy", "PrecisionPlugin"]


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """What a precision means for compute, storage and loss scaling.

    Build one with :func:`~mixprec.resolve_precision`; the fields are the row of the names table.

    Args:
        name: the canonical name (``"fp32"``, ``"fp16-mixed"``, ``"bf16-mixed"``, ``"bf16-true"``).
        compute_dtype: the dtype matrix products run in.
        param_dtype: the dtype the parameters are stored in.
        optimizer_state_dtype: the dtype of the optimizer's moment buffers.
        autocast_enabled: whether the forward runs under ``torch.autocast``.
        needs_loss_scaler: whether a dynamic loss scaler is required (fp16's narrow range).
        requested: the name as the user wrote it (``"auto"``, ``"fp16"``, ...).
        reason: why this policy was chosen (filled in for ``auto``).

    Example:
        >>> from mixprec import resolve_precision
        >>> with resolve_precision("bf16").autocast("cpu"):
        ...     y = torch.ones(2, 2) @ torch.ones(2, 2)
        >>> y.dtype
        torch.bfloat16
    """

    name: str
    compute_dtype: torch.dtype
    param_dtype: torch.dtype
    optimizer_state_dtype: torch.dtype
    autocast_enabled: bool
    needs_loss_scaler: bool
    requested: str = ""
    reason: str = ""

    def __post_init__(self) -> None:
        from mixprec.precision.names import check_concrete  # the names table knows which names exist

        check_concrete(self.name)

    @property
    def is_low_precision(self) -> bool:
        """Whether any compute runs in a 16-bit dtype."""
        return self.compute_dtype != torch.float32

    def autocast(self, device: str | torch.device = "cpu") -> contextlib.AbstractContextManager:
        """A context manager that runs its body in this policy's compute precision on ``device``.

        For policies without autocast (``fp32``, ``bf16-true``) this is a no-op context, so it
        never disables an autocast region the caller opened outside it.
        """
        if not self.autocast_enabled:
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(device).type, dtype=self.compute_dtype)


class PrecisionPlugin:
    """What one precision does to a model, its inputs, the backward and the optimizer step.

    One instance per Accelerator (it may hold state: a loss scaler, per-optimizer skip flags).
    The base class is plain fp32 training; subclasses override what their precision changes.

    Args:
        policy: the resolved policy.
        device: the device the run trains on.
        loss_scaler: a :class:`~mixprec.LossScaler` or a dict of its arguments (only precisions
            that scale the loss accept one).
        bf16_true: bf16-true's options (:class:`~mixprec.precision.BF16TrueConfig`); others ignore it.

    Example:
        >>> from mixprec.precision import make_plugin
        >>> plugin = make_plugin("fp32", "cpu")
        >>> model = plugin.convert_module(torch.nn.Linear(2, 1))
        >>> with plugin.forward_context():
        ...     loss = model(plugin.convert_input(torch.ones(1, 2))).sum()
        >>> plugin.backward(loss)
    """

    def __init__(self, policy: PrecisionPolicy, device: str | torch.device, *, loss_scaler: Any = None,
                 bf16_true: Any = None) -> None:
        if loss_scaler is not None:
            raise ValueError(
                f"a loss scaler does nothing for {policy.name}: fp32's and bf16's range need no scaling; "
                "drop loss_scaler, or use mixed_precision='fp16'"
            )
        self.policy = policy
        self.device = torch.device(device)

    @property
    def scaler(self) -> Any:
        """The loss scaler, or ``None`` where this precision has none."""
        return None

    # -- model and inputs ---------------------------------------------------------------
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Prepare ``module``'s parameters for this precision (in place); returns it."""
        return module

    @property
    def input_dtype(self) -> torch.dtype | None:
        """The dtype floating inputs are cast to before the forward (``None``: left as they are)."""
        return None

    def convert_input(self, data: Any) -> Any:
        """``data`` (a batch, nested containers included) as this precision's forward takes it."""
        return data

    def forward_context(self) -> contextlib.AbstractContextManager:
        """The context the forward runs in (autocast for the mixed precisions)."""
        return self.policy.autocast(self.device)

    def convert_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer this precision steps with (bf16-true swaps in a compensated twin)."""
        return optimizer

    def track_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Take part in ``optimizer``'s iterations (called once, when it is prepared)."""

    # -- the step -------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward(**kwargs)``, scaled where the precision needs it."""
        loss.backward(**kwargs)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring ``optimizer``'s gradients to their true values, once per iteration."""

    def clip_gradients(self, parameters: list[torch.Tensor], optimizers: Iterable[torch.optim.Optimizer],
                       max_norm: float | None = None, norm_type: float = 2.0,
                       clip_value: float | None = None) -> torch.Tensor | None:
        """Unscale the ``optimizers`` holding ``parameters`` (once), then clip by norm or by value.

        Returns the total norm before clipping (``None`` when clipping by value).
        """
        for opt in optimizers:
            self.unscale_gradients(opt)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(parameters, clip_value)
            return None
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
        """Step ``optimizer`` (or skip it, where the precision checks for inf/NaN)."""
        return optimizer.step(closure) if closure is not None else optimizer.step()

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        """Clear ``optimizer``'s gradients."""
        optimizer.zero_grad(set_to_none=set_to_none)

    def step_was_skipped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s last step was skipped for inf/NaN gradients."""
        return False

    def skipped_steps(self, optimizer: torch.optim.Optimizer) -> int:
        """How many of ``optimizer``'s steps were skipped for inf/NaN gradients."""
        return 0

    def skip_flag(self, optimizer: torch.optim.Optimizer) -> bool | torch.Tensor:
        """Whether ``optimizer``'s last step was skipped, without a sync: a ``bool`` where the host
        knows it, else a 0-dim device tensor, non-zero when skipped (read it later, e.g. once per log)."""
        return False

    def grads_scaled_by(self, optimizer: torch.optim.Optimizer) -> Any:
        """What ``optimizer``'s gradients are multiplied by right now (``None``: their true values)."""
        return None

    def finish_iteration(self) -> None:
        """Close an iteration left open (before a checkpoint: held gradients are not saved)."""

    def release(self) -> None:
        """Undo what this plugin attached to the run (when the run switches to another precision)."""

    @property
    def optimizer_state_dtype(self) -> torch.dtype | None:
        """The dtype the optimizers this precision prepares keep their moments in; ``None``: the
        parameters' own, as torch's optimizers do (what :meth:`Accelerator.precision_report` expects)."""
        return None

    def sharding_policy(self, reduce_dtype: torch.dtype | None = torch.float32) -> Any:
        """FSDP2's ``MixedPrecisionPolicy`` for this precision: parameters gathered in the compute
        dtype where it differs from the stored one (the sharded master weights stay as they are),
        gradients reduced in ``reduce_dtype`` wherever compute is 16-bit."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        p = self.policy
        cast = p.compute_dtype if p.compute_dtype != p.param_dtype else None
        return MixedPrecisionPolicy(param_dtype=cast, reduce_dtype=reduce_dtype if p.compute_dtype != torch.float32
                                    else None)

    def forget_optimizers(self) -> None:
        """Stop tracking every optimizer (``Accelerator.free_memory``: the next run prepares new ones)."""
        self.release()

    # -- reporting and checkpoints ----------------------------------------------------------
    def fallback_precision(self, native_bf16: bool) -> str | None:
        """The precision to switch to when this one's loss scale collapses (``None``: none)."""
        return None

    def log_values(self) -> dict[str, Any]:
        """Values for a training log line (the loss scale and skips, where there is a scaler)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """This precision's state to checkpoint (the loss scaler's)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.policy.name!r}, device={str(self.device)!r})"
