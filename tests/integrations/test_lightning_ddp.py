"""MixprecPrecision under Lightning's DDP (its own launcher: ``python script.py`` starts the second rank)
and ModelParallelStrategy (FSDP2 with the plugin's sharding policy), 2 gloo processes on the CPU, one
launch for every case (``tests/scripts/lightning_ddp.py``): bf16-mixed gives Lightning's own weights;
an fp16 overflow on one rank's batch is skipped on both, with one scale; bf16-true's compensated
optimizer steps on both ranks alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from toys import SCRIPTS

pytestmark = pytest.mark.slow  # one launch of 2 gloo processes (about 20 s)
pytest.importorskip("lightning")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning_ddp")
    proc = subprocess.run([sys.executable, str(SCRIPTS / "lightning_ddp.py"), str(out)], capture_output=True,
                          text=True, timeout=240, cwd=out, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(2)]


def test_under_ddp_bf16_mixed_gives_lightnings_own_weights_on_both_ranks(ranks):
    for rank in ranks:
        assert rank["mixprec_bf16"]["weights"] == rank["lightning_bf16"]["weights"]
    assert ranks[0]["mixprec_bf16"]["weights"] == ranks[1]["mixprec_bf16"]["weights"]
    assert "(bf16-mixed, ddp)" in ranks[0]["mixprec_bf16"]["report"]


@pytest.mark.parametrize("case", ["mixprec_fp16", "fabric_fp16", "sharded_fp16"])
def test_an_fp16_overflow_on_one_ranks_batch_is_skipped_on_every_rank_with_one_scale(ranks, case):
    zero, one = ranks[0][case], ranks[1][case]
    assert zero["skipped"] == one["skipped"] >= 1 and zero["scale"] == one["scale"]
    assert zero["weights"] == one["weights"]
    assert all(w == w for p in zero["weights"] for w in p)  # no NaN


def test_under_ddp_bf16_true_steps_the_compensated_optimizer_alike_on_both_ranks(ranks):
    zero, one = ranks[0]["mixprec_bf16_true"], ranks[1]["mixprec_bf16_true"]
    assert zero["optimizer"] == one["optimizer"] == "mixprec.precision.optim.compensated"
    assert zero["weights"] == one["weights"] and "as the contract says" in zero["report"]


def test_under_model_parallel_fully_shard_takes_the_plugins_policy(ranks):
    zero, one = ranks[0]["sharded_bf16"], ranks[1]["sharded_bf16"]
    assert zero["weights"] == one["weights"] and zero["precision"] == "bf16-mixed"
    assert "(bf16-mixed, fsdp)" in zero["report"] and "params in forward bfloat16" in zero["report"]
    assert "master weights float32 (sharded)" in zero["report"]
