"""Peak memory per mixprec row on the CPU: a fresh process per row builds and trains it, and
reports the peak of live tensor memory and the peak RSS growth."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import subprocess
import sys
import warnings
from typing import Any

import torch

from mixprec.apps.bench.config import BenchConfig, build_job
from mixprec.apps.bench.runners import mixprec_runner
from mixprec.precision import PrecisionPerformanceWarning


# -- memory -------------------------------------------------------------------------------------
def _proc_status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def tensor_peak_bytes(prof: Any) -> int | None:
    """The most bytes of tensor storage alive at once while ``prof`` (``profile_memory=True``) ran:
    the CPU's counterpart of ``torch.cuda.max_memory_allocated``, from its allocation events."""
    try:
        events = [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    except (AttributeError, RuntimeError):  # a torch whose profiler keeps them elsewhere
        return None
    live = peak = 0
    for _, nbytes in sorted(events):
        live += nbytes
        peak = max(peak, live)
    return peak


def memory_probe_main() -> None:
    """Run in a fresh process: the peak tensor memory (allocations seen by torch's profiler) and the
    peak RSS growth of building one precision's model and optimizer and training it (CPU)."""
    import resource

    from torch.profiler import ProfilerActivity, profile

    request = json.loads(sys.stdin.read())
    config = BenchConfig(**request["config"])
    warnings.simplefilter("ignore", PrecisionPerformanceWarning)
    job = build_job(config)
    try:  # Linux: writing 5 resets the peak (VmHWM) to the current RSS
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        base, method = _proc_status_bytes("VmRSS"), "VmHWM"
    except OSError:
        base, method = None, "ru_maxrss"
    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is in bytes on macOS, KiB elsewhere
    if base is None:  # the peak so far is a floor: the growth is then a lower bound
        base, method = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit, "ru_maxrss, a lower bound"
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        runner = mixprec_runner(job, request["precision"], config, torch.device("cpu"), request["compensation"])
        runner.run_chunk(config.memory_steps)
    peak = _proc_status_bytes("VmHWM") if method == "VmHWM" else None
    peak = peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit
    print(json.dumps({"tensor_bytes": tensor_peak_bytes(prof), "rss_bytes": max(0, peak - base),
                      "method": method}))


def cpu_peak_memory(config: BenchConfig, row: dict[str, Any]) -> tuple[int | None, int | None, str]:
    """``(tensor bytes, RSS bytes, how)`` of the row's variant (precision, bf16-true compensation)
    from :func:`memory_probe_main` in a fresh process; ``(None, None, why)`` if it failed."""
    request = json.dumps({"config": dataclasses.asdict(config), "precision": row["precision"],
                          "compensation": row.get("compensation")})
    # The same imports as here (a user's factory module found through sys.path included).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    code = "from mixprec.apps.bench import memory_probe_main; memory_probe_main()"
    try:
        proc = subprocess.run([sys.executable, "-c", code], input=request, capture_output=True, text=True,
                              env=env, timeout=1800)
    except subprocess.TimeoutExpired:
        return None, None, "the memory measurement timed out"
    try:
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        tensors = out["tensor_bytes"]
        return (None if tensors is None else int(tensors)), int(out["rss_bytes"]), out["method"]
    except (ValueError, IndexError, KeyError):
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return None, None, f"the memory measurement failed: {last}"


def measure_memory(rows: dict[str, dict[str, Any]], runners: dict[str, Any], config: BenchConfig,
                    device: torch.device) -> str:
    """Peak memory per mixprec row on the CPU (CUDA's is taken over each row's build and warm-up); says how."""
    if not config.memory:
        return ""
    if device.type != "cpu":
        return "torch.cuda.max_memory_allocated growth over building the model and its warm-up steps"
    names = [n for n in runners if rows[n]["runner"] == "mixprec"]
    # Two at a time: each process's peak is its own, and the start-up (importing torch) overlaps.
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        measured = list(pool.map(lambda n: cpu_peak_memory(config, rows[n]), names))
    how = set()
    for name, (tensors, rss, method) in zip(names, measured):
        rows[name]["peak_memory_bytes"] = tensors
        rows[name]["peak_rss_bytes"] = rss
        how.add(method)
    return ("peak MiB: the most tensor memory alive at once (torch.profiler's allocation events) in a fresh "
            f"process per row that builds the model and optimizer and trains {config.memory_steps} steps, "
            "as torch.cuda.max_memory_allocated counts on a GPU; RSS MiB: that process's peak resident-memory "
            f"growth over the same span (from {', '.join(sorted(how))}), which adds torch's one-time set-up "
            "(kernels, thread pools, the allocator's cache)")
