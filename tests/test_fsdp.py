"""FSDP2 through Accelerator(fsdp_plugin=...): two gloo processes started by torchrun (bounded in time)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from mixprec import Accelerator, FullyShardedDataParallelPlugin

from toys import SCRIPTS, Regression, free_port, torchrun

SCRIPT = SCRIPTS / "fsdp_check.py"
# The tests here start torchrun (2 gloo processes, ~10-30 s each), but for the plugin-field checks: all slow.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::mixprec.PrecisionPerformanceWarning")]


def _script_module():
    spec = importlib.util.spec_from_file_location("fsdp_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def launch(out: Path, *args: str, ranks: int = 2) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    if ranks == 1:
        cmd = [sys.executable, str(SCRIPT), str(out), *args]
    else:
        cmd = torchrun(SCRIPT, str(out), *args, nproc=ranks)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


def weights(out: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(out / "final.safetensors"))


def one_process(precision: str, steps: int = 8, accelerator: Accelerator | None = None) -> dict[str, torch.Tensor]:
    """The same model, data order and global batches, trained in one process without sharding
    (by ``accelerator`` if given)."""
    Net = _script_module().Net
    acc = accelerator or Accelerator(mixed_precision=precision, cpu=True)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, dl = acc.prepare(model, opt, torch.utils.data.DataLoader(Regression(n=64), batch_size=8))
    for i, (x, y) in enumerate(dl):
        acc.backward(torch.nn.functional.mse_loss(model(x).float(), y))
        acc.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        opt.zero_grad()
        if i + 1 == steps:
            break
    return {k: v.detach().float() for k, v in acc.unwrap_model(model).state_dict().items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    # The fp32 run's checkpoint is saved asynchronously: the resume tests below read it.
    r = {"fp32": launch(root / "fp32", "--precision", "fp32", "--save-at", "4", "--async-save"),
         "bf16": launch(root / "bf16", "--precision", "bf16", "--activation-checkpointing")}
    return root, r


def test_each_rank_holds_half_of_the_parameters_and_optimizer_state(runs):
    _, r = runs
    for name, res in r.items():
        print(f"{name}: rank 0 holds {res['param_fraction']:.3f} of the parameters and "
              f"{res['state_fraction']:.3f} of the optimizer state (2 ranks)")
        assert res["num_processes"] == 2 and res["sharded"] and res["ranks_identical"]
        assert 0.45 < res["param_fraction"] < 0.55 and 0.45 < res["state_fraction"] < 0.55
    assert r["bf16"]["checkpointed_blocks"] == 3 and r["fp32"]["checkpointed_blocks"] == 0


@pytest.mark.parametrize("precision,tol", [("fp32", 1e-5), ("bf16", 2e-2)])
def test_sharded_training_equals_one_process_over_the_same_global_batches(runs, precision, tol):
    """fp32 to fp32 tolerance; bf16-mixed to bf16's (each rank's half-batch gradient is rounded
    to bf16 before the fp32 reduction, one process rounds the whole batch's once)."""
    root, _ = runs
    ref, got = one_process(precision), weights(root / precision)
    assert set(ref) == set(got)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=tol, atol=tol)


def test_fp8_shards_trains_and_resumes_bit_for_bit(tmp_path):
    """fp8 (torchao's float8 Linear layers, emulated here) under FSDP2: the blocks' six Linear
    layers run in float8 with their weights all-gathered in float8 (tensorwise), the contract
    holds, and a sharded checkpoint resumes bit for bit."""
    pytest.importorskip("torchao.float8")
    full = launch(tmp_path / "full", "--precision", "fp8", "--save-at", "4")
    launch(tmp_path / "resumed", "--precision", "fp8", "--resume", str(tmp_path / "full" / "ckpt"))
    details = full["precision_details"]
    assert full["precision_ok"] and full["sharded"] and full["ranks_identical"]
    assert details["float8_in_forward"] == ["float8_e4m3fn"] and details["float8_all_gather"]
    assert sorted(k for k, v in details["layers"].items() if v.startswith("float8")) == [
        f"layers.{i}.{fc}" for i in range(3) for fc in ("fc1", "fc2")]
    assert full["losses"][-1] < full["losses"][0]
    a, b = weights(tmp_path / "full"), weights(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_an_inf_on_one_rank_skips_the_step_on_both(tmp_path):
    res = launch(tmp_path, "--precision", "fp16", "--inf-rank", "1", "--inf-step", "2")
    assert res["skipped"][2] is True and sum(res["skipped"]) == 1  # rank 0 saw no inf itself
    assert res["scales"][2] == res["scales"][1] / 2 and res["ranks_identical"]


def test_a_checkpoint_of_two_ranks_resumes_on_two_bit_for_bit_and_on_one_to_fp32_tolerance(runs, tmp_path):
    """The checkpoint was written with async_save while training went on."""
    root, _ = runs
    full = weights(root / "fp32")
    launch(tmp_path / "two", "--precision", "fp32", "--resume", str(root / "fp32" / "ckpt"))
    launch(tmp_path / "one", "--precision", "fp32", "--resume", str(root / "fp32" / "ckpt"), ranks=1)
    two, one = weights(tmp_path / "two"), weights(tmp_path / "one")
    for k in full:
        assert torch.equal(two[k], full[k]), k
        torch.testing.assert_close(one[k], full[k], rtol=1e-5, atol=1e-6)


def test_a_checkpoint_of_one_process_resumes_sharded_on_two(runs, tmp_path):
    launch(tmp_path / "one", "--precision", "fp32", "--save-at", "4", ranks=1)
    launch(tmp_path / "two", "--precision", "fp32", "--resume", str(tmp_path / "one" / "ckpt"))
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)


