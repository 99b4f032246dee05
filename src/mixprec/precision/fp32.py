"""fp32: full precision, no autocast, no loss scaler. The plugin base class is this behaviour."""

from __future__ import annotations

from mixprec.precision.base import PrecisionPlugin

__all__ = ["FP32Precision"]


class FP32Precision(PrecisionPlugin):
    """fp32 training: the forward, backward and step as plain torch runs them.

    Example:
        >>> from mixprec.precision import make_plugin
        >>> type(make_plugin("no", "cpu")).__name__
        'FP32Precision'
    """
