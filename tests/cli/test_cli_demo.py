"""``mixprec demo`` runs to the end and leaves a complete run folder, on a time budget or a
step budget, and teaches loss scaling where no 16-bit format is native."""

from __future__ import annotations

import json
import re
import struct

import pytest
import torch

from mixprec.cli import main


def _png_size(path) -> tuple[int, int]:
    """A PNG's width and height in pixels, from its IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


SMALL = ["--size", "tiny", "--train-bytes", "200000", "--eval-bytes", "8000"]


@pytest.mark.slow
def test_demo_on_a_step_budget_trains_both_runs_writes_the_run_folder_and_a_few_progress_lines(tmp_path, capfd):
    out = tmp_path / "demo"
    assert main(["demo", *SMALL, "--steps", "12", "--fp32-steps", "8", "--out", str(out)]) == 0
    captured = capfd.readouterr()  # both runs' processes write to these file descriptors: not a terminal
    assert "fp32" in captured.out and "tokens/s" in captured.out and "run folder" in captured.out
    # ("<precision>: 12 s, 8 steps, loss 3.1"; the mixed run's precision is what this machine makes of auto)
    progress = [line for line in captured.err.splitlines() if re.match(r"[\w-]+: \d+ s, \d+ steps", line)]
    # Each run's first and last step, and one every 10 s between: fewer lines than the 8 + 12 steps.
    assert "\r" not in captured.err and 4 <= len(progress) < 8 + 12, progress
    assert progress[1].startswith("fp32:") and " 8 steps" in progress[1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["fp32"]["steps"] == 8 and summary["mixed"]["steps"] == 12
    assert summary["mixed"]["peak_memory_mb"] > 0 and summary["mixed"]["tokens_per_second"] > 0
    assert summary["fp32"]["training_seconds"] > 0 and summary["mixed"]["training_seconds"] > 0
    assert _png_size(out / "demo.png") == (13 * 110, round(4.5 * 110))  # loss against seconds, and throughput
    assert (out / "sample.txt").read_text().startswith("def ")
    assert list(out.glob("checkpoint-12")) and (out / "metrics.jsonl").exists()
    assert (out / "fp32" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_demo_on_a_time_budget_gives_each_run_the_same_seconds(tmp_path, capsys):
    out = tmp_path / "timed"
    assert main(["demo", *SMALL, "--seconds", "6", "--no-progress", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for run in summary.values():
        # Stopped by its clock once 3 s of training were spent (within a step, however slow, of them).
        assert 3.0 <= run["training_seconds"] <= 5.0, run
        assert run["steps"] >= 2 and list(out.glob("checkpoint-*"))
    assert f"checkpoint-{summary['mixed']['steps']}" in summary["mixed"]["checkpoint"]


@pytest.mark.slow
def test_where_no_16_bit_format_is_native_the_demo_runs_fp16_and_shows_the_loss_scalers_work(tmp_path, capsys,
                                                                                            monkeypatch):
    import mixprec.precision.names as names

    # auto's choice on a CPU without AVX512-BF16 or AMX (a hosted CI runner's), whatever this one has
    monkeypatch.setattr(names, "choose_auto", lambda cap: ("fp32", "no 16-bit format is native on cpu: (a test)"))
    out = tmp_path / "lesson"
    assert main(["demo", *SMALL, "--steps", "8", "--fp32-steps", "4", "--no-progress", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "auto would pick fp32 here" in printed and "fp16-mixed runs instead" in printed
    assert "loss scale: 65536 after the first step" in printed and "steps skipped for inf/NaN" in printed
    assert "would have flushed to zero in fp16" in printed and "val loss:" in printed
    assert json.loads((out / "summary.json").read_text())["mixed"]["precision"] == "fp16-mixed"
    assert _png_size(out / "demo.png") == (13 * 110, round(4.5 * 110))  # loss, and the loss scale over steps


@pytest.mark.slow
def test_the_demo_scores_and_samples_the_model_it_trained_which_beats_an_untrained_one_and_always_a_space(
        tmp_path, capsys):
    """What the demo writes of what its model learned is its trained model's: the next-byte accuracy it
    prints and records is the checkpoint's, above the untrained model's and above always guessing a
    space (120 steps of 32 blocks in fp32, quick on any CPU, learn more than the most common byte), and
    its sample is text (an untrained model's, sampled from near-uniform bytes, is mostly not)."""
    import safetensors.torch

    from mixprec.apps.demo import EVAL_BLOCKS, demo_task, next_byte_accuracy

    out = tmp_path / "learned"
    assert main(["demo", *SMALL, "--precision", "fp32", "--steps", "120", "--fp32-steps", "4", "--batch-size", "32",
                 "--no-progress", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    found = re.search(r"guessed right on the validation slice: ([\d.]+)% \(the untrained model: ([\d.]+)%; always "
                      r"guessing a space: ([\d.]+)%\)", printed)
    assert found, printed
    trained, untrained, space = map(float, found.groups())
    assert trained > untrained and trained >= space + 2, found[0]
    task = demo_task("tiny", 200_000, 8_000)
    model = task.build_model()
    summary = json.loads((out / "summary.json").read_text())
    safetensors.torch.load_model(model, f"{summary['mixed']['checkpoint']}/model_0.safetensors")
    checkpoint = next_byte_accuracy(model, torch.utils.data.Subset(task.eval_dataset, range(EVAL_BLOCKS)))
    assert summary["mixed"]["next_byte_accuracy"] == pytest.approx(checkpoint, abs=2e-3)
    assert trained == pytest.approx(100 * checkpoint, abs=0.15)
    sample = (out / "sample.txt").read_text(errors="replace")
    assert sample.startswith("def ") and len(sample) > 200
    assert sum(c.isascii() and (c.isprintable() or c in "\n\t") for c in sample) > 0.95 * len(sample), sample


def test_demo_rejects_a_bad_precision_on_stderr(capsys):
    assert main(["demo", "--precision", "fp12"]) == 2
    captured = capsys.readouterr()
    assert "mixprec demo: error:" in captured.err and "Valid names" in captured.err and not captured.out


def test_demo_rejects_too_few_steps_or_seconds_on_stderr(capsys):
    assert main(["demo", "--steps", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "mixprec demo: error: --steps must be at least 4\n" and not captured.out
    assert main(["demo", "--seconds", "1"]) == 2
    assert capsys.readouterr().err == "mixprec demo: error: --seconds must be at least 4\n"
