"""bf16-true: parameters, gradients and activations in bf16, normalisation layers kept fp32
(:func:`mixprec.bf16_true.fp32_modules_rule`), float inputs cast to bf16, and the user's fresh
``torch.optim.AdamW`` / ``SGD`` swapped for its compensated twin (:mod:`mixprec.optim`) so that
updates smaller than bf16's resolution of the weights are not lost. No autocast, no loss scaler.

:class:`GuardedBF16TruePrecision` adds the inf/NaN guard (``skip_nonfinite_steps``): the loss
scaler's check and skip at a scale pinned to 1, so nothing is scaled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..bf16_true import cast_for_bf16_true
from ..data import send_to_device
from ..optim import COMPENSATIONS, STATE_DTYPE_NAMES, compensated_for_bf16
from .base import PrecisionPlugin, PrecisionPolicy
from .mixed import MixedPrecision

__all__ = ["BF16TrueConfig", "BF16TruePrecision", "GuardedBF16TruePrecision"]


@dataclass(frozen=True, kw_only=True)
class BF16TrueConfig:
    """bf16-true's optimizer options, validated once for the Accelerator, the Trainer and the bench.

    Args:
        compensation: ``"kahan"`` (default: a bf16 buffer keeps what rounding dropped),
            ``"stochastic"`` (unbiased random rounding) or ``"none"`` (the user's optimizer as
            it is: small updates are then lost).
        state_dtype: the compensated optimizer's moments: ``torch.float32`` (default) or
            ``torch.bfloat16`` (half the optimizer memory); ``"fp32"``/``"bf16"`` are accepted.

    Example:
        >>> BF16TrueConfig(state_dtype="bf16").state_dtype
        torch.bfloat16
    """

    compensation: str = "kahan"
    state_dtype: torch.dtype | str = torch.float32

    def __post_init__(self) -> None:
        if self.compensation not in COMPENSATIONS:
            raise ValueError(f"bf16_true_compensation must be one of {', '.join(map(repr, COMPENSATIONS))}, "
                             f"got {self.compensation!r}")
        dtype = STATE_DTYPE_NAMES.get(self.state_dtype, self.state_dtype) if isinstance(self.state_dtype, str) \
            else self.state_dtype
        if dtype not in STATE_DTYPE_NAMES.values():
            raise ValueError(f"bf16_true_state_dtype={self.state_dtype!r} is not valid; choose one of: 'fp32', 'bf16' "
                             "(torch.float32 or torch.bfloat16: the compensated optimizer's moments)")
        object.__setattr__(self, "state_dtype", dtype)


class BF16TruePrecision(PrecisionPlugin):
    """bf16 storage and compute, fp32-kept norms, a compensated optimizer update.

    Args:
        policy: the resolved bf16-true policy.
        device: the device the run trains on.
        loss_scaler: refused (bf16 has fp32's range).
        bf16_true: a :class:`BF16TrueConfig` (default: Kahan compensation, fp32 moments).

    Example:
        >>> from mixprec.precision import make_plugin
        >>> plugin = make_plugin("bf16-true", "cpu")
        >>> model = plugin.convert_module(torch.nn.Linear(4, 1))
        >>> opt = plugin.convert_optimizer(torch.optim.AdamW(model.parameters()))
        >>> model.weight.dtype, type(opt).__module__
        (torch.bfloat16, 'mixprec.optim')
    """

    def __init__(self, policy: PrecisionPolicy, device: str | torch.device, *, loss_scaler: Any = None,
                 bf16_true: BF16TrueConfig | None = None) -> None:
        super().__init__(policy, device, loss_scaler=loss_scaler)
        self.config = bf16_true if bf16_true is not None else BF16TrueConfig()

    @property
    def optimizer_state_dtype(self) -> torch.dtype | None:
        """The compensated optimizer's ``state_dtype``; without compensation torch's own optimizer
        keeps the moments in the parameters' bf16."""
        return self.config.state_dtype if self.config.compensation != "none" else self.policy.param_dtype

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        # bf16 everywhere but normalisation layers, whose statistics stay fp32.
        return cast_for_bf16_true(module, dtype=self.policy.param_dtype)

    @property
    def input_dtype(self) -> torch.dtype:
        return self.policy.param_dtype

    def convert_input(self, data: Any) -> Any:
        return send_to_device(data, self.device, float_dtype=self.policy.param_dtype)

    def convert_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if self.config.compensation == "none":
            return optimizer
        return compensated_for_bf16(optimizer, self.config.compensation, self.config.state_dtype)


class GuardedBF16TruePrecision(BF16TruePrecision, MixedPrecision):
    """bf16-true that skips an optimizer step whose gradients hold inf/NaN (``skip_nonfinite_steps``).

    bf16-true's model, inputs and compensated optimizer, with :class:`MixedPrecision`'s step: the
    loss scaler's inf/NaN check (``_amp_foreach_non_finite_check_and_unscale_``, bf16 gradients
    included) and skip, at a scale pinned to 1 (:data:`~mixprec.precision.names.NONFINITE_GUARD`),
    so the loss and gradients are multiplied by 1 and nothing else changes. A skipped step leaves
    the weights, the moments, the Kahan buffers and the step count as they were; it is counted in
    ``skipped_steps``, and ``max_consecutive_skips`` applies.

    One host sync per step: the compensated optimizer has no fused, scale-aware ``step`` (torch's
    ``fused=True`` optimizers take the found-inf flag on the device), so deciding whether to call
    ``step()`` reads the flag once, as ``torch.amp.GradScaler`` does for any optimizer without one.
    On the CPU that read is no device synchronisation at all.

    Args:
        policy: the resolved bf16-true policy.
        device: the device the run trains on.
        loss_scaler: the guard's :class:`~mixprec.LossScaler` or a dict of its arguments
            (:func:`~mixprec.precision.make_plugin` pins its scale to 1).
        bf16_true: a :class:`BF16TrueConfig`.

    Example:
        >>> from mixprec.precision import make_plugin
        >>> plugin = make_plugin("bf16-true", "cpu", skip_nonfinite_steps=True)
        >>> model = plugin.convert_module(torch.nn.Linear(4, 1))
        >>> opt = plugin.convert_optimizer(torch.optim.AdamW(model.parameters()))
        >>> plugin.track_optimizer(opt)
        >>> x = torch.randn(8, 4); x[0, 0] = float("nan")
        >>> plugin.backward(model(plugin.convert_input(x)).float().pow(2).mean()); plugin.optimizer_step(opt)
        >>> plugin.step_was_skipped(opt), bool(torch.isfinite(model.weight).all())
        (True, True)
    """

    def fallback_precision(self, native_bf16: bool) -> str | None:
        return None  # the guard only skips: a run of inf/NaN steps has no safer precision to switch to
