"""Peak memory of a block of code: CUDA's allocator counter, or the process's RSS on the CPU."""

from __future__ import annotations

import os
import threading
import time

import torch

__all__ = ["PeakMemory", "current_rss_bytes"]


def current_rss_bytes() -> int:
    """This process's resident set size now (Linux ``/proc``; elsewhere the peak so far)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # pragma: no cover - not Linux
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakMemory:
    """Measure the peak memory used while the ``with`` body runs.

    On CUDA: ``torch.cuda.max_memory_allocated`` after a reset (tensors only). On the CPU: the
    resident set size sampled every ``interval`` seconds by a thread, as the peak *above* what
    the process held when the block began (so runs one after the other compare fairly enough;
    the allocator may keep memory from an earlier run, which then does not count again).

    Example:
        >>> with PeakMemory("cpu") as peak:
        ...     x = torch.ones(1_000_000)
        >>> peak.bytes >= 0
        True
    """

    def __init__(self, device: str | torch.device = "cpu", interval: float = 0.02) -> None:
        self.device = torch.device(device)
        self.interval = interval
        self.bytes = 0
        self.kind = "cuda max_memory_allocated" if self.device.type == "cuda" else "peak RSS above the start"
        self._stop = threading.Event()

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        self._start = current_rss_bytes()
        self._peak = self._start
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, current_rss_bytes())
            time.sleep(self.interval)

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device)
            return
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, current_rss_bytes())
        self.bytes = self._peak - self._start
