"""Which plugin carries out each precision: one entry per canonical name, and ``make_plugin``."""

from __future__ import annotations

from typing import Any

import torch

from mixprec.precision.base import PrecisionPlugin
from mixprec.precision.bf16_true import BF16TruePrecision
from mixprec.precision.config import PrecisionConfig
from mixprec.precision.fp8 import Float8Precision
from mixprec.precision.fp32 import FP32Precision
from mixprec.precision.mixed import MixedPrecision
from mixprec.precision.names import PrecisionPolicy, resolve_precision

__all__ = ["PLUGINS", "make_plugin"]

#: canonical precision name -> the plugin class that carries it out.
PLUGINS: dict[str, type[PrecisionPlugin]] = {
    "fp32": FP32Precision,
    "fp16-mixed": MixedPrecision,
    "bf16-mixed": MixedPrecision,
    "bf16-true": BF16TruePrecision,
    "fp8": Float8Precision,
}


def make_plugin(precision: str | PrecisionPolicy, device: str | torch.device, config: PrecisionConfig | None = None,
                **options: Any) -> PrecisionPlugin:
    """The plugin that carries out ``precision`` on ``device``.

    Args:
        precision: a name, alias or :class:`PrecisionPolicy`.
        device: the device the run trains on.
        config: a :class:`~mixprec.precision.PrecisionConfig` (the loss scaler's options, the
            inf/NaN guard, bf16-true's compensation, ...).
        **options: :class:`~mixprec.precision.PrecisionConfig`'s fields, instead of ``config``.

    Example:
        >>> type(make_plugin("bf16", "cpu")).__name__
        'MixedPrecision'
        >>> make_plugin("fp32", "cpu", skip_nonfinite_steps=True).scaler.get_scale()
        1.0
    """
    if config is not None and options:
        raise ValueError(f"give config= or its fields ({', '.join(options)}), not both")
    policy = resolve_precision(precision, device)
    return PLUGINS[policy.name](policy, device, config if config is not None else PrecisionConfig(**options))
