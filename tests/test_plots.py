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
