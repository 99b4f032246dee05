"""What ``mixprec bench`` measures with: the step clock and device sync, the FLOP formulas torch
lacks, the device's matrix-product peak, and the profiler."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from typing import Any

import torch
from torch.utils import flop_counter


class Clock:
    """Step-end marks; on CUDA as events, so timing a step never waits for the device."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []
        _sync(device)

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":  # pragma: no cover
        torch.mps.synchronize()


def _sdpa_cpu(q, k, v, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(q, k, v)


def _sdpa_cpu_backward(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out, q, k, v)


# torch counts the CUDA attention kernels but not the CPU one; count it the same way.
CPU_SDPA_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward,
}


# -- the device's matrix-product peak -----------------------------------------------------------
def matmul_peak(device: torch.device, dtypes: list[torch.dtype], n: int) -> dict[str, float]:
    """Best-of-3 TFLOP/s of an ``n x n @ n x n`` product in each dtype."""
    inner = 1 if device.type == "cpu" else 10  # enough work between syncs on a fast device
    peaks = {}
    for dtype in dtypes:
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        torch.mm(a, b)
        best = math.inf
        for _ in range(3):
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(inner):
                torch.mm(a, b)
            _sync(device)
            best = min(best, (time.perf_counter() - t0) / inner)
        peaks[dtype_name(dtype)] = 2 * n**3 / best / 1e12
    return peaks


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- profile --------------------------------------------------------------------------------------
_MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product")


@contextlib.contextmanager
def _quiet_stderr() -> Any:
    """Silence file descriptor 2: the profiler's C++ side logs every start and stop there."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def profile_step(runner: Any, device: torch.device, rows: int = 15) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with _quiet_stderr(), profile(activities=activities) as prof:
        runner.step()
        _sync(device)
    events = prof.key_averages()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    total = sum(getattr(e, key) for e in events) or 1.0
    in_matmul = sum(getattr(e, key) for e in events if e.key.startswith(_MATMUL_OPS))
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:rows]
    return {"matmul_fraction": in_matmul / total, "self_time_ms": total / 1e3,
            "top": [{"op": e.key, "self_ms": getattr(e, key) / 1e3, "share": getattr(e, key) / total} for e in top],
            "table": events.table(sort_by=key, row_limit=rows)}
