"""``mixprec demo`` shows the lesson as this run's measurements on every machine: where 16-bit is
emulated (a CPU held to AVX2, as a hosted CI runner's is), the step-for-step slowdown, the share of
gradient values an unscaled fp16 run lost to zero and what it cost, and the loss scale moving; it
runs to the end on a time budget or a step budget and leaves a complete run folder."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixprec.cli import main


def _png_size(path) -> tuple[int, int]:
    """A PNG's width and height in pixels, from its IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


SMALL = ["--size", "tiny", "--train-bytes", "200000", "--eval-bytes", "8000"]
#: torch's and oneDNN's kernels held to AVX2: no 16-bit format is native (a hosted CI runner's CPU).
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
SECONDS = 6


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """``.venv/bin/mixprec demo`` as README command 1 runs it (the console script, its own process),
    at a small size and for a few seconds, with 16-bit held to emulation: (run folder, stdout, stderr)."""
    out = tmp_path_factory.mktemp("demo") / "emulated"
    script = shutil.which("mixprec", path=str(Path(sys.executable).parent))
    command = [script] if script else [sys.executable, "-m", "mixprec.cli"]
    done = subprocess.run([*command, "demo", *SMALL, "--seconds", str(SECONDS), "--out", str(out)],
                          # (one thread: the suite runs beside other tests on the same cores, where a second
                          # thread only waits for them and fp32's many small kernels wait most)
                          env={**os.environ, **AVX2, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, done.stdout, done.stderr


@pytest.mark.slow
def test_where_16_bit_is_emulated_the_demo_states_the_measured_slowdown_step_for_step(emulated):
    out, printed, _ = emulated
    summary = json.loads((out / "summary.json").read_text())
    assert "auto would pick fp32 here" in printed and "fp16-mixed runs instead" in printed
    assert summary["raced"] is False
    fp32, fp16 = summary["speed"]
    assert (fp32["name"], fp16["name"]) == ("fp32", "fp16-mixed") and fp32["steps"] == fp16["steps"] >= 10
    ratio = fp16["median_step_seconds"] / fp32["median_step_seconds"]
    found = re.search(r"fp16-mixed ran ([\d.]+)x slower than fp32 here, step for step", printed)
    assert found, printed
    assert ratio > 1 and float(found[1]) == pytest.approx(ratio, abs=0.051)  # emulated fp16 is the slower one
    assert "where 16-bit is native, it is the fast path: on an NVIDIA H200" in printed


@pytest.mark.slow
def test_the_demo_reports_what_an_unscaled_fp16_run_lost_to_zero_and_what_it_cost(emulated):
    out, printed, _ = emulated
    lesson = json.loads((out / "summary.json").read_text())["lesson"]
    bare, scaled, fp32 = lesson["fp16-unscaled"], lesson["fp16-mixed"], lesson["fp32"]
    assert bare["steps"] == scaled["steps"] == fp32["steps"]
    found = re.search(r"fp16 without loss scaling: ([\d.]+)% of its gradient values were 0 \(fp32's: ([\d.]+)%.*"
                      r"its validation loss ended at ([\d.]+) against fp32's ([\d.]+)", printed)
    assert found, printed
    zero, zero_fp32, loss, loss_fp32 = map(float, found.groups())
    assert zero == pytest.approx(100 * bare["grads"]["zero"], abs=0.051)
    assert loss == pytest.approx(bare["final_eval_loss"], abs=5e-4)
    assert loss_fp32 == pytest.approx(fp32["final_eval_loss"], abs=5e-4)
    # What the lesson is about, measured: the values fp16 flushed, and the loss they cost; the scale kept them.
    assert zero > 10 * max(zero_fp32, 0.01) and loss > loss_fp32
    assert scaled["grads"]["flush_at_scale"] < scaled["grads"]["flush"]
    assert "fp16 with loss scaling:" in printed and "times the loss scale" in printed


@pytest.mark.slow
def test_the_loss_scale_moves_during_the_demo_and_the_conclusion_is_printed_last(emulated):
    out, printed, _ = emulated
    history = json.loads((out / "summary.json").read_text())["scale_history"]
    assert len({scale for _, scale, _ in history}) >= 2, history  # it changed at least once
    grew = re.search(r"doubled (\d+) times, each after 10 clean steps", printed)
    assert grew and int(grew[1]) >= 1, printed
    assert "overflow" in printed and "a real run keeps torch's 2000" in printed
    last = printed.strip().splitlines()[-3:]
    assert last[0].startswith("In this run fp16-mixed ran") and "slower than fp32" in last[0], last
    assert last[1].startswith("fp16 without loss scaling lost") and last[2].startswith("with the loss scale"), last


@pytest.mark.slow
def test_the_demo_writes_the_run_folder_and_a_few_progress_lines(emulated):
    out, printed, err = emulated
    assert "tokens/s" in printed and "run folder" in printed
    # ("fp16-mixed: 12 s, 8 steps, loss 3.1": each run's first and last step, and one every 10 s between)
    summary = json.loads((out / "summary.json").read_text())
    progress = [line for line in err.splitlines() if re.match(r"[\w-]+: \d+(/\d+)? s, \d+ steps", line)]
    steps = summary["lesson"]["fp16-mixed"]["steps"]
    assert "\r" not in err and 6 <= len(progress) < 3 * steps, progress
    assert list(dict.fromkeys(p.split(":")[0] for p in progress)) == ["fp16-mixed", "fp16-unscaled", "fp32"], progress
    for run in [*summary["speed"], *summary["lesson"].values()]:
        assert run["peak_memory_mb"] > 0 and run["tokens_per_second"] > 0 and run["training_seconds"] > 0, run
        assert (out / run["name"] / "metrics.jsonl").exists()
    assert _png_size(out / "demo.png") == (14 * 110, round((4.6 * 2 + 0.6) * 110))  # speed; losses; scale; histogram
    assert (out / "sample.txt").read_text().startswith("def ")
    assert summary["sampled"]["checkpoint"].endswith(f"fp16-mixed/checkpoint-{steps}")
    assert (out / "fp16-mixed" / f"checkpoint-{steps}").is_dir() and (out / "fp32" / f"checkpoint-{steps}").is_dir()


@pytest.mark.slow
def test_on_a_time_budget_the_timed_run_stops_at_its_seconds_and_the_others_take_its_steps(emulated):
    out, _, _ = emulated
    lesson = json.loads((out / "summary.json").read_text())["lesson"]
    scaled = lesson["fp16-mixed"]
    # Stopped by its clock once its seconds of training were spent (within a step, however slow, of them).
    assert scaled["budget"] == SECONDS and SECONDS <= scaled["training_seconds"] <= SECONDS + 2.0, scaled
    assert lesson["fp16-unscaled"]["budget"] == lesson["fp32"]["budget"] == scaled["steps"]


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
    assert main(["demo", *SMALL, "--precision", "fp32", "--steps", "120", "--batch-size", "32", "--lesson-steps", "0",
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
    safetensors.torch.load_model(model, f"{summary['sampled']['checkpoint']}/model_0.safetensors")
    checkpoint = next_byte_accuracy(model, torch.utils.data.Subset(task.eval_dataset, range(EVAL_BLOCKS)))
    assert summary["sampled"]["next_byte_accuracy"] == pytest.approx(checkpoint, abs=2e-3)
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
    assert main(["demo", "--lesson-steps", "2"]) == 2
    assert capsys.readouterr().err == "mixprec demo: error: --lesson-steps must be 0 (no lesson) or at least 4\n"
