"""benchmarks/llama_1b.py (issue 40, part 3), run as the GPU session runs it, at its tiny size on the CPU."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "llama_1b.py"
BF16_AUTOCAST = ("torch:bf16", "mixprec:bf16-mixed", "accelerate:bf16")
# fp8 on the CPU: mixprec's fp8 runs torchao's float8 training emulated there (the same casts, slower).
JOBS = (*BF16_AUTOCAST, "mixprec:bf16-true") + (("mixprec:fp8",) if importlib.util.find_spec("torchao") else ())


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None,
                    reason="the benchmark builds transformers' Llama and runs Accelerate")
def test_llama_benchmark_runs_every_job_on_the_same_model_and_data_and_writes_its_table(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--size", "tiny", "--steps", "2",
                           "--warmup", "1", "--jobs", ",".join(JOBS), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "llama_1b.json").read_text())
    rows = {r["job"]: r for r in result["jobs"]}
    assert list(rows) == list(JOBS)
    for job, r in rows.items():
        assert r["status"] == "ok", (job, r.get("error"))
        assert len(r["losses"]) == 3 and all(math.isfinite(v) for v in r["losses"]), job
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0, job
        assert r["mfu"] is None and r["peak_mem_gib"] is None, job  # no peak, no CUDA memory on the CPU
    # Same seed, same data, the same bf16 autocast: the three agree after the same steps.
    first = rows[BF16_AUTOCAST[0]]["loss"]
    for job in BF16_AUTOCAST[1:]:
        assert rows[job]["loss"] == pytest.approx(first, rel=1e-4), job
    # And the other precisions train the same model on the same data: close, not equal.
    for job in set(JOBS) - set(BF16_AUTOCAST):
        assert rows[job]["loss"] == pytest.approx(first, rel=2e-2), job
    # The loss falls (the synthetic tokens have something to learn) and each job starts from the same one.
    assert rows["torch:bf16"]["losses"][-1] < rows["torch:bf16"]["losses"][0]
    assert all(r["losses"][0] == pytest.approx(rows["torch:bf16"]["losses"][0], rel=1e-3) for r in rows.values())
    assert result["params"] > result["params_counted_for_flops"] > 0
    table = (tmp_path / "llama_1b.md").read_text()
    assert all(f"| {job} |" in table for job in JOBS) and "| job | tokens/s |" in proc.stdout