def test_bf16_true_with_kahan_on_shards_tracks_fp32_and_resumes_bit_for_bit(runs, tmp_path):
    """The compensated optimizer steps each rank's local shards; its buffers are sharded
    DTensors, so the DCP checkpoint holds and restores them."""
    _, r = runs
    res = launch(tmp_path / "full", "--precision", "bf16-true", "--save-at", "4")
    assert res["losses"][-1] < res["losses"][0] / 3 and res["ranks_identical"]
    for got, ref in zip(res["losses"], r["fp32"]["losses"]):
        assert abs(got - ref) <= 0.02 * ref, (res["losses"], r["fp32"]["losses"])
    assert "kahan_comp" in res["state_keys"] and res["state_sharded"]
    launch(tmp_path / "resumed", "--precision", "bf16-true", "--resume", str(tmp_path / "full" / "ckpt"))
    full, resumed = weights(tmp_path / "full"), weights(tmp_path / "resumed")
    for k in full:
        assert torch.equal(resumed[k], full[k]), k


def test_bf16_true_trains_sharded_with_stochastic_rounding(tmp_path):
    res = launch(tmp_path, "--precision", "bf16-true", "--compensation", "stochastic")
    assert res["losses"][-1] < res["losses"][0] / 3 and res["ranks_identical"]
    assert "kahan_comp" not in res["state_keys"] and res["state_sharded"]


def test_plugin_fields_without_an_fsdp2_meaning_say_what_to_do():
    with pytest.raises(ValueError, match="fsdp_version=2"):
        FullyShardedDataParallelPlugin(fsdp_version=1)
    assert FullyShardedDataParallelPlugin.from_config({"fsdp_sharding_strategy": "SHARD_GRAD_OP"}) \
        .reshard_after_forward is False  # FSDP1's ZeRO-2 is FSDP2's reshard_after_forward=False
    with pytest.raises(ValueError, match="sharding_strategy.*NO_SHARD is DDP"):
        FullyShardedDataParallelPlugin.from_config({"fsdp_sharding_strategy": "NO_SHARD"})
    p = FullyShardedDataParallelPlugin.from_config({"transformer_layer_cls_to_wrap": ["Block"],
                                                    "fsdp_reshard_after_forward": False})
    assert p.transformer_cls_names_to_wrap == ["Block"] and p.reshard_after_forward is False


def test_blocks_default_to_each_layer_of_a_modulelist_and_names_must_match():
    from mixprec.distributed.fsdp import blocks_to_shard

    net = _script_module().Net()
    assert blocks_to_shard(net, FullyShardedDataParallelPlugin()) == list(net.layers)
    with pytest.raises(ValueError, match="matches no module.*Block"):
        blocks_to_shard(net, FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Nope"]))


def test_dcp_metadata_that_would_run_code_is_refused(tmp_path):
    import pickle

    from mixprec.checkpoint.sharded import _SafeMetadataUnpickler

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "ran"),))

    with pytest.raises(pickle.UnpicklingError, match="could run code"):
        _SafeMetadataUnpickler(__import__("io").BytesIO(pickle.dumps(Evil()))).load()
    assert not (tmp_path / "ran").exists()


