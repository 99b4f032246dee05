"""One configuration of what a precision does beyond its name, taken by the Accelerator
(``precision_config=``), ``TrainingArguments``, ``mixprec train``'s ``[precision]`` table and the
bench: the loss scaler's options, bf16-true's compensation and moments' dtype, the inf/NaN
guard, and what a collapsed loss scale does."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.precision.optim.compensated import COMPENSATIONS, STATE_DTYPE_NAMES
from mixprec.precision.scaler import LossScaler

__all__ = ["COLLAPSE_POLICIES", "PrecisionConfig"]

COLLAPSE_POLICIES = ("raise", "fallback")
#: torchao's float8 training recipes (mixprec.precision.fp8 uses them; named here, where they are checked).
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """What a precision does beyond its name, validated once for every layer that takes it.

    Args:
        loss_scaler: a :class:`~mixprec.LossScaler`, or a dict of its arguments. fp16 gets a
            default one; bf16-mixed may take one (it rarely needs it); fp32 and bf16-true refuse
            one, unless ``skip_nonfinite_steps`` (then its ``max_consecutive_skips`` applies).
        skip_nonfinite_steps: in fp32, bf16-mixed and bf16-true too, skip an optimizer step whose
            gradients hold inf/NaN (the loss scaler's check at a scale pinned to 1); ``"auto"``:
            wherever the precision has it (all do). fp16 always skips them.
        bf16_true_compensation: for bf16-true, how the optimizer keeps updates smaller than
            bf16's resolution of the weights: ``"kahan"`` (default), ``"stochastic"`` rounding,
            or ``"none"`` (the user's optimizer as it is: small updates are then lost).
        bf16_true_state_dtype: for bf16-true with compensation, the optimizer's moments:
            ``torch.float32`` (default) or ``torch.bfloat16`` (``"fp32"``/``"bf16"`` accepted).
        on_loss_scale_collapse: ``"raise"`` (default) or ``"fallback"`` (switch to bf16-mixed
            where bf16 is native, else fp32, and continue).
        fp8_recipe: for fp8, torchao's float8 recipe: ``"tensorwise"`` (default), ``"rowwise"``,
            ``"rowwise_with_gw_hp"`` (weight gradients in high precision), or a torchao
            ``Float8LinearConfig``.
        fp8_filter: for fp8, which Linear layers stay in bf16 instead of the default (the first
            and the last): a list of layer names, or ``(module, name) -> bool`` (``True``:
            convert, torchao's ``module_filter_fn``). See :func:`mixprec.precision.fp8.float8_layer_choice`.

    Example:
        >>> PrecisionConfig(bf16_true_state_dtype="bf16").bf16_true_state_dtype
        torch.bfloat16
    """

    loss_scaler: LossScaler | dict[str, Any] | None = None
    skip_nonfinite_steps: bool | str = False
    bf16_true_compensation: str = "kahan"
    bf16_true_state_dtype: torch.dtype | str = torch.float32
    on_loss_scale_collapse: str = "raise"
    fp8_recipe: Any = "tensorwise"
    fp8_filter: Any = None

    def __post_init__(self) -> None:
        if self.loss_scaler is not None and not isinstance(self.loss_scaler, (LossScaler, dict)):
            raise TypeError(f"loss_scaler must be a LossScaler or a dict of its arguments, got "
                            f"{type(self.loss_scaler).__name__}")
        if self.skip_nonfinite_steps not in (True, False, "auto"):
            raise ValueError(f"skip_nonfinite_steps must be True, False or 'auto', got {self.skip_nonfinite_steps!r}")
        if self.bf16_true_compensation not in COMPENSATIONS:
            raise ValueError(f"bf16_true_compensation must be one of {', '.join(map(repr, COMPENSATIONS))}, "
                             f"got {self.bf16_true_compensation!r}")
        dtype = self.bf16_true_state_dtype
        dtype = STATE_DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, str) else dtype
        if dtype not in STATE_DTYPE_NAMES.values():
            raise ValueError(f"bf16_true_state_dtype={self.bf16_true_state_dtype!r} is not valid; choose one of: "
                             "'fp32', 'bf16' (torch.float32 or torch.bfloat16: the compensated optimizer's moments)")
        object.__setattr__(self, "bf16_true_state_dtype", dtype)
        if isinstance(self.fp8_recipe, str) and self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"fp8_recipe={self.fp8_recipe!r} is not a float8 recipe; choose one of: "
                             f"{', '.join(map(repr, FP8_RECIPES))}, or give a torchao Float8LinearConfig")
        if self.fp8_filter is not None and not (callable(self.fp8_filter) or (
                isinstance(self.fp8_filter, (list, tuple)) and all(isinstance(n, str) for n in self.fp8_filter))):
            raise TypeError("fp8_filter must be a list of Linear layer names to keep in bf16, or a callable "
                            f"(module, name) -> bool; got {type(self.fp8_filter).__name__}")
        if isinstance(self.fp8_filter, list):
            object.__setattr__(self, "fp8_filter", tuple(self.fp8_filter))
        if self.on_loss_scale_collapse not in COLLAPSE_POLICIES:
            raise ValueError(f"on_loss_scale_collapse must be 'raise' or 'fallback', got {self.on_loss_scale_collapse!r}")

    @property
    def guards_nonfinite(self) -> bool:
        """Whether steps with inf/NaN gradients are skipped in every precision."""
        return bool(self.skip_nonfinite_steps)

    def replace(self, **changes: Any) -> PrecisionConfig:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)
