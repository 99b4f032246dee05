"""``mixprec.plots``: readable figures, drawn without touching the user's matplotlib state."""

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
    from mixprec.plots import plot_gradient_histogram, plot_layer_underflow, plot_loss_curves, plot_loss_scale
    from mixprec.diagnostics.plots import plot_gradient_histogram as old_path  # the old import path works
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
