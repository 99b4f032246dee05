"""The doctor's plots, kept importable here: they live in :mod:`mixprec.plots` with the others."""

from __future__ import annotations

from ..plots import plot_gradient_histogram, plot_layer_underflow

__all__ = ["plot_gradient_histogram", "plot_layer_underflow"]
