"""What a precision does (:class:`PrecisionPlugin`; what it *is*, :class:`PrecisionPolicy`, is in
:mod:`mixprec.precision.names`).

A plugin is asked at call time by everything that runs a training step (the prepared model's
forward, ``Accelerator.backward``, the prepared optimizer's ``step``, ``clip_grad_norm_``,
``save_state``), so switching a run to another precision is one assignment of the plugin. The
base class is the fp32 behaviour: every hook a no-op or the plain torch call, and a precision
overrides only what it changes (Lightning Fabric's ``plugins/precision`` is the shape). Where the
loss is scaled, or steps with inf/NaN gradients are skipped, the plugin holds a
:class:`~mixprec.precision.scaled_steps.ScaledSteps` and hands it the step: the same component
for fp16's loss scaler and for any precision's inf/NaN guard (a scaler pinned to 1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch.amp import GradScaler

from mixprec.precision import optimizer_calls
from mixprec.precision.config import PrecisionConfig
from mixprec.precision.names import PrecisionPolicy
from mixprec.precision.scaled_steps import ScaledSteps
from mixprec.precision.scaler import LossScaler

__all__ = ["PrecisionPlugin"]


class PrecisionPlugin:
    """What one precision does to a model, its inputs, the backward and the optimizer step.

    One instance per Accelerator (it may hold state: a loss scaler, per-optimizer skip flags).
    The base class is plain fp32 training; subclasses override what their precision changes.

    Args:
        policy: the resolved policy.
        device: the device the run trains on.
        config: what the precision does beyond its name (the loss scaler's options, the inf/NaN
            guard, bf16-true's compensation); each plugin reads what concerns it.

    Example:
        >>> from mixprec.precision import make_plugin
        >>> plugin = make_plugin("fp32", "cpu")
        >>> model = plugin.convert_module(torch.nn.Linear(2, 1))
        >>> with plugin.forward_context():
        ...     loss = model(plugin.convert_input(torch.ones(1, 2))).sum()
        >>> plugin.backward(loss)
    """

    #: Whether this precision takes a loss scaler it does not need (bf16-mixed may opt in).
    accepts_loss_scaler = False
    #: The :class:`~mixprec.precision.PrecisionConfig` field whose choices are variants of this
    #: precision worth comparing side by side (``mixprec bench`` gives each its row): bf16-true's
    #: optimizer compensation. ``None``: one variant.
    variant_field: str | None = None
    #: Whether :meth:`convert_input` changes the batch (a prepared model's forward skips it if not).
    converts_input = False
    #: Whether ``prepare`` shards the models with FSDP2 (the Accelerator sets it): fp8 then
    #: all-gathers its float8 weights where the recipe allows.
    sharded = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "convert_input" in cls.__dict__ and "converts_input" not in cls.__dict__:
            cls.converts_input = True  # a plugin that converts its inputs says so itself

    def __init__(self, policy: PrecisionPolicy, device: str | torch.device, config: PrecisionConfig | None = None) -> None:
        self.policy = policy
        self.device = torch.device(device)
        self.config = config if config is not None else PrecisionConfig()
        self._scaler = self._make_scaler(self.config)
        #: The step when the loss is scaled or inf/NaN steps are skipped (``None``: plain torch calls).
        self.steps = ScaledSteps(self._scaler) if self._scaler is not None and self._scaler.is_enabled() else None

    def use_scaler(self, scaler: LossScaler | GradScaler | None) -> None:
        """Step with ``scaler`` from now on (Accelerate's ``accelerator.scaler = ...``), for the
        optimizers tracked so far too. A ``torch.amp.GradScaler`` is taken as the
        :class:`LossScaler` with its settings and state, on this precision's device; ``None``
        scales nothing and checks no step for inf/NaN (``precision_report()`` then says fp16 lacks one).

        Raises:
            TypeError: neither a GradScaler nor ``None``.
            ValueError: a scaler for a precision that takes none (fp32, bf16-true).
        """
        if scaler is not None and not isinstance(scaler, LossScaler):
            if not isinstance(scaler, GradScaler):
                raise TypeError(f"the loss scaler must be a mixprec.LossScaler or a torch.amp.GradScaler (or None), "
                                f"got {type(scaler).__name__}")
            taken = LossScaler(self.device.type, enabled=scaler.is_enabled())
            taken.load_state_dict(scaler.state_dict())  # its scale, growth and backoff factors, interval, tracker
            scaler = taken
        if scaler is not None and not (self.policy.needs_loss_scaler or self.accepts_loss_scaler
                                       or self.config.guards_nonfinite):
            raise self._no_scaler_here()
        tracked = self.steps.optimizers if self.steps is not None else []
        if self.steps is not None:
            self.steps.release()
        self._scaler = scaler
        self.steps = ScaledSteps(scaler) if scaler is not None and scaler.is_enabled() else None
        for optimizer in tracked if self.steps is not None else []:
            self.steps.track_optimizer(optimizer)

    def _make_scaler(self, config: PrecisionConfig) -> LossScaler | None:
        given = config.loss_scaler
        if config.guards_nonfinite and not self.policy.needs_loss_scaler:
            if isinstance(given, LossScaler):
                return given
            # The loss scaler's inf/NaN check and skip, at a scale pinned to 1: nothing is scaled.
            return LossScaler(self.device.type, **{**(given or {}), **NONFINITE_GUARD})
        if self.policy.needs_loss_scaler or (given is not None and self.accepts_loss_scaler):
            return given if isinstance(given, LossScaler) else LossScaler(self.device.type, **(given or {}))
        if given is not None:
            raise self._no_scaler_here()
        return None

    def _no_scaler_here(self) -> ValueError:
        """The error for a loss scaler given to a precision that takes none."""
        return ValueError(f"a loss scaler does nothing for {self.policy.name}: fp32's and bf16's range need no "
                          "scaling; drop loss_scaler, or use mixed_precision='fp16'")

    @property
    def scaler(self) -> LossScaler | None:
        """The loss scaler, or ``None`` where this precision has none."""
        return self._scaler

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

    def convert_output(self, data: Any) -> Any:
        """What the prepared model returns, from what its forward computed (unchanged here)."""
        return data

    def forward_context(self) -> contextlib.AbstractContextManager:
        """The context the forward runs in (autocast for the mixed precisions)."""
        return self.policy.autocast(self.device)

    def convert_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer this precision steps with (bf16-true swaps in a compensated twin)."""
        return optimizer

    def track_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Take part in ``optimizer``'s iterations (called once, when it is prepared)."""
        if self.steps is not None:
            self.steps.track_optimizer(optimizer)

    # -- the step -------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward(**kwargs)``, scaled where the precision needs it."""
        if self.steps is not None:
            return self.steps.backward(loss, **kwargs)
        loss.backward(**kwargs)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The tensor to call ``backward`` on in place of ``loss`` (for a trainer that runs the
        backward itself, as Lightning calls its module's own): ``loss`` scaled where the precision
        needs it, else ``loss`` itself. Call it once per backward."""
        return self.steps.scale_loss(loss) if self.steps is not None else loss

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring ``optimizer``'s gradients to their true values, once per iteration."""
        if self.steps is not None:
            self.steps.unscale_gradients(optimizer)

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

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any = None, **kwargs: Any) -> Any:
        """Step ``optimizer`` (or skip it, where the precision checks for inf/NaN); ``kwargs`` go
        to its ``step`` (as ``torch.amp.GradScaler.step`` passes them)."""
        if self.steps is not None:
            return self.steps.optimizer_step(optimizer, closure, **kwargs)
        if kwargs:
            return optimizer.step(closure=closure, **kwargs)
        return optimizer_calls.step(optimizer, closure)  # torch's step, less what nothing observes

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        """Clear ``optimizer``'s gradients."""
        if self.steps is not None:
            return self.steps.zero_grad(optimizer, set_to_none)
        optimizer_calls.zero_grad(optimizer, set_to_none)

    def step_was_skipped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s last step was skipped for inf/NaN gradients (may sync)."""
        return self.steps is not None and self.steps.step_was_skipped(optimizer)

    def skipped_steps(self, optimizer: torch.optim.Optimizer) -> int:
        """How many of ``optimizer``'s steps were skipped for inf/NaN gradients (syncs)."""
        return self.steps.skipped_steps(optimizer) if self.steps is not None else 0

    def skip_flag(self, optimizer: torch.optim.Optimizer) -> bool | torch.Tensor:
        """Whether ``optimizer``'s last step was skipped, without a sync: a ``bool`` where the host
        knows it, else a 0-dim device tensor, non-zero when skipped (read it later, e.g. once per log)."""
        return self.steps.skip_flag(optimizer) if self.steps is not None else False

    def grads_scaled_by(self, optimizer: torch.optim.Optimizer) -> Any:
        """What ``optimizer``'s gradients are multiplied by right now (``None``: their true values)."""
        return self.steps.grads_scaled_by(optimizer) if self.steps is not None else None

    def finish_iteration(self) -> None:
        """Close an iteration left open (before a checkpoint: held gradients are not saved)."""
        if self.steps is not None:
            self.steps.finish_iteration()

    def release(self) -> None:
        """Undo what this plugin attached to the run (when the run switches to another precision)."""
        if self.steps is not None:
            self.steps.release()

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
        if self.steps is not None:
            self.steps.forget_optimizers()

    # -- reporting and checkpoints ----------------------------------------------------------
    def fallback_precision(self, native_bf16: bool) -> str | None:
        """The precision to switch to when this one's loss scale collapses (``None``: none)."""
        return None

    def report(self) -> dict[str, Any]:
        """What this precision observed of itself, for ``precision_report`` (none here)."""
        return {}

    def violations(self) -> list[str]:
        """Where what this precision observed of itself differs from what it promises (none here)."""
        return []

    def log_values(self) -> dict[str, Any]:
        """Values for a training log line (the loss scale and skips, where there is a scaler; syncs)."""
        if self._scaler is None:
            return {}
        return {"loss_scale": self._scaler.get_scale(), "skipped_steps": self._scaler.skipped_steps}

    def state_dict(self) -> dict[str, Any]:
        """This precision's state to checkpoint (the loss scaler's)."""
        return self._scaler.state_dict() if self._scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if self._scaler is not None and state:
            self._scaler.load_state_dict(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.policy.name!r}, device={str(self.device)!r})"


#: A loss scaler that only guards: its scale is pinned to 1, so it checks for inf/NaN and skips.
NONFINITE_GUARD = {"init_scale": 1.0, "min_scale": 1.0, "max_scale": 1.0}
