"""Two processes with gloo, started by torchrun from the test (loopback only, bounded in time)."""

from __future__ import annotations

import json
import subprocess

import pytest
import safetensors.torch
import torch

from toys import SCRIPTS, Regression, torchrun

pytestmark = pytest.mark.slow  # the module's fixture starts torchrun (2 gloo processes)

SCRIPT = SCRIPTS / "ddp_check.py"


@pytest.fixture(scope="module")
def ddp_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    cmd = torchrun(SCRIPT, str(out))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "result.json").read_text())


def test_torchrun_starts_two_gloo_processes(ddp_result):
    _, r = ddp_result
    assert r["num_processes"] == 2 and r["backend"] == "gloo"
    assert r["batches_per_rank"] == 8  # 16 batches of 4, one of every two per process


def test_both_ranks_hold_identical_params_equal_to_one_process_over_the_same_global_batches(ddp_result):
    out, r = ddp_result
    assert r["ranks_identical"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in torch.utils.data.DataLoader(Regression(n=64), batch_size=8):  # global batch = 2 x 4
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    ddp = safetensors.torch.load_file(str(out / "ddp.safetensors"))
    assert set(ddp) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ddp[name], rtol=1e-5, atol=1e-6)


def test_shuffled_shards_cover_every_sample_once(ddp_result):
    assert ddp_result[1]["shuffled_each_once"]


def test_gather_for_metrics_returns_every_eval_sample_once_with_an_uneven_last_shard(ddp_result):
    got = ddp_result[1]["gather_for_metrics"]
    assert sorted(got) == list(range(21)) and len(got) == 21


def test_reduce_sums_over_processes(ddp_result):
    assert ddp_result[1]["reduce_sum"] == 3.0


@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_fp16_and_bf16_comm_hooks_run(ddp_result, hook):
    assert ddp_result[1][f"hook_{hook}"]


def test_save_state_writes_one_folder_with_every_ranks_rng(ddp_result):
    files = ddp_result[1]["ckpt_files"]
    assert "random_states_0.bin" in files and "random_states_1.bin" in files and "manifest.json" in files
