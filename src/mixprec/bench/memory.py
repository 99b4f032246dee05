"""Peak memory per precision on the CPU: a fresh process per precision builds and trains it."""

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

from ..precision import PrecisionPerformanceWarning
from .config import BenchConfig, _build_job
from .runners import _mixprec_runner


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


def _memory_probe_main() -> None:
    """Run in a fresh process: the peak RSS growth of building and training one precision (CPU)."""
    import resource

    request = json.loads(sys.stdin.read())
    config = BenchConfig(**request["config"])
    warnings.simplefilter("ignore", PrecisionPerformanceWarning)
    job = _build_job(config)
    try:  # Linux: writing 5 resets the peak (VmHWM) to the current RSS
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        base, method = _proc_status_bytes("VmRSS"), "VmHWM"
    except OSError:
        base, method = None, "ru_maxrss"
    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is in bytes on macOS, KiB elsewhere
    if base is None:  # the peak so far is a floor: the growth is then a lower bound
        base, method = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit, "ru_maxrss, a lower bound"
    runner = _mixprec_runner(job, request["precision"], config, torch.device("cpu"))
    runner.run_chunk(config.memory_steps)
    peak = _proc_status_bytes("VmHWM") if method == "VmHWM" else None
    peak = peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit
    print(json.dumps({"peak_bytes": max(0, peak - base), "method": method}))


def _cpu_peak_memory(config: BenchConfig, precision: str) -> tuple[int | None, str]:
    """``(bytes, how)`` from :func:`_memory_probe_main` in a fresh process; ``(None, why)`` if it failed."""
    request = json.dumps({"config": dataclasses.asdict(config), "precision": precision})
    # The same imports as here (a user's factory module found through sys.path included).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    code = "from mixprec.bench import _memory_probe_main; _memory_probe_main()"
    try:
        proc = subprocess.run([sys.executable, "-c", code], input=request, capture_output=True, text=True,
                              env=env, timeout=1800)
    except subprocess.TimeoutExpired:
        return None, "the memory measurement timed out"
    try:
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        return int(out["peak_bytes"]), out["method"]
    except (ValueError, IndexError, KeyError):
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"the memory measurement failed: {last}"


def _measure_memory(rows: dict[str, dict[str, Any]], runners: dict[str, Any], config: BenchConfig,
                    device: torch.device) -> str:
    """Peak memory per precision on the CPU (CUDA's was taken in :func:`_start`); says how."""
    if not config.memory:
        return ""
    if device.type != "cpu":
        return "torch.cuda.max_memory_allocated growth over building the model and its warm-up steps"
    names = [n for n in runners if rows[n]["runner"] == "mixprec"]
    # Two at a time: each process's peak is its own, and the start-up (importing torch) overlaps.
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        measured = list(pool.map(lambda n: _cpu_peak_memory(config, n), names))
    how = set()
    for name, (peak, method) in zip(names, measured):
        rows[name]["peak_memory_bytes"] = peak
        how.add(method)
    return (f"peak RSS growth of a fresh process per precision that builds the model and trains "
            f"{config.memory_steps} steps (peak read from {', '.join(sorted(how))}); it includes torch's one-time "
            "set-up (kernels, thread pools: tens of MiB), so for small models compare the differences")
