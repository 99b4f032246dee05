"""Plots a person can read: titled axes, legends, labelled limits (matplotlib, an optional extra).

Every figure is a ``matplotlib.figure.Figure`` written with its own ``savefig``: pyplot is never
imported and no backend is chosen, so a plot drawn here leaves the user's matplotlib as it was
(an interactive backend, their open figures). The loss curves (against steps and, beside them,
against seconds of training) and the loss scale come from a run (``mixprec demo``, the doctor);
the gradient histogram and the per-layer underflow bars are the doctor's: the seed's FP32/FP16
diagram, drawn from the user's own gradients.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mixprec.diagnostics.limits import FORMAT_LIMITS

__all__ = ["plot_demo", "plot_loss_curves", "plot_loss_scale", "plot_gradient_histogram", "plot_layer_underflow", "plot_bench_result",
           "plot_float8_errors", "plot_float8_histogram"]


def _figure(figsize: tuple[float, float], panels: int = 1) -> tuple[Any, Any]:
    """A new figure and its axes (one, or a list of ``panels`` side by side), outside pyplot
    (nothing global is touched)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:  # matplotlib is the `plot` extra
        raise ImportError("plots need matplotlib: pip install 'mixprec[plot]'") from e
    fig = Figure(figsize=figsize, dpi=110)
    return fig, fig.subplots() if panels == 1 else list(fig.subplots(1, panels))


