"""``mixprec.apps.plots``: readable figures, drawn without touching the user's matplotlib state."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("matplotlib")

DRAW_ALL = textwrap.dedent("""
    import sys
    from pathlib import Path
    import matplotlib
    matplotlib.use("svg")  # the user's own choice of backend
    from mixprec.apps.plots import plot_gradient_histogram, plot_layer_underflow, plot_loss_curves, plot_loss_scale
    from mixprec.apps.plots import plot_gradient_histogram as old_path  # the old import path works
    out = Path(sys.argv[1])
    entry = {"numel": 10, "unscaled": {"log2_hist": [1, 4, 4, 1], "zero": 0.1},
             "at_scale": {"log2_hist": [0, 5, 4, 1], "zero": 0.0}}
    probe = {"hist_edges": [-30, -20, -10], "stats": [{"modules": {"fc": entry}}]}
    layers = [{"module": "fc", "fp16_flush": 0.2, "fp16_flush_at_scale": 0.01, "bf16_flush": 0.0}]
    paths = [plot_loss_curves({"fp32": [(1, 2.0), (2, 1.5)]}, out / "loss.png", evaluation={"fp32": [(2, 1.6)]}),
             plot_loss_scale([(1, 65536.0, False), (2, 32768.0, True)], out / "scale.png"),
             old_path(probe, out / "hist.png", scale=65536.0, title="gradients"),
             plot_layer_underflow(layers, out / "layers.png", scale=65536.0, title="layers")]
    assert all(p.read_bytes().startswith(b"\\x89PNG") for p in paths), paths
    print(matplotlib.get_backend(), "matplotlib.pyplot" in sys.modules)
""")


@pytest.mark.slow
def test_plots_are_written_as_png_and_leave_the_backend_and_pyplot_alone(tmp_path):
    done = subprocess.run([sys.executable, "-c", DRAW_ALL, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["svg", "False"]  # no matplotlib.use("Agg"), no pyplot


def test_loss_curves_given_seconds_draw_the_same_runs_against_time_in_a_second_panel(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from mixprec.apps.plots import plot_loss_curves

    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, path: drawn.append(fig))
    train = {"fp32": [(1, 2.0), (2, 1.5)], "bf16-mixed": [(1, 2.0), (2, 1.4), (3, 1.3)]}
    seconds = {"fp32": {1: 1.0, 2: 2.0}, "bf16-mixed": {1: 0.5, 2: 1.0, 3: 1.5}}
    plot_loss_curves(train, tmp_path / "steps.png", evaluation={"fp32": [(2, 1.6)]})
    plot_loss_curves(train, tmp_path / "both.png", evaluation={"fp32": [(2, 1.6)]}, seconds=seconds)
    steps_only, both = drawn
    assert len(steps_only.axes) == 1 and len(both.axes) == 2
    by_step, by_time = both.axes
    assert by_step.get_xlabel() == "optimizer step" and by_time.get_xlabel().startswith("seconds of training")
    lines = {line.get_label(): list(line.get_xdata()) for line in by_time.get_lines()}
    assert lines == {"fp32 (train)": [1.0, 2.0], "bf16-mixed (train)": [0.5, 1.0, 1.5], "fp32 (validation)": [2.0]}


def _demo_runs():
    """Results shaped as ``mixprec.apps.demo.train_run``'s, for the demo's figure."""
    def run(name, steps=40, seconds=4.0, loss=2.5, scale_history=None, grads=None):
        train = [(s, 5.0 - 2.5 * s / steps + (0.5 if "unscaled" in name else 0.0)) for s in range(1, steps + 1, 4)]
        return {"name": name, "steps": steps, "training_seconds": seconds, "tokens_per_second": 512 * steps / seconds,
                "train": train, "eval": [(steps, loss)], "seconds": {s: seconds * s / steps for s in range(1, steps + 1)},
                "step_tokens": 2**19, "scale_history": scale_history, "growth_interval": 10, "grads": grads}

    entry = {"numel": 100, "unscaled": {"log2_hist": [0] * 10 + [20, 50, 30] + [0] * 49, "zero": 0.0},
             "at_scale": {"log2_hist": [0] * 50 + [20, 50, 30] + [0] * 9, "zero": 0.0}}
    probe = {"stats": [{"modules": {"h.0": entry}}], "hist_edges": list(range(-40, 21)), "step": 40, "scale": 2.0**29}
    history = [(s, 2.0 ** (16 + s // 10), s == 35) for s in range(1, 41)]
    lesson = {"fp32": run("fp32", seconds=0.5, grads={"zero": 0.0005}),
              "fp16-mixed": run("fp16-mixed", scale_history=history, grads={"zero": 0.0006, "histogram": probe}),
              "fp16-unscaled": run("fp16-unscaled", loss=3.4, grads={"zero": 0.6})}
    return lesson


@pytest.mark.parametrize("raced", [True, False])
def test_the_demo_figure_keeps_every_title_label_and_legend_inside_it_and_apart(tmp_path, monkeypatch, raced):
    """Nothing of the demo's four panels is cut at the figure's edge (as "...before backwa" was), and
    no panel's title runs into another's."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from mixprec.apps.plots import plot_demo

    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, path: drawn.append(fig))
    lesson = _demo_runs()
    speed = [lesson["fp32"], lesson["fp16-mixed"]]
    plot_demo(speed, lesson, tmp_path / "demo.png", raced=raced, title="mixprec demo: fp32 against fp16-mixed",
              native_figure="on an NVIDIA H200, fp16-mixed trained pycode/small 4.4x as fast as fp32 (RESULTS.md)")
    (fig,) = drawn
    canvas = FigureCanvasAgg(fig)
    canvas.draw()  # as savefig drew it: every text where it lands
    renderer, box = canvas.get_renderer(), fig.bbox
    assert len(fig.axes) == 4
    # Each panel as drawn (its title, axis labels, tick labels, legend and notes), and the figure's title.
    for extent in [ax.get_tightbbox(renderer) for ax in fig.axes]:
        assert box.x0 - 1 <= extent.x0 and extent.x1 <= box.x1 + 1 and box.y0 - 1 <= extent.y0 and \
            extent.y1 <= box.y1 + 1, (extent, box)
    whole, inches = fig.get_tightbbox(renderer), fig.bbox_inches  # (in inches)
    assert inches.x0 - 0.01 <= whole.x0 and whole.x1 <= inches.x1 + 0.01 and whole.y1 <= inches.y1 + 0.01, whole
    titles = [ax.title.get_window_extent(renderer) for ax in fig.axes]
    for i, a in enumerate(titles):
        assert not any(a.overlaps(b) for b in titles[i + 1:]), [ax.get_title() for ax in fig.axes]
    assert all(ax.get_title() and ax.get_xlabel() and ax.get_ylabel() for ax in fig.axes)
