"""Precision: the names, the policies they stand for, and one plugin per precision family.

``resolve_precision(name)`` gives the :class:`PrecisionPolicy` (what a precision is);
``make_plugin(name, device)`` gives the :class:`PrecisionPlugin` (what it does): ``fp32``,
``mixed`` (fp16/bf16 autocast) and ``bf16_true``; a :class:`PrecisionConfig` says what it does
beyond its name (the loss scaler's options, the inf/NaN guard, bf16-true's compensation). Also
here: the loss scaler, the precision fallback, bf16-true's casts and compensated optimizers.
"""

from mixprec.precision.base import NONFINITE_GUARD, PrecisionPlugin
from mixprec.precision.bf16_true import BF16TruePrecision
from mixprec.precision.config import PrecisionConfig
from mixprec.precision.fp32 import FP32Precision
from mixprec.precision.mixed import MixedPrecision
from mixprec.precision.names import (
    CANONICAL_PRECISIONS,
    PrecisionPerformanceWarning,
    PrecisionPolicy,
    accelerate_name,
    canonical_precision,
    lightning_name,
    policy_for,
    precision_names,
    resolve_precision,
    trainer_flags,
)
from mixprec.precision.registry import PLUGINS, make_plugin
from mixprec.precision.scaled_steps import ScaledSteps

__all__ = [
    "BF16TruePrecision",
    "CANONICAL_PRECISIONS",
    "FP32Precision",
    "MixedPrecision",
    "NONFINITE_GUARD",
    "PLUGINS",
    "PrecisionConfig",
    "PrecisionPerformanceWarning",
    "PrecisionPlugin",
    "PrecisionPolicy",
    "ScaledSteps",
    "accelerate_name",
    "canonical_precision",
    "lightning_name",
    "make_plugin",
    "policy_for",
    "precision_names",
    "resolve_precision",
    "trainer_flags",
]