def _label(ax: Any, *, title: str, xlabel: str, ylabel: str, legend: dict | None = None,
           grid: dict | None = None) -> None:
    """Every plot here is titled, with labelled axes and a legend."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, **(grid or {}))
    ax.legend(**(legend or {}))


def _save(fig: Any, ax: Any, path: str | Path, **labels: Any) -> Path:
    """Label ``ax`` (see :func:`_label`), lay out and write the figure."""
    _label(ax, **labels)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path


def plot_loss_curves(train: Mapping[str, Sequence[tuple[int, float]]], path: str | Path, *,
                     evaluation: Mapping[str, Sequence[tuple[int, float]]] | None = None,
                     seconds: Mapping[str, Mapping[int, float]] | None = None,
                     title: str = "Training loss") -> Path:
    """Loss against optimizer step for several runs (e.g. fp32 beside bf16-mixed), and, given
    ``seconds``, beside it the same losses against seconds of training: what a faster precision
    buys in the same minutes.

    Args:
        train: run name -> ``(step, loss)`` points of the training loss.
        path: the PNG to write.
        evaluation: run name -> ``(step, eval loss)`` points, drawn as markers.
        seconds: run name -> {step: seconds of training when that step ended}; a second panel
            plots each point at its step's time (points of steps it lacks are left out).
        title: the figure's title.

    Example:
        >>> plot_loss_curves({"fp32": [(1, 2.0), (2, 1.5)]}, "loss.png",  # doctest: +SKIP
        ...                  seconds={"fp32": {1: 0.4, 2: 0.8}})
    """
    ylabel = "cross-entropy loss (nats per byte)"
    if seconds is None:
        fig, by_step = _figure((8, 4.5))
    else:
        fig, (by_step, by_time) = _figure((14, 4.5), panels=2)
        _draw_losses(by_time, train, evaluation or {}, seconds)
        _label(by_time, title="the same runs against time", ylabel=ylabel,
               xlabel="seconds of training (wall clock; evaluations and checkpoints left out)")
    _draw_losses(by_step, train, evaluation or {}, None)
    return _save(fig, by_step, path, title=title, xlabel="optimizer step", ylabel=ylabel)


def _draw_losses(ax: Any, train: Mapping[str, Sequence[tuple[int, float]]],
                 evaluation: Mapping[str, Sequence[tuple[int, float]]], clock: Mapping[str, Mapping[int, float]] | None
                 ) -> None:
    """Each run's training loss as a line and its evaluation loss as markers of the same colour,
    at each point's step, or at its step's time in ``clock``."""
    def at(name: str, points: Sequence[tuple[int, float]]) -> list[tuple[float, float]]:
        if clock is None:
            return list(points)
        times = clock.get(name, {})
        return [(times[step], loss) for step, loss in points if step in times]

    colors = {}
    for name, points in train.items():
        if xy := at(name, points):
            # (few points, a short run's: marked, so that even one shows)
            (line,) = ax.plot(*zip(*xy), ".-" if len(xy) < 20 else "-", label=f"{name} (train)", linewidth=1.4)
            colors[name] = line.get_color()
    for name, points in evaluation.items():
        if xy := at(name, points):
            ax.plot(*zip(*xy), "o--", color=colors.get(name), label=f"{name} (validation)", markersize=5)


def plot_loss_scale(history: Sequence[tuple[int, float, bool]], path: str | Path, *,
                    title: str = "fp16 loss scale") -> Path:
    """The loss scale over steps on a log2 axis, skipped (overflow) steps marked in red.

    Args:
        history: ``(step, scale after the update, whether that step was skipped)``.
        path: the PNG to write.
        title: the figure's title.
    """
    fig, ax = _figure((8, 4))
    if history:
        steps, scales, skipped = zip(*history)
        ax.step(steps, scales, where="post", label="loss scale", linewidth=1.4)
        bad = [(s, v) for s, v, k in history if k]
        if bad:
            ax.scatter(*zip(*bad), color="red", zorder=3, s=18, label=f"skipped step (inf/NaN gradients): {len(bad)}")
        else:
            ax.plot([], [], " ", label="no step skipped")
    ax.set_yscale("log", base=2)
    return _save(fig, ax, path, title=title, xlabel="optimizer step", ylabel="loss scale (log2)", grid={"which": "both"})


def plot_demo(speed: Sequence[Mapping[str, Any]], lesson: Mapping[str, Mapping[str, Any]] | None, path: str | Path,
              *, raced: bool, title: str, native_figure: str = "") -> Path:
    """``mixprec demo``'s one figure, from its run: where 16-bit speed comes from (top left), and
    where the underflow lesson ran, its three runs' losses (top right), the loss scale over the
    steps (bottom left) and the gradients against fp16's range before and after scaling (bottom
    right, :func:`plot_gradient_histogram`'s drawing).

    Args:
        speed: the two runs of the speed comparison, fp32 first
            (:func:`mixprec.apps.demo.train_run`'s results).
        lesson: ``"fp32"``, ``"fp16-mixed"`` and ``"fp16-unscaled"`` -> their results (``grads``,
            ``scale_history`` on the scaled one), or ``None`` where the lesson did not run.
        path: the PNG to write.
        raced: the speed runs had the same seconds each (loss against seconds is drawn); else the
            same steps (the seconds each took are drawn as bars).
        title: the figure's title.
        native_figure: where 16-bit is native, what it gives (written under the bars).

    Example:
        >>> plot_demo([fp32, bf16], None, "demo.png", raced=True, title="pycode")  # doctest: +SKIP
    """
    rows = 2 if lesson else 1
    fig = _figure((14, 4.6 * rows + 0.6))[0]
    fig.clear()
    axes = fig.subplots(rows, 2, squeeze=False)
    fig.suptitle(title, fontsize=13)
    _draw_speed(axes[0][0], speed, raced, native_figure)
    if lesson:
        _draw_lesson_losses(axes[0][1], lesson)
        scaled = lesson["fp16-mixed"]
        _draw_scale(axes[1][0], scaled)
        grads = scaled.get("grads")
        if grads:
            probe = grads["histogram"]
            lost = (lesson["fp16-unscaled"].get("grads") or {}).get("zero")
            _draw_gradient_histogram(axes[1][1], probe, scale=probe["scale"])
            note = f"in fp16 without loss scaling, {lost:.0%} of the gradient values were 0" if lost is not None else ""
            _label(axes[1][1], title=f"the gradients at step {probe['step']} against fp16's number line\n{note}",
                   xlabel="log2 |gradient value|", ylabel="fraction of gradient values",
                   legend={"loc": "center right", "fontsize": 8})
    else:
        axes[0][1].set_axis_off()
        axes[0][1].text(0.5, 0.5, "the underflow lesson did not run (--lesson-steps 0)", ha="center", va="center")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path


def _draw_speed(ax: Any, runs: Sequence[Mapping[str, Any]], raced: bool, native_figure: str) -> None:
    """The speed comparison: loss against seconds (the same seconds each), or the seconds the same
    steps took, as bars with the ratio written on them."""
    ylabel = "loss (nats per byte; lower is better)"
    if raced:
        _draw_losses(ax, {r["name"]: r["train"] for r in runs}, {r["name"]: r["eval"] for r in runs},
                     {r["name"]: r["seconds"] for r in runs})
        ratio = runs[-1]["tokens_per_second"] / runs[0]["tokens_per_second"]
        _label(ax, title=f"the same seconds each: {runs[-1]['name']} trained {ratio:.2f}x the tokens/s of fp32",
               ylabel=ylabel, xlabel="seconds of training (evaluations and checkpoints left out)")
        return
    names = [r["name"] for r in runs]
    secs = [r["training_seconds"] for r in runs]
    bars = ax.barh(names, secs, color=["tab:blue", "tab:orange"][: len(runs)])
    for bar, sec in zip(bars, secs):
        ax.annotate(f" {sec:.1f} s ({sec / secs[0]:.1f}x fp32's)", (sec, bar.get_y() + bar.get_height() / 2),
                    va="center", fontsize=9)
    ax.set_xlim(0, max(secs) * 1.45)
    ax.invert_yaxis()
    if native_figure:
        ax.plot([], [], " ", label="\n".join(_wrap(native_figure, 60)))
    _label(ax, title=f"the same {runs[-1]['steps']} steps each: the seconds they took here (16-bit is emulated)",
           xlabel="seconds of training (evaluations and checkpoints left out)", ylabel="precision",
           # beside fp32's bar, the short one on top: at the bottom it would cover the 16-bit bar
           legend={"loc": "upper right", "fontsize": 8})


def _draw_lesson_losses(ax: Any, lesson: Mapping[str, Mapping[str, Any]]) -> None:
    """The lesson's three runs, loss against step."""
    _draw_losses(ax, {_LESSON_LABELS[n]: r["train"] for n, r in lesson.items()},
                 {_LESSON_LABELS[n]: r["eval"] for n, r in lesson.items()}, None)
    run = lesson["fp16-mixed"]
    _label(ax, title=f"the same {run['steps']} steps each, the loss averaged over {run['step_tokens']:,} tokens\n"
                     "(each token's gradient as small as in a pretraining step that large)",
           xlabel="optimizer step", ylabel="loss (nats per byte; lower is better)", legend={"fontsize": 8})


_LESSON_LABELS = {"fp32": "fp32", "fp16-mixed": "fp16-mixed, loss scaled", "fp16-unscaled": "fp16, no loss scaling"}


def _draw_scale(ax: Any, run: Mapping[str, Any]) -> None:
    """The loss scale over the steps, the skipped (overflow) steps marked."""
    history = run.get("scale_history") or []
    if history:
        steps, scales, _ = zip(*history)
        ax.step(steps, scales, where="post", label="loss scale", linewidth=1.4)
        bad = [(st, v) for st, v, k in history if k]
        if bad:
            ax.scatter(*zip(*bad), color="red", zorder=3, s=18,
                       label=f"overflow: step skipped, scale halved ({len(bad)})")
    ax.set_yscale("log", base=2)
    grow = run.get("growth_interval")
    _label(ax, title=f"fp16's loss scale: doubled after {grow} clean steps, halved on overflow",
           xlabel="optimizer step", ylabel="loss scale (log2)", grid={"which": "both"}, legend={"fontsize": 8})


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width)


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
    fig, ax = _figure((9, 5.4))
    _draw_gradient_histogram(ax, probe, scale=scale)
    return _save(fig, ax, path, title=title, xlabel="log2 |gradient value|", ylabel="fraction of gradient values",
                 legend={"loc": "upper center", "bbox_to_anchor": (0.5, -0.14), "ncol": 3, "fontsize": 8})