def test_async_save_appears_complete_and_a_failure_in_the_background_leaves_nothing(tmp_path, monkeypatch):
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 4)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    acc.save_state(tmp_path / "a", async_save=True)
    assert acc.wait_for_checkpoint() == tmp_path / "a"
    from mixprec.checkpoint.folder import verify_checkpoint

    assert any(name.startswith("model_0/") for name in verify_checkpoint(tmp_path / "a"))
    w = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    acc.load_state(tmp_path / "a")
    assert torch.equal(model.weight, w)
    import mixprec.accelerator.checkpointer as ckpt

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ckpt, "commit_checkpoint", full_disk)
    acc.save_state(tmp_path / "b", async_save=True)
    with pytest.raises(OSError, match="No space"):
        acc.wait_for_checkpoint()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no staging debris, no half checkpoint


def test_two_nodes_on_one_machine_with_a_c10d_rendezvous_train_as_two_ranks(runs, tmp_path):
    """Two `torchrun --nnodes 2 --nproc_per_node 1` launches meet at a c10d rendezvous on 127.0.0.1."""
    root, _ = runs
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "mixprec-test",
           str(SCRIPT), str(tmp_path), "--precision", "fp32"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outs = [n.communicate(timeout=300) for n in nodes]
    assert all(n.returncode == 0 for n in nodes), "".join(o[1][-2000:] for o in outs)
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["num_processes"] == 2 and res["sharded"] and res["ranks_identical"]
    full, got = weights(root / "fp32"), weights(tmp_path)
    for k in full:
        assert torch.equal(got[k], full[k]), k  # the same global batches, the same shards: the same bits


ELASTIC = SCRIPTS / "elastic_trainer.py"


