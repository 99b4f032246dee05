"""``mixprec demo`` runs to the end and leaves a complete run folder."""

from __future__ import annotations

import json
import struct

import pytest

from mixprec.cli import main


def _png_size(path) -> tuple[int, int]:
    """A PNG's width and height in pixels, from its IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow
def test_demo_trains_both_runs_writes_the_run_folder_and_logs_a_few_progress_lines(tmp_path, capfd):
    out = tmp_path / "demo"
    rc = main(["demo", "--size", "tiny", "--steps", "12", "--fp32-steps", "8", "--train-bytes", "200000",
               "--eval-bytes", "8000", "--out", str(out)])
    assert rc == 0
    captured = capfd.readouterr()  # both runs' processes write to these file descriptors: not a terminal
    assert "fp32" in captured.out and "tokens/s" in captured.out and "run folder" in captured.out
    bar = [line for line in captured.err.splitlines() if line.startswith("train")]
    # Each run's first and last line, and one every 5 s between: fewer lines than the 8 + 12 steps.
    assert "\r" not in captured.err and 4 <= len(bar) < 8 + 12, bar
    summary = json.loads((out / "summary.json").read_text())
    assert summary["fp32"]["steps"] == 8 and summary["mixed"]["steps"] == 12
    assert summary["mixed"]["peak_memory_mb"] > 0 and summary["mixed"]["tokens_per_second"] > 0
    assert summary["fp32"]["training_seconds"] > 0 and summary["mixed"]["training_seconds"] > 0
    width, height = _png_size(out / "loss_curve.png")
    assert (width, height) == (14 * 110, round(4.5 * 110))  # two panels: loss against steps and against seconds
    assert (out / "sample.txt").read_text().startswith("def ")
    assert list(out.glob("checkpoint-12")) and (out / "metrics.jsonl").exists()
    assert (out / "fp32" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_demo_with_fp16_writes_the_loss_scale_plot(tmp_path, capsys):
    out = tmp_path / "demo16"
    rc = main(["demo", "--size", "tiny", "--precision", "fp16", "--steps", "8", "--fp32-steps", "4",
               "--train-bytes", "100000", "--eval-bytes", "4000", "--no-progress", "--out", str(out)])
    assert rc == 0
    assert (out / "loss_scale.png").exists()


def test_demo_rejects_a_bad_precision_on_stderr(capsys):
    assert main(["demo", "--precision", "fp12"]) == 2
    captured = capsys.readouterr()
    assert "mixprec demo: error:" in captured.err and "Valid names" in captured.err and not captured.out


def test_demo_rejects_too_few_steps_on_stderr(capsys):
    assert main(["demo", "--steps", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "mixprec demo: error: --steps must be at least 4\n" and not captured.out
