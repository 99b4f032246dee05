"""accelerator.precision_report(): what is really in force, against each precision's contract."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from mixprec import Accelerator
from mixprec.accelerator.audit import expected_dtypes

from toys import SCRIPTS, torchrun

SCRIPT = SCRIPTS / "audit_check.py"
pytestmark = pytest.mark.filterwarnings("ignore::mixprec.PrecisionPerformanceWarning")
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-true")


def train(acc: Accelerator, model: torch.nn.Module, steps: int = 2):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    torch.manual_seed(1)
    for _ in range(steps):
        acc.backward(model(torch.randn(4, 8)).float().pow(2).mean())
        opt.step()
        opt.zero_grad()
    return model, opt


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 1))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_one_process_meets_the_contract_and_observes_every_field(precision):
    acc = Accelerator(mixed_precision=precision, cpu=True,
                      loss_scaler={"init_scale": 2.0**8} if precision == "fp16" else None)
    before = acc.precision_report()
    assert before.observed["forward_params"] == "not observed yet"
    train(acc, net())
    r = acc.precision_report()
    assert r.ok, r.violations
    assert "not observed" not in json.dumps(r.observed), r.observed
    want = expected_dtypes(r.precision, "single")
    assert r.observed["activations"] == str(want["activations"]).removeprefix("torch.")


def test_an_autocast_switched_off_inside_forward_is_caught():
    """16-mixed that really runs in fp32 (a forward that leaves autocast): the matmuls say so."""
    class NoAutocast(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = net()

        def forward(self, x):
            with torch.autocast("cpu", enabled=False):
                return self.body(x)

    acc = Accelerator(mixed_precision="bf16", cpu=True)
    train(acc, NoAutocast())
    r = acc.precision_report()
    assert any("autocast inside forward is off" in v for v in r.violations), r.violations
    assert any("matmul outputs are float32" in v for v in r.violations), r.violations


def test_master_weights_cast_to_16_bit_are_caught():
    """"16-mixed" running as "16-true" (Lightning #17506): the master weights are no longer fp32."""
    acc = Accelerator(mixed_precision="bf16", cpu=True)
    model, _ = train(acc, net(), steps=0)
    model.to(torch.bfloat16)
    r = acc.precision_report()
    assert any("master weights are bfloat16" in v for v in r.violations), r.violations


def test_a_loss_scaler_that_load_state_did_not_restore_is_caught(tmp_path, monkeypatch):
    """Accelerate #4289: the scaler's state silently not restored by a resume."""
    acc = Accelerator(mixed_precision="fp16", cpu=True, loss_scaler={"init_scale": 2.0**8, "growth_interval": 1})
    train(acc, net(), steps=3)  # the scale grows every step
    acc.save_state(tmp_path / "ckpt")
    acc.scaler.update(new_scale=2.0)
    acc.load_state(tmp_path / "ckpt")
    assert acc.precision_report().ok and "restored" in acc.precision_report().observed["scaler"]
    acc.scaler.update(new_scale=2.0)
    monkeypatch.setattr(acc.precision, "load_state_dict", lambda state: None)
    acc.load_state(tmp_path / "ckpt")
    r = acc.precision_report()
    assert any("not restored by load_state" in v and "scale" in v for v in r.violations), r.violations


def test_the_contract_names_its_inputs():
    with pytest.raises(ValueError, match="known: fp32"):
        expected_dtypes("fp12", "ddp")
    with pytest.raises(ValueError, match="'single', 'ddp' or 'fsdp'"):
        expected_dtypes("fp32", "tp")
    assert expected_dtypes("bf16-mixed", "fsdp")["forward"] == torch.bfloat16
    assert expected_dtypes("bf16-mixed", "ddp")["forward"] == torch.float32
    assert expected_dtypes("bf16-true", "fsdp")["reduced"] == torch.float32


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_every_precision_meets_its_contract_with_two_processes(tmp_path, mode):
    """2 gloo ranks: each precision trains, saves, loads and reports; under FSDP2 a policy that
    drops reduce_dtype (bf16 all-reduce instead of fp32) is caught."""
    cmd = torchrun(SCRIPT, str(tmp_path), mode)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = json.loads((tmp_path / f"{mode}.json").read_text())
    for r in reports[:4]:
        assert r["mode"] == mode and r["violations"] == [], r["line"]
        assert "not observed" not in json.dumps(r["observed"]), r["line"]
    fp16 = reports[2]
    assert "restored from the checkpoint" in fp16["observed"]["scaler"]
    if mode == "fsdp":
        assert all("(sharded)" in r["observed"]["master_weights"] for r in reports)
        assert reports[1]["observed"]["forward_params"] == "bfloat16"  # gathered in bf16 by FSDP2's policy
        assert reports[4]["violations"] == ["the gradients as reduced are bfloat16, the contract says float32"]
    else:
        assert reports[1]["observed"]["forward_params"] == "float32"  # autocast casts per op
        assert reports[4]["violations"] == [] and reports[4]["observed"]["reduced_gradients"] == "bfloat16"


@pytest.mark.parametrize("precision", ["bf16", "bf16-true"])
def test_the_trainers_first_log_says_what_precision_is_in_force(tmp_path, precision):
    from mixprec import Trainer, TrainingArguments

    from toys import Classifier, blobs

    args = TrainingArguments(output_dir=str(tmp_path), disable_tqdm=True, per_device_train_batch_size=16,
                             max_steps=6, logging_steps=2, save_strategy="no", precision=precision)
    torch.manual_seed(0)
    trainer = Trainer(model=Classifier(), args=args, train_dataset=blobs(200))
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first = rows[0]["precision_in_force"]
    assert first.startswith(f"precision in force ({trainer.accelerator.policy.name}, single)") and \
        first.endswith("as the contract says"), first
    assert all("precision_in_force" not in r for r in rows[1:])


def test_the_observers_leave_the_prepared_objects_picklable():
    """The audit's hooks are objects, not closures: a prepared model and optimizer still pickle
    (Accelerate's optimizer-pickling test), before the first forward as after it."""
    import pickle

    acc = Accelerator(mixed_precision="bf16", cpu=True)
    m = net()
    model, opt = acc.prepare(m, torch.optim.AdamW(m.parameters()))
    for obj in (model, opt):
        assert type(pickle.loads(pickle.dumps(obj))) is type(obj)
    acc.backward(model(torch.randn(2, 8)).float().sum())
    opt.step()
    for obj in (model, opt):
        assert type(pickle.loads(pickle.dumps(obj))) is type(obj)
    assert acc.precision_report().ok and acc.precision_report().observed["gradients"] == "float32"


@pytest.mark.parametrize("call", ["module", "forward"])
def test_the_first_forwards_probes_are_gone_after_it_even_when_the_root_is_called_through_forward(call):
    """Each module's probe goes when the module's first call ends: a model whose root is called
    through ``.forward()`` (the root's own hooks never run) does not keep torch's slower hooked
    call path on every layer for the rest of the run. Layers the first forward did not call keep
    theirs (they cost nothing) until the root's hook runs."""
    acc = Accelerator(mixed_precision="bf16", cpu=True)
    unused = torch.nn.Linear(2, 2)
    model = acc.prepare(torch.nn.ModuleDict({"body": net(), "unused": unused}))
    body = model["body"]
    hooked = [m for m in body.modules() if m._forward_pre_hooks or m._forward_hooks]
    assert len(hooked) == 2  # the two Linear layers, probed
    body(torch.randn(4, 8)) if call == "module" else body.forward(torch.randn(4, 8))
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in body.modules())
    assert unused._forward_pre_hooks and [r["path"] for r in acc.audit.forward] == ["body.0", "body.2"]