@pytest.fixture(scope="module")
def elastic_full(tmp_path_factory):
    """tests/scripts/elastic_trainer.py uninterrupted (FSDP2, 2 ranks under torchrun): the run the
    faulted ones below must end equal to; its folder and torchrun's stdout."""
    out = tmp_path_factory.mktemp("elastic") / "full"
    proc = subprocess.run(torchrun(ELASTIC, str(out)), capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def test_a_rank_killed_mid_run_is_restarted_by_torchrun_and_the_trainer_resumes_bit_for_bit(tmp_path, elastic_full):
    """TrainingArguments(fsdp="full_shard") under `torchrun --max-restarts 1`: rank 1 is SIGKILLed at
    step 6; the agent restarts both ranks; the Trainer (no resume argument) continues from
    checkpoint-4 and ends equal to an uninterrupted run, and torchrun exits 0. The restarted run is
    done twice (a static and a c10d rendezvous): a process group left to the interpreter's teardown
    made a rank abort at exit in about half of such runs, so each rank must find it destroyed."""
    def run(out, *extra, c10d=False):
        if c10d:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
                   "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                   str(ELASTIC), str(out), *extra]
        else:
            cmd = torchrun(ELASTIC, str(out), *extra, launcher=("--max-restarts", "1"))
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        last = "1" if extra else "0"  # the attempt that finished
        exits = sorted(line for line in proc.stdout.splitlines() if line.startswith(f"attempt {last} rank "))
        assert exits == [f"attempt {last} rank {r}: process group destroyed at exit" for r in (0, 1)], proc.stdout
        return proc

    full, stdout = elastic_full
    exits = sorted(line for line in stdout.splitlines() if line.startswith("attempt 0 rank "))
    assert exits == [f"attempt 0 rank {r}: process group destroyed at exit" for r in (0, 1)], stdout
    # The schedule counts optimizer steps on each rank (linear decay over 12 steps), not one per process.
    history = json.loads((full / "checkpoint-12" / "trainer_state.json").read_text())["log_history"]
    lr4 = next(h["learning_rate"] for h in history if h.get("step") == 4)
    assert lr4 == pytest.approx(0.05 * 9 / 12)  # the rate step 4 used (3 steps of decay), as transformers logs it
    a = safetensors.torch.load_file(str(full / "final" / "model.safetensors"))
    for name, c10d in (("killed", False), ("killed_c10d", True)):
        proc = run(tmp_path / name, "--kill-at", "6", c10d=c10d)
        assert (tmp_path / name / "attempts.txt").read_text() == "attempt 1 finished at step 12\n"
        assert "restart 1 of this run (torchrun); resuming from" in proc.stderr and "checkpoint-4" in proc.stderr
        b = safetensors.torch.load_file(str(tmp_path / name / "final" / "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_training_arguments_fsdp_maps_onto_the_plugin_with_hugging_faces_names():
    from mixprec import TrainingArguments

    args = TrainingArguments(output_dir="x", fsdp="shard_grad_op auto_wrap",
                             fsdp_config={"transformer_layer_cls_to_wrap": ["Block"], "activation_checkpointing": True})
    p = args.fsdp_plugin
    assert p.reshard_after_forward is False and p.transformer_cls_names_to_wrap == ["Block"] and p.activation_checkpointing
    assert TrainingArguments(output_dir="x").fsdp_plugin is None
    with pytest.raises(ValueError, match="offload.*not supported"):
        TrainingArguments(output_dir="x", fsdp="full_shard offload")


def test_a_sigterm_to_one_rank_stops_both_at_the_same_step_with_one_checkpoint(tmp_path, elastic_full):
    def run(out, *extra, ok=True):
        cmd = torchrun(ELASTIC, str(out), *extra)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert (proc.returncode == 0) == ok, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    proc = run(tmp_path / "term", "--sigterm-at", "6", ok=False)  # both ranks exit with status 75
    assert proc.stderr.count("SIGTERM received; stopped after step 6") == 2  # rank 0 saw it through rank 1
    assert "exitcode  : 75" in proc.stderr
    names = sorted(p.name for p in (tmp_path / "term").iterdir() if p.name.startswith("checkpoint"))
    assert names == ["checkpoint-4", "checkpoint-6"]
    run(tmp_path / "term", "--resume")
    a = safetensors.torch.load_file(str(elastic_full[0] / "final" / "model.safetensors"))
    b = safetensors.torch.load_file(str(tmp_path / "term" / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_rank_killed_in_the_middle_of_a_save_leaves_the_previous_checkpoint_loadable(runs, tmp_path):
    root, _ = runs
    out = tmp_path / "died"
    out.mkdir()
    cmd = torchrun(SCRIPT, str(out), "--precision", "fp32", "--save-at", "2", "--die-saving-at", "4")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0 and not (out / "final.safetensors").exists()  # it really died
    from mixprec.checkpoint.folder import verify_checkpoint

    verify_checkpoint(out / "ckpt")  # the step-2 checkpoint, whole
    assert json.loads((out / "ckpt" / "loop.json").read_text())["step"] == 2
    launch(tmp_path / "resumed", "--precision", "fp32", "--resume", str(out / "ckpt"))
    full, got = weights(root / "fp32"), weights(tmp_path / "resumed")
    assert all(torch.equal(got[k], full[k]) for k in full)


def test_gradient_statistics_count_every_shard_once(tmp_path):
    """GradientStats on DTensor gradients: each rank counts its shard, the counts are summed over
    the ranks, so rank 0 reports whole parameters as one process does; an inf in rank 1's shard
    shows in rank 0's report."""
    res = launch(tmp_path, "--precision", "fp32", "--diagnostics", "--steps", "2")  # (the tracer runs too)
    assert res["overflow_events"] == []
    acc = Accelerator(cpu=True, diagnostics={"gradient_stats_every": 1})
    one_process("fp32", steps=2, accelerator=acc)
    ref = acc.monitor.stats.report()
    assert len(res["grad_stats"]) == len(ref) == 2
    for got, want in zip(res["grad_stats"], ref):
        assert set(got) == set(want["parameters"])
        for name, g in got.items():
            w = want["parameters"][name]
            assert g["numel"] == w["numel"] == sum(g["hist"]), name
            # the same gradients up to the reduction's rounding: a value may cross a bin edge
            assert sum(abs(a - b) for a, b in zip(g["hist"], w["unscaled"]["log2_hist"])) <= 0.02 * w["numel"] + 2
    res = launch(tmp_path / "inf", "--precision", "fp32", "--diagnostics", "--skip-nonfinite",
                 "--inf-rank", "1", "--inf-step", "1", "--steps", "2")
    assert [s["inp.weight"]["nan"] for s in res["grad_stats"]] == [0, 1]


def test_activation_checkpointing_changes_no_gradient_under_autocast_or_bf16_true(runs, tmp_path):
    """Recompute in backward sees the dtypes of the first forward (PyTorch #148831 is the known
    failure): with and without checkpointing the weights after every step's gradient are bit
    for bit the same, under bf16-mixed's autocast and in bf16-true."""
    root, r = runs
    plain = launch(tmp_path / "bf16", "--precision", "bf16")
    assert r["bf16"]["checkpointed_blocks"] == 3 and plain["checkpointed_blocks"] == 0
    assert plain["losses"] == r["bf16"]["losses"]
    a, b = weights(tmp_path / "bf16"), weights(root / "bf16")
    assert all(torch.equal(a[k], b[k]) for k in a)
    for ac in ("", "--activation-checkpointing"):
        launch(tmp_path / f"true{ac}", "--precision", "bf16-true", "--steps", "3", *([ac] if ac else []))
    a, b = weights(tmp_path / "true"), weights(tmp_path / "true--activation-checkpointing")
    assert all(torch.equal(a[k], b[k]) for k in a)
