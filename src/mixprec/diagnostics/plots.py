"""The doctor's plots: the seed's FP32/FP16 diagram, drawn from the user's own gradients."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..plots import pyplot, save_figure
from .limits import FORMAT_LIMITS

__all__ = ["plot_gradient_histogram", "plot_layer_underflow"]


def _total_hist(probe: dict[str, Any], which: str) -> tuple[list[int], int, int]:
    """Summed log2 histogram over steps and modules, with the zero and total counts."""
    hist: list[int] = []
    zeros = total = 0
    for rec in probe["stats"]:
        for entry in rec["modules"].values():
            h = entry[which]["log2_hist"]
            hist = [a + b for a, b in zip(hist, h)] if hist else list(h)
            zeros += round(entry[which]["zero"] * entry["numel"])
            total += entry["numel"]
    return hist, zeros, total


def plot_gradient_histogram(probe: dict[str, Any], path: str | Path, *, scale: float, title: str) -> Path:
    """log2|gradient| over the fp16 and bf16 number lines, without and with the loss scale.

    The fp16 subnormal band, its flush-to-zero threshold and its overflow limit are marked; bf16
    shares fp32's exponent range, which reaches far past both ends of the plot.
    """
    plt = pyplot()
    edges = probe["hist_edges"]
    lo, hi = edges[0], edges[-1]
    # Bin i covers (2**(x-1), 2**x]: draw it at its upper edge; the end bins hold everything beyond.
    xs = [lo] + edges[1:] + [hi + 1]
    fig, ax = plt.subplots(figsize=(9, 5.4), dpi=110)
    for which, label, color in (("unscaled", "gradients as they are", "0.45"),
                                ("at_scale", f"x loss scale {scale:g} (2^{math.log2(scale):g})", "tab:blue")):
        hist, zeros, total = _total_hist(probe, which)
        if not hist:
            continue
        frac = [c / max(total, 1) for c in hist]
        ax.step(xs, frac, where="pre", color=color, linewidth=1.6, label=label)
    f16 = FORMAT_LIMITS["fp16"]
    ax.axvspan(math.log2(f16.smallest_subnormal), math.log2(f16.smallest_normal), color="tab:orange", alpha=0.15,
               label="fp16 subnormals (precision lost)")
    ax.axvline(math.log2(f16.flush_threshold), color="tab:red", linestyle="--",
               label=f"fp16 flushes to 0 below 2^{math.log2(f16.flush_threshold):g}")
    ax.axvline(math.log2(f16.max), color="tab:red", linestyle="-",
               label=f"fp16 overflows above {f16.max:g} (~2^{math.log2(f16.max):.0f})")
    b16 = FORMAT_LIMITS["bf16"]
    ax.annotate(f"bf16 (and fp32) reach down to 2^{math.log2(b16.smallest_normal):g} and up to ~2^128:\n"
                "both ends lie far outside this plot", xy=(0.02, 0.97), xycoords="axes fraction", va="top", fontsize=8,
                bbox={"boxstyle": "round", "fc": "white", "ec": "0.7"})
    ax.set_xlim(lo - 1, hi + 2)
    return save_figure(fig, ax, path, title=title, xlabel="log2 |gradient value|", ylabel="fraction of gradient values",
                 legend={"loc": "upper center", "bbox_to_anchor": (0.5, -0.14), "ncol": 3, "fontsize": 8})


def plot_layer_underflow(layers: list[dict[str, Any]], path: str | Path, *, scale: float, title: str,
                         max_layers: int = 25) -> Path:
    """Per layer, the fraction of gradient values fp16 would flush to zero (with and without the
    loss scale) and bf16 would, as horizontal bars: the worst layers first."""
    plt = pyplot()
    rows = sorted(layers, key=lambda r: -max(r["fp16_flush"], r["fp16_flush_at_scale"]))[:max_layers][::-1]
    names = [r["module"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.38 * max(len(rows), 1)), dpi=110)
    y = range(len(rows))
    h = 0.27
    series = [("fp16_flush", h, "0.55", "fp16, no loss scale"), ("fp16_flush_at_scale", 0, "tab:blue",
              f"fp16 at scale {scale:g}"), ("bf16_flush", -h, "tab:green", "bf16, no loss scale")]
    top = max([r[k] for r in rows for k, *_ in series] + [0.0])
    for key, offset, color, label in series:
        values = [r[key] for r in rows]
        ax.barh([i + offset for i in y], values, h, color=color, label=label)
        for i, v in zip(y, values):
            if v > 0:  # small fractions would be invisible bars: say them
                ax.text(v, i + offset, f" {v:.2%}", va="center", fontsize=7)
    ax.set_yticks(list(y), names, fontsize=8)
    ax.set_xlim(0, max(0.01, top * 1.3))
    return save_figure(fig, ax, path, title=title, xlabel="fraction of the layer's gradient values flushed to zero (worst step)",
                 ylabel="layer (module path)", legend={"loc": "lower right", "fontsize": 8}, grid={"axis": "x"})