def _draw_gradient_histogram(ax: Any, probe: dict[str, Any], *, scale: float) -> None:
    """:func:`plot_gradient_histogram`'s drawing, on ``ax`` (unlabelled)."""
    edges = probe["hist_edges"]
    lo, hi = edges[0], edges[-1]
    # Bin i covers (2**(x-1), 2**x]: draw it at its upper edge; the end bins hold everything beyond.
    xs = [lo] + edges[1:] + [hi + 1]
    top = 0.0
    for which, label, color in (("unscaled", "gradients as they are", "0.45"),
                                ("at_scale", f"x loss scale 2^{math.log2(scale):g} ({scale:,.0f})", "tab:blue")):
        hist, zeros, total = _total_hist(probe, which)
        if not hist:
            continue
        frac = [c / max(total, 1) for c in hist]
        top = max(top, *frac)
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
    # Room above the highest bin for the note in the top left corner, which would hide a peak there.
    ax.set_ylim(0, max(top, 1e-9) * 1.3)


def plot_layer_underflow(layers: list[dict[str, Any]], path: str | Path, *, scale: float, title: str,
                         max_layers: int = 25) -> Path:
    """Per layer, the fraction of gradient values fp16 would flush to zero (with and without the
    loss scale) and bf16 would, as horizontal bars: the worst layers first."""
    rows = sorted(layers, key=lambda r: -max(r["fp16_flush"], r["fp16_flush_at_scale"]))[:max_layers][::-1]
    names = [r["module"] for r in rows]
    fig, ax = _figure((9, 1.2 + 0.38 * max(len(rows), 1)))
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
    return _save(fig, ax, path, title=title, xlabel="fraction of the layer's gradient values flushed to zero (worst step)",
                 ylabel="layer (module path)", legend={"loc": "lower right", "fontsize": 8}, grid={"axis": "x"})


