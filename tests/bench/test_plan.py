"""``mixprec bench`` says what it does from its first second: the precisions it leaves out and why,
the warm-up, round k of n and the time left, before its first result; on the emulated path too."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import pytest

from mixprec.apps.bench import BenchConfig, run_bench
from mixprec.apps.progress import Progress

# torch's own switch (what mixprec.hardware reads: an AVX2-only CPU's kernels) and oneDNN's (its
# bf16 kernels need AVX512): together, what a hosted CI runner or most laptops run.
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
SMALL = ["--size", "tiny", "--steps", "2", "--rounds", "2", "--warmup", "1", "--batch-size", "4", "--no-memory",
         "--device", "cpu"]


@pytest.mark.slow
def test_the_default_on_the_emulated_path_leaves_out_each_format_without_a_kernel_and_shows_progress_first(tmp_path):
    env = {**os.environ, **AVX2, "PYTHONUNBUFFERED": "1"}  # stdout and stderr in the order written
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "mixprec.cli", "bench", *SMALL, "--out", str(tmp_path)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    took = time.perf_counter() - t0
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    lines = out.splitlines()
    table = next(i for i, line in enumerate(lines) if line.startswith("precision "))
    progress = [line for line in lines[:table] if line.startswith("bench: ")]
    # Both 16-bit formats are left out alike, each saying why, before anything runs.
    for p in ("fp16-mixed", "bf16-mixed", "bf16-true"):
        said = next(i for i, line in enumerate(progress) if line.startswith(f"bench: {p} left out: "))
        assert "generic kernel" in progress[said] and said < 3
    assert any(line.startswith("bench: warm-up: fp32 (1 of 1") for line in progress)
    for r in (1, 2):
        assert any(line.startswith(f"bench: round {r}/2: ") for line in progress), progress
    assert any(" left" in line and " spent" in line for line in progress)
    assert "\r" not in out  # not a terminal: lines, no redraws
    rows = [line.split()[0] for line in lines[table + 1:] if line and not line.startswith(("note:", "wrote"))]
    assert rows == ["fp32"]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["config"]["precisions"] == ["fp32"] and result["matmul_size"]["float32"] >= 256
    assert took < 90, f"the small bench took {took:.0f} s"  # ~10 s on 2 idle cores; a user would wait for it


def test_run_bench_tells_its_progress_what_runs_in_order():
    log = io.StringIO()
    progress = Progress("bench", stream=log, delay=0, log_interval=600)
    run_bench(BenchConfig(size="tiny", precisions=("fp32",), compare=("torch",), steps=1, rounds=2, warmup=1,
                          batch_size=4, matmul_size=64, device="cpu", memory=False), progress)
    progress.close()
    phases = [line.split(";")[0] for line in log.getvalue().splitlines()]
    assert phases == ["bench: loading the task: pycode", "bench: warm-up: fp32 (1 of 2: build, 3 untimed steps)",
                      "bench: round 1/2: fp32, 1 step", "bench: round 2/2: fp32, 1 step",
                      "bench: eval loss: fp32"], phases
    assert "left" in log.getvalue().splitlines()[2]  # after the warm-ups the time left is known
