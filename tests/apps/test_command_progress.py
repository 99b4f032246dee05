"""A command's progress line: redrawn in place on a terminal, plain lines in a log, nothing when disabled."""

from __future__ import annotations

import io
import threading
import time

from mixprec.apps.progress import Progress, format_seconds


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_in_a_log_each_phase_gets_a_line_with_the_time_spent_and_left_and_no_carriage_returns():
    log = io.StringIO()
    progress = Progress("bench", stream=log, delay=0, log_interval=60)
    progress.stage("warm-up", "fp32 (1 of 2)")
    progress.stage("warm-up", "bf16-mixed (2 of 2)")  # the same phase: no new line within the interval
    progress.note("fp16-mixed left out: no fp16 kernel here")
    progress.stage("round 1/2", "fp32, 5 steps", left_s=75)
    progress.close("measured")
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert lines[0] == "bench: warm-up: fp32 (1 of 2); 0:00 spent"
    assert lines[1] == "bench: fp16-mixed left out: no fp16 kernel here"
    assert lines[2] == "bench: round 1/2: fp32, 5 steps; 0:00 spent, about 1:15 left"
    assert lines[3].startswith("bench: measured in 0:0") and len(lines) == 4


def test_in_a_log_a_long_phase_repeats_its_line_every_interval():
    log = io.StringIO()
    with Progress("doctor", stream=log, delay=0, log_interval=0.2, tick=0.05) as progress:
        progress.stage("probe 1/3", "fp32, step 1/20", left_s=10)
        time.sleep(0.7)
    lines = log.getvalue().splitlines()
    assert 3 <= len(lines) <= 6, lines
    assert all(line.startswith("doctor: probe 1/3: fp32, step 1/20; ") for line in lines)


def test_on_a_terminal_the_line_is_redrawn_every_tick_and_cleared_at_the_end():
    tty = Terminal()
    progress = Progress("bench", stream=tty, delay=0, tick=0.05)
    progress.stage("round 2/2", "torch-loop fp32, 5 steps", left_s=3)
    time.sleep(0.3)
    progress.close("measured")
    out = tty.getvalue()
    assert out.count("\rbench: round 2/2: torch-loop fp32, 5 steps; 0:00 spent, about 0:0") >= 3  # the ticker's redraws
    assert "%|" in out and out.rstrip("\n").rsplit("\r", 1)[-1].startswith("bench: measured in 0:00")


def test_nothing_shows_before_the_delay_so_an_error_at_once_comes_alone():
    log = io.StringIO()
    progress = Progress("bench", stream=log, delay=30)
    progress.stage("loading the task", "pycode")
    progress.close()
    assert log.getvalue() == ""


def test_disabled_it_does_nothing_and_starts_no_thread():
    log = io.StringIO()
    progress = Progress("quiet", stream=log, enabled=False, delay=0)
    progress.stage("round 1/2", "fp32", left_s=1)
    progress.note("x")
    assert not [t for t in threading.enumerate() if t.name == "mixprec-quiet-progress"]
    progress.close("done")
    assert log.getvalue() == ""


def test_seconds_read_as_a_clock():
    assert format_seconds(75.2) == "1:15" and format_seconds(3725) == "1:02:05" and format_seconds(-1) == "0:00"