def plot_float8_errors(layers: dict[str, dict[str, Any]], recipes: Sequence[str], recommendation: dict[str, Any],
                       path: str | Path, *, title: str) -> Path:
    """Per Linear layer, the relative error of its output in fp8 against bf16 under each recipe
    (log scale), the layers the recommendation keeps in bf16 marked, and the threshold it used."""
    names = [n for n, row in layers.items() if all(r in row for r in recipes)]
    fig, ax = _figure((max(7.0, 0.5 * len(names) + 3), 4.8))
    width = 0.8 / max(len(recipes), 1)
    colors = ["tab:blue", "tab:orange", "tab:green"]
    for k, r in enumerate(recipes):
        ax.bar([i + (k - (len(recipes) - 1) / 2) * width for i in range(len(names))],
               [max(layers[n][r]["output_error"], 1e-6) for n in names], width, color=colors[k % 3], label=r)
    median = recommendation["median_output_error"].get(recommendation["recipe"], 0.0)
    keep = recommendation["keep_in_bf16"]
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), [n + (" (bf16)" if n in keep else "") for n in names], rotation=60,
                  ha="right", fontsize=7)
    for i, n in enumerate(names):
        if n in keep:
            ax.axvspan(i - 0.45, i + 0.45, color="0.9", zorder=0)
    if median > 0:
        ax.axhline(median, color="0.3", linestyle=":", label=f"median layer ({recommendation['recipe']})")
    return _save(fig, ax, path, title=title, xlabel="Linear layer (shaded: kept in bf16 by the recommendation)",
                 ylabel="relative error of the output, fp8 vs bf16", legend={"fontsize": 8}, grid={"axis": "y"})


