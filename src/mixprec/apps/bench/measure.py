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
PEAK_PRODUCT_S = 0.05  # the least one peak-measuring product takes (below the cap): a fixed time, not a fixed size


def _product_time(device: torch.device, a: torch.Tensor, b: torch.Tensor, repeats: int) -> float:
    """Best-of-``repeats`` seconds of one ``a @ b`` (after one untimed product: kernel set-up)."""
    inner = 1 if device.type == "cpu" else 10  # enough work between syncs on a fast device
    torch.mm(a, b)
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(inner):
            torch.mm(a, b)
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def _operands(device: torch.device, dtype: torch.dtype, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.randn(n, n, device=device).to(dtype) for _ in range(2))


def matmul_side(device: torch.device, dtype: torch.dtype, max_n: int, min_s: float = PEAK_PRODUCT_S,
                start: int = 256) -> int:
    """The side of the square product that measures ``dtype``'s peak here: starting at ``start``
    and doubling, the first side whose one product takes at least ``min_s``, or ``max_n``.

    Long enough that a kernel's start-up and the threads' wake-ups do not count (on a loaded
    machine a 256-side product can take 30 ms whatever its dtype), and short where the device
    emulates ``dtype``: a generic kernel at a few GFLOP/s stops at a side of 512 (~0.1 s a
    product) instead of taking 20 s a product at 2048. One product then takes ``min_s`` to about
    8x that (a doubling's work).

    Example:
        >>> matmul_side(torch.device("cpu"), torch.float32, max_n=512) in (256, 512)
        True
    """
    n = min(start, max_n)
    while n < max_n and _product_time(device, *_operands(device, dtype, n), repeats=2) < min_s:
        n = min(2 * n, max_n)
    return n


def matmul_peak(device: torch.device, dtypes: list[torch.dtype], n: int | dict[str, int]) -> dict[str, float]:
    """Best-of-3 TFLOP/s of an ``n x n @ n x n`` product in each dtype; ``n`` one side for all, or
    a side per dtype name (:func:`matmul_side`'s, chosen once so that every round measures alike)."""
    peaks = {}
    for dtype in dtypes:
        side = n if isinstance(n, int) else n[dtype_name(dtype)]
        best = _product_time(device, *_operands(device, dtype, side), repeats=3)
        peaks[dtype_name(dtype)] = 2 * side**3 / best / 1e12
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
