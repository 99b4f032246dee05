"""The memory metrics of ``TrainingArguments(skip_memory_metrics=False)``, as transformers reports
them: for each stage (``init``, ``train``, ``eval``, ``test``) how much memory it left allocated
(``{stage}_mem_cpu_alloc_delta``) and how far above that it peaked (``{stage}_mem_cpu_peaked_delta``);
on CUDA the same for the device (``_mem_gpu_``), from torch's allocator counters.

The process's resident memory is sampled by a background thread every few milliseconds while a
stage runs (transformers samples in a busy loop: the same peak within a few ms, without taking a
core), with ``psutil`` where installed, else ``/proc/self/statm``.
"""

from __future__ import annotations

import gc
import os
import threading
from typing import Any

import torch

__all__ = ["MemoryTracker"]

_SAMPLE_SECONDS = 0.002


def _rss() -> int | None:
    """The process's resident memory in bytes, ``None`` where it cannot be read."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class MemoryTracker:
    """Measures the stages the Trainer runs, one at a time (an evaluation inside training is part
    of the training's measure, as in transformers); does nothing when not ``enabled``."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and _rss() is not None
        self.stage: str | None = None
        self.results: dict[str, dict[str, int]] = {}
        self._init_reported = False
        self._stop_sampling = threading.Event()
        self._sampler: threading.Thread | None = None
        self._peak = 0

    def _sample(self) -> None:
        while not self._stop_sampling.wait(_SAMPLE_SECONDS):
            self._peak = max(self._peak, _rss() or 0)

    def start(self, stage: str) -> None:
        """Start measuring ``stage`` (nothing if another stage is being measured)."""
        if not self.enabled or self.stage is not None:
            return
        self.stage = stage
        gc.collect()
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.empty_cache()
        self._begin = {"cpu": _rss() or 0, "gpu": torch.cuda.memory_allocated() if cuda else None}
        self._peak = self._begin["cpu"]
        self._stop_sampling.clear()
        self._sampler = threading.Thread(target=self._sample, name="mixprec-memory", daemon=True)
        self._sampler.start()

    def stop(self, stage: str, metrics: dict[str, Any] | None = None) -> None:
        """Stop measuring ``stage`` and add its figures (and, the first time, ``init``'s) to ``metrics``."""
        if not self.enabled or self.stage != stage:
            return
        self._stop_sampling.set()
        if self._sampler is not None:
            self._sampler.join()
        gc.collect()
        now = _rss() or 0
        peak = max(self._peak, now)
        result = {"cpu_alloc": now - self._begin["cpu"], "cpu_peaked": max(0, peak - now),
                  "cpu_begin": self._begin["cpu"]}
        if self._begin["gpu"] is not None:
            torch.cuda.empty_cache()
            gpu_now = torch.cuda.memory_allocated()
            result.update(gpu_alloc=gpu_now - self._begin["gpu"],
                          gpu_peaked=max(0, torch.cuda.max_memory_allocated() - gpu_now),
                          gpu_begin=self._begin["gpu"])
        self.results[stage], self.stage = result, None
        if metrics is None:
            return
        stages = [stage] if self._init_reported or "init" not in self.results else ["init", stage]
        self._init_reported = True
        for name in stages:
            for device in ("cpu", "gpu"):
                for kind in ("alloc", "peaked"):
                    if f"{device}_{kind}" in self.results[name]:
                        metrics[f"{name}_mem_{device}_{kind}_delta"] = self.results[name][f"{device}_{kind}"]
        if stages[0] == "init":  # where memory stood when the Trainer was made
            metrics["before_init_mem_cpu"] = self.results["init"]["cpu_begin"]
            if "gpu_begin" in self.results["init"]:
                metrics["before_init_mem_gpu"] = self.results["init"]["gpu_begin"]