def plot_float8_histogram(x: Any, path: str | Path, *, recipe: str, title: str) -> Path:
    """``log2|x|`` of one layer's input before and after torchao's scaling (per tensor for
    tensorwise, per row otherwise), over e4m3's number line: the largest value, the smallest
    normal and subnormal ones marked; what lands left of the subnormals is flushed to zero."""
    import torch

    from mixprec.precision.fp8 import quantise_float8

    flat = x.reshape(-1, x.shape[-1]).float()
    _, scale = quantise_float8(flat, torch.float8_e4m3fn, dim=None if recipe == "tensorwise" else -1,
                               power_of_2=recipe != "tensorwise")
    scaled = (flat * scale).flatten()
    fig, ax = _figure((9, 4.5))
    for values, color, label in ((flat.flatten(), "0.6", "the input (bf16)"),
                                 (scaled, "tab:blue", f"after {recipe} scaling")):
        nz = values[values != 0].abs()
        if nz.numel():
            ax.hist(torch.log2(nz).clamp(-40, 40).numpy(), bins=120, color=color, alpha=0.6, label=label)
    for v, style, what in ((448.0, "-", "e4m3 max 448"), (2.0 ** -6, "--", "smallest normal 2^-6"),
                           (2.0 ** -9, ":", "smallest subnormal 2^-9")):
        ax.axvline(math.log2(v), color="tab:red", linestyle=style, label=what)
    ax.set_yscale("log")
    return _save(fig, ax, path, title=title, xlabel="log2 |value|", ylabel="values", legend={"fontsize": 8})


_BLUE, _ORANGE, _GREEN = "#4c72b0", "#dd8452", "#55a868"


def plot_bench_result(result: dict[str, Any], path: Path) -> None:
    """A two-panel bar chart: throughput speed-up and peak memory per precision."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    ok = {n: r for n, r in result["results"].items() if r.get("status") == "ok"}
    names = list(ok)
    fig = Figure(figsize=(max(8.0, 1.6 * len(names) + 4), 4.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    speed = [ok[n]["speedup"] or 0.0 for n in names]
    bars = left.bar(names, speed, color=[_BLUE if ok[n]["runner"] == "mixprec" else _ORANGE for n in names])
    left.bar_label(bars, labels=[f"{s:.2f}x" for s in speed], padding=2)
    left.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    left.set_title(f"Throughput speed-up over {result['baseline'] or 'the baseline'}")
    left.set_xlabel("precision")
    left.set_ylabel("speed-up (x, higher is faster)")
    if any(ok[n]["runner"] != "mixprec" for n in names):
        left.legend(handles=[Patch(color=_BLUE, label="mixprec.Accelerator"), Patch(color=_ORANGE, label="compared")],
                    loc="upper left", fontsize="small")
    mem_names = [n for n in names if ok[n].get("peak_memory_bytes") is not None]
    mem = [ok[n]["peak_memory_bytes"] / 2**20 for n in mem_names]
    bars = right.bar(mem_names, mem, color=_GREEN)
    right.bar_label(bars, labels=[f"{m:.0f}" for m in mem], padding=2)
    if not mem_names:
        right.text(0.5, 0.5, "not measured", ha="center", va="center", transform=right.transAxes)
        right.set_yticks([])
        right.set_xticks([])
    right.set_title("Peak tensor memory of training")
    right.set_xlabel("precision")
    right.set_ylabel("peak memory (MiB)")
    for ax in (left, right):
        for label in ax.get_xticklabels():
            label.set(rotation=20, ha="right", rotation_mode="anchor")
        ax.margins(y=0.3 if ax is left else 0.15)
    machine = result["machine"]
    fig.suptitle(f"mixprec bench: {result['task']['name']} on {machine['device']} ({machine['device_name']})")
    fig.savefig(path, dpi=120)
