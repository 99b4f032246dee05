"""What a long command is doing while it runs: ``mixprec bench``'s, ``doctor``'s and ``train``'s
progress on stderr, from the command's first step.

A :class:`Progress` shows a phase ("round 1/2"), what runs in it now ("bf16-mixed"), the time
spent and an estimate of the time left, which the caller gives (it knows what its work costs:
the bench from each contestant's measured warm-up steps). It follows the Trainer's
:class:`~mixprec.trainer.ProgressCallback`: on a terminal (or in a notebook) a tqdm bar redrawn
in place, every second even while one long step runs; anywhere else (a log file, a pipe, a CI
console) plain lines without carriage returns: one when the phase changes, and one every
``log_interval`` seconds while a phase lasts, so that a log never goes silent for minutes.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

__all__ = ["Progress", "format_seconds"]


def format_seconds(seconds: float) -> str:
    """``75.2`` -> ``"1:15"``; ``3725`` -> ``"1:02:05"`` (tqdm's clock format)."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def _is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class Progress:
    """A command's progress line on stderr: the phase, what runs now, time spent and time left.

    Disabled (``enabled=False``, what the library functions get by default) it does nothing.
    Use it as a context manager, or call :meth:`close`.

    Args:
        label: what leads each line, e.g. ``"bench"``.
        enabled: show anything at all.
        stream: where to write (default: ``sys.stderr`` at creation).
        log_interval: off a terminal, the seconds between lines while one phase lasts.
        tick: on a terminal, the seconds between redraws while nothing else happens.
        delay: nothing shows before this many seconds (a command that fails at once prints its
            error alone); the first line comes at ``delay``, from the ticker if nothing else.

    Example:
        >>> with Progress("bench") as progress:  # doctest: +SKIP
        ...     progress.stage("round 1/2", "fp32", left_s=12.0)
        ...     progress.note("fp16-mixed left out: ...")
    """

    def __init__(self, label: str, *, enabled: bool = True, stream: Any = None, log_interval: float = 5.0,
                 tick: float = 1.0, delay: float = 0.5) -> None:
        self.label, self.enabled, self.log_interval, self.tick, self.delay = label, enabled, log_interval, tick, delay
        self.stream = stream if stream is not None else sys.stderr
        self.phase, self.detail = "", ""
        self._left: tuple[float, float] | None = None  # (seconds left, when that was said)
        self._start = time.perf_counter()
        self._last_line = -float("inf")
        self._lock = threading.Lock()
        self._bar: Any = None  # the tqdm bar, on a terminal or in a notebook
        self._terminal = False
        self._done = threading.Event()
        self._ticker: threading.Thread | None = None
        if not enabled:
            return
        self._terminal = _is_terminal(self.stream)
        if not self._terminal:
            from tqdm.autonotebook import tqdm as shown
            from tqdm.std import tqdm as text

            self._terminal = shown is not text  # a notebook: its widget, as the Trainer's bar
        # A daemon thread that only redraws (no torch work, so no second OpenMP team).
        self._ticker = threading.Thread(target=self._tick, name=f"mixprec-{label}-progress", daemon=True)
        self._ticker.start()

    # -- what the caller says ---------------------------------------------------------------
    def stage(self, phase: str, detail: str = "", left_s: float | None = None) -> None:
        """What runs now: ``phase`` (a new phase gets a line of its own in a log), ``detail`` within
        it, and the estimated seconds of work left, this stage's included (``None``: not known yet)."""
        if not self.enabled:
            return
        with self._lock:
            new_phase = phase != self.phase
            self.phase, self.detail = phase, detail
            if left_s is not None:
                self._left = (max(0.0, left_s), time.perf_counter())
            self._show(force=new_phase)

    def note(self, text: str) -> None:
        """A line of its own, above the bar on a terminal (a precision left out, and why)."""
        if not self.enabled:
            return
        with self._lock:
            line = f"{self.label}: {text}"
            if self._bar is not None:
                type(self._bar).write(line, file=self.stream)
            else:
                print(line, file=self.stream, flush=True)

    def close(self, summary: str | None = None) -> None:
        """Stop; ``summary`` (e.g. ``"done"``) is shown as the last line with the time spent."""
        if not self.enabled or self._done.is_set():
            return
        self._done.set()
        if self._ticker is not None:
            self._ticker.join()
        with self._lock:
            if self._bar is not None:
                self._bar.close()
            if summary is not None:
                print(f"{self.label}: {summary} in {format_seconds(self.elapsed())}", file=self.stream, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- how it shows -----------------------------------------------------------------------
    def elapsed(self) -> float:
        """Seconds since it was created."""
        return time.perf_counter() - self._start

    def left(self) -> float | None:
        """The estimate of the seconds left, counted down since it was given; ``None`` if unknown."""
        if self._left is None:
            return None
        said, when = self._left
        return max(0.0, said - (time.perf_counter() - when))

    def text(self) -> str:
        """The current line, without the bar: ``bench: round 1/2: fp32; 0:12 spent, about 0:16 left``."""
        what = ": ".join(p for p in (self.phase, self.detail) if p)
        return f"{self.label}: {what}; {self._times()}"

    def _times(self) -> str:
        left = self.left()
        return f"{format_seconds(self.elapsed())} spent" + ("" if left is None else f", about {format_seconds(left)} left")

    def _show(self, force: bool) -> None:
        """Redraw (terminal), or write a line if the phase changed or a log interval passed (log)."""
        now = time.perf_counter()
        if now - self._start < self.delay:
            return
        if self._terminal:
            if self._bar is None:  # made after the delay: tqdm draws an empty bar when made
                from tqdm.auto import tqdm

                self._bar = tqdm(total=1000, file=self.stream, dynamic_ncols=True, leave=False, desc=self.text(),
                                 bar_format="{desc}  {percentage:3.0f}%|{bar}|")
            left, spent = self.left(), self.elapsed()
            self._bar.n = 0 if left is None else int(1000 * spent / max(spent + left, 1e-9))
            self._bar.set_description_str(self.text(), refresh=False)
            self._bar.refresh()
        elif force or now - self._last_line >= self.log_interval:
            print(self.text(), file=self.stream, flush=True)
            self._last_line = now

    def _tick(self) -> None:
        every = max(0.05, self.tick if self._terminal else min(self.tick, self.log_interval))
        if self._done.wait(self.delay):
            return
        self._tick_once()
        while not self._done.wait(every):
            self._tick_once()

    def _tick_once(self) -> None:
        with self._lock:
            if self.phase and not self._done.is_set():
                self._show(force=False)
