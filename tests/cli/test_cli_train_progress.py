"""``mixprec train`` says what its set-up does until the Trainer's bar starts, and that it evaluates."""

from __future__ import annotations

import functools

import pytest

import mixprec.cli.train as train_cli
from mixprec.apps.progress import Progress
from mixprec.cli import main

CONFIG = """[task]
name = "digits"
[training]
max_steps = 4
per_device_train_batch_size = 16
eval_strategy = "steps"
eval_steps = 2
save_strategy = "no"
report_to = "none"
logging_steps = 2
"""


@pytest.fixture
def config(tmp_path, monkeypatch):
    # A set-up faster than the half-second delay shows nothing; here every stage shows.
    monkeypatch.setattr(train_cli, "Progress", functools.partial(Progress, delay=0))
    path = tmp_path / "digits.toml"
    path.write_text(CONFIG)
    return path


def test_the_set_up_shows_from_the_start_then_the_trainers_bar_which_says_when_it_evaluates(tmp_path, config, capsys):
    rc = main(["train", str(config), "--output-dir", str(tmp_path / "run"), "--disable-tqdm", "false"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    lines = [line for line in captured.err.splitlines() if line.startswith("train")]
    bar = next(i for i, line in enumerate(lines) if line.startswith("train: ") and "/4 [" in line)
    assert list(dict.fromkeys(line.split(";")[0] for line in lines[:bar])) == [  # a long stage repeats its line
        "train: loading the task: digits", "train: building the Trainer: digits/mlp's model",
        "train: starting the run"], lines
    assert any(line.startswith("train (evaluating): ") for line in lines[bar:]), lines
    assert "\r" not in captured.err


def test_with_disable_tqdm_the_set_up_shows_nothing_either(tmp_path, config, capsys):
    rc = main(["train", str(config), "--output-dir", str(tmp_path / "run"), "--disable-tqdm", "true"])
    assert rc == 0 and "loading the task" not in capsys.readouterr().err
