"""``mixprec demo`` runs to the end and leaves a complete run folder."""

from __future__ import annotations

import json

import pytest

from mixprec.cli import main


@pytest.mark.slow
def test_demo_trains_both_runs_and_writes_the_run_folder(tmp_path, capsys):
    out = tmp_path / "demo"
    rc = main(["demo", "--size", "tiny", "--steps", "12", "--fp32-steps", "8", "--train-bytes", "200000",
               "--eval-bytes", "8000", "--no-progress", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "fp32" in text and "tokens/s" in text and "run folder" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["fp32"]["steps"] == 8 and summary["mixed"]["steps"] == 12
    assert summary["mixed"]["peak_memory_mb"] > 0 and summary["mixed"]["tokens_per_second"] > 0
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
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


def test_demo_rejects_a_bad_precision(capsys):
    assert main(["demo", "--precision", "fp12"]) == 2
    assert "Valid names" in capsys.readouterr().out
