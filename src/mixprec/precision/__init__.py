"""Precision: the names, the policies they stand for, and one plugin per precision family.

``resolve_precision(name)`` gives the :class:`PrecisionPolicy` (what a precision is);
``make_plugin(name, device)`` gives the :class:`PrecisionPlugin` (what it does): ``fp32``,
``mixed`` (fp16/bf16 autocast and the loss scaler's lifecycle) and ``bf16_true``.
"""

from mixprec.precision.base import PrecisionPlugin, PrecisionPolicy
from mixprec.precision.bf16_true import BF16TrueConfig, BF16TruePrecision, GuardedBF16TruePrecision
from mixprec.precision.fp32 import FP32Precision
from mixprec.precision.mixed import MixedPrecision
from mixprec.precision.names import (
    CANONICAL_PRECISIONS,
    PrecisionPerformanceWarning,
    canonical_precision,
    make_plugin,
    policy_for,
    precision_names,
    resolve_precision,
)

__all__ = [
    "BF16TrueConfig",
    "BF16TruePrecision",
    "CANONICAL_PRECISIONS",
    "FP32Precision",
    "GuardedBF16TruePrecision",
    "MixedPrecision",
    "PrecisionPerformanceWarning",
    "PrecisionPlugin",
    "PrecisionPolicy",
    "canonical_precision",
    "make_plugin",
    "policy_for",
    "precision_names",
    "resolve_precision",
]
