"""The bench's work as it goes: what runs now (warm-up, round k of n, the matmul peak, the eval
loss, the memory processes) and the time left, shown on a :class:`~mixprec.apps.progress.Progress`.

The time left is an estimate from what was measured so far in this run: each contestant's step
time (its fastest warm-up step's, then its last round's median), the time a contestant took to build and warm up,
the last peak measurement. Before anything is measured it is not known, and said so.
"""

from __future__ import annotations

import math
import statistics
import time

from mixprec.apps.bench.config import BenchConfig
from mixprec.apps.bench.runners import COUNTING_STEPS
from mixprec.apps.progress import Progress

__all__ = ["BenchPlan"]

# A guess until measured: a fresh process's start (importing torch and mixprec), before its steps.
_PROCESS_START_S = 4.0
_PEAK_GUESS_S = 1.0  # per dtype: the sizing and best of 3 at PEAK_PRODUCT_S a product at most


class BenchPlan:
    """What the bench does next and how long the rest will take, said on ``progress``.

    Args:
        progress: where to show it (a disabled one makes every call a no-op).
        config: the run's config (steps, rounds, warm-up, memory).
        contestants: every row's name, in the order they run.
        memory_rows: how many rows the CPU memory measurement starts a process for (0: none).
        dtypes: how many dtypes each peak measurement times.
    """

    def __init__(self, progress: Progress, config: BenchConfig, contestants: list[str], memory_rows: int,
                 dtypes: int) -> None:
        self.progress, self.config = progress, config
        self.contestants = list(contestants)
        self.memory_rows, self.dtypes = memory_rows, dtypes
        self.build_s: dict[str, float] = {}  # a contestant's build, counting steps and warm-up
        self.step_s: dict[str, float] = {}  # a contestant's seconds per timed step
        self.chunks_left = {(r, n) for r in range(config.rounds) for n in self.contestants}
        self.peaks_left = config.rounds
        self.peak_s: float | None = None
        self.eval_left = len(self.contestants)
        self._began = time.perf_counter()

    # -- the phases ---------------------------------------------------------------------------
    def building(self, name: str) -> None:
        """Contestant ``name`` is built and warmed up now."""
        i = self.contestants.index(name) + 1
        self._began = time.perf_counter()
        self._say("warm-up", f"{name} ({i} of {len(self.contestants)}: build, {COUNTING_STEPS + self.config.warmup} "
                  "untimed steps)")

    def built(self, name: str, times: list[float] | None = None) -> None:
        """``name`` is built (``times``: its warm-up's step times, where it ran any)."""
        took = time.perf_counter() - self._began
        self.build_s[name] = took
        if times:  # none without a warm-up, or for the Hugging Face Trainer (it warms up in its run)
            # The fastest: a warm-up's first steps pay one-time costs, which the rounds do not.
            self.step_s[name] = min(times)

    def skipped(self, name: str) -> None:
        """``name`` will not run (it failed to build, or failed in a round)."""
        self.chunks_left = {(r, n) for r, n in self.chunks_left if n != name}
        if name in self.contestants:
            self.eval_left = max(0, self.eval_left - 1)
        self.build_s.setdefault(name, 0.0)

    def chunk(self, r: int, name: str) -> None:
        """``name`` trains its steps of round ``r`` (0-based) now."""
        steps = self.config.steps
        self._say(f"round {r + 1}/{self.config.rounds}", f"{name}, {steps} step{'s' if steps != 1 else ''}")

    def chunk_done(self, r: int, name: str, times: list[float]) -> None:
        """``name``'s round ``r`` is done; ``times`` its step times so far."""
        self.chunks_left.discard((r, name))
        if times:
            self.step_s[name] = statistics.median(times[-self.config.steps:])

    def peak(self, r: int) -> None:
        """The matrix-product peak after round ``r`` is measured now."""
        sized = "" if self.peak_s is not None else ", its size grown to the device"
        self._say(f"round {r + 1}/{self.config.rounds}", f"matmul peak ({self.dtypes} dtype"
                  f"{'s' if self.dtypes > 1 else ''}{sized})")
        self._began = time.perf_counter()

    def peak_done(self) -> None:
        self.peak_s = time.perf_counter() - self._began
        self.peaks_left = max(0, self.peaks_left - 1)

    def evaluating(self, name: str) -> None:
        """``name``'s eval loss is measured now."""
        self._say("eval loss", name)

    def evaluated(self) -> None:
        self.eval_left = max(0, self.eval_left - 1)

    def phase(self, phase: str, detail: str = "") -> None:
        """Any other phase (profiling, the memory processes)."""
        self._say(phase, detail)

    def memory(self, rows: int) -> None:
        """The CPU memory measurement's ``rows`` processes start now (0: there is none)."""
        self.memory_rows = rows
        if rows:
            self._say("peak memory", f"{rows} fresh process{'es' if rows != 1 else ''}, 2 at a time")

    # -- the estimate -------------------------------------------------------------------------
    def left_s(self) -> float | None:
        """The estimated seconds of work left, or ``None`` before any step was measured."""
        if not self.step_s:
            return None
        typical = statistics.median(self.step_s.values())
        built = [t for n, t in self.build_s.items() if t > 0]
        unbuilt = [n for n in self.contestants if n not in self.build_s]
        left = len(unbuilt) * (statistics.median(built) if built else typical * (COUNTING_STEPS + self.config.warmup))
        left += sum(self.config.steps * self.step_s.get(n, typical) for _, n in self.chunks_left)
        left += self.peaks_left * (self.peak_s if self.peak_s is not None else _PEAK_GUESS_S * self.dtypes)
        left += self.eval_left * self.config.eval_batches * typical / 3  # a forward is about a third of a step
        if self.memory_rows:
            left += math.ceil(self.memory_rows / 2) * (_PROCESS_START_S + 2 * self.config.memory_steps * typical)
        return left

    def _say(self, phase: str, detail: str) -> None:
        self.progress.stage(phase, detail, left_s=self.left_s())
