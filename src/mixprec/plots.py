"""Plots a person can read: titled axes, legends, labelled limits (matplotlib, an optional extra)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["plot_loss_curves", "plot_loss_scale"]


def pyplot():
    try:
        import matplotlib
    except ImportError as e:  # matplotlib is the `plot` extra
        raise ImportError("plots need matplotlib: pip install 'mixprec[plot]'") from e
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, ax, path: str | Path, *, title: str, xlabel: str, ylabel: str, legend: dict | None = None,
          grid: dict | None = None) -> Path:
    """Label, lay out and write a figure: every plot here is titled, with labelled axes and a legend."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, **(grid or {}))
    ax.legend(**(legend or {}))
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    pyplot().close(fig)
    return path


def plot_loss_curves(train: Mapping[str, Sequence[tuple[int, float]]], path: str | Path, *,
                     evaluation: Mapping[str, Sequence[tuple[int, float]]] | None = None,
                     title: str = "Training loss") -> Path:
    """Loss against optimizer step for several runs (e.g. fp32 beside bf16-mixed).

    Args:
        train: run name -> ``(step, loss)`` points of the training loss.
        path: the PNG to write.
        evaluation: run name -> ``(step, eval loss)`` points, drawn as markers.
        title: the figure's title.
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    colors = {}
    for name, points in train.items():
        if points:
            steps, losses = zip(*points)
            (line,) = ax.plot(steps, losses, label=f"{name} (train)", linewidth=1.4)
            colors[name] = line.get_color()
    for name, points in (evaluation or {}).items():
        if points:
            steps, losses = zip(*points)
            ax.plot(steps, losses, "o--", color=colors.get(name), label=f"{name} (validation)", markersize=5)
    return save_figure(fig, ax, path, title=title, xlabel="optimizer step", ylabel="cross-entropy loss (nats per byte)")


def plot_loss_scale(history: Sequence[tuple[int, float, bool]], path: str | Path, *,
                    title: str = "fp16 loss scale") -> Path:
    """The loss scale over steps on a log2 axis, skipped (overflow) steps marked in red.

    Args:
        history: ``(step, scale after the update, whether that step was skipped)``.
        path: the PNG to write.
        title: the figure's title.
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4), dpi=110)
    if history:
        steps, scales, skipped = zip(*history)
        ax.step(steps, scales, where="post", label="loss scale", linewidth=1.4)
        bad = [(s, v) for s, v, k in history if k]
        if bad:
            ax.scatter(*zip(*bad), color="red", zorder=3, s=18, label=f"skipped step (inf/NaN gradients): {len(bad)}")
        else:
            ax.plot([], [], " ", label="no step skipped")
    ax.set_yscale("log", base=2)
    return save_figure(fig, ax, path, title=title, xlabel="optimizer step", ylabel="loss scale (log2)", grid={"which": "both"})
