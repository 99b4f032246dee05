"""The progress bar: redrawn in place on a terminal, a line every few seconds in a log."""

from __future__ import annotations

import io
import sys
import time
from types import SimpleNamespace

import torch

from mixprec.trainer import ProgressCallback, Trainer, TrainingArguments

from toys import Regression


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc(x), y)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _drive(callback: ProgressCallback, steps: int, pause: float = 0.0) -> None:
    """Run ``callback`` through ``steps`` optimizer steps as the Trainer would."""
    state = SimpleNamespace(is_world_process_zero=True, max_steps=steps, global_step=0, skipped_steps=0, loss_scale=1.0)
    callback.on_train_begin(None, state, None)
    for step in range(1, steps + 1):
        time.sleep(pause)
        state.global_step = step
        callback.on_step_end(None, state, None)
        callback.on_log(None, state, None, logs={"loss": 1.0 / step})
    callback.on_train_end(None, state, None)


def test_a_trainer_run_logged_to_a_file_prints_a_few_lines_not_a_frame_per_step(tmp_path, capsys):
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=1, max_steps=300, logging_steps=10,
                             learning_rate=1e-2, save_strategy="no", report_to="none", disable_tqdm=False)
    Trainer(model=Linear(), args=args, train_dataset=Regression(64)).train()
    err = capsys.readouterr().err  # captured: not a terminal
    lines = [line for line in err.splitlines() if line.startswith("train")]
    assert "\r" not in err
    assert 1 <= len(lines) <= 4, lines  # the first and the last, and one per 5 s between
    assert "300/300" in lines[-1]


def test_off_a_terminal_the_bar_prints_one_line_per_interval(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    _drive(ProgressCallback(log_interval=0.2), steps=60, pause=0.01)  # at least 0.6 s
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert 3 <= len(lines) < 30, lines
    assert all(line.startswith("train:") for line in lines) and "60/60" in lines[-1] and "loss=" in lines[-1]


def test_on_a_terminal_the_bar_is_redrawn_in_place(monkeypatch):
    tty = Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    _drive(ProgressCallback(), steps=5)
    assert tty.getvalue().count("\r") >= 2 and "5/5" in tty.getvalue()



def test_an_evaluation_during_training_shows_on_the_bar(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    callback = ProgressCallback(log_interval=60)
    state = SimpleNamespace(is_world_process_zero=True, max_steps=4, global_step=0, skipped_steps=0, loss_scale=1.0)
    callback.on_train_begin(None, state, None)
    state.global_step = 2
    callback.on_step_end(None, state, None)
    for _ in range(3):  # one line for the evaluation, not one per batch
        callback.on_prediction_step(None, state, None)
    callback.on_evaluate(None, state, None, metrics={"eval_loss": 1.0})
    callback.on_train_end(None, state, None)
    lines = log.getvalue().splitlines()
    assert len([line for line in lines if line.startswith("train (evaluating): ")]) == 1, lines
    assert lines[-1].startswith("train: "), lines
