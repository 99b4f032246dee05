"""Diagnostics in the Accelerator, the Trainer and the Hugging Face Trainer: observe only, and keep
a collapsing fp16 run alive by falling back."""

from __future__ import annotations

import json
import logging

import pytest
import safetensors.torch
import torch

from mixprec import Accelerator, LossScaleCollapse, Trainer, TrainingArguments, detect_capability
from mixprec.diagnostics import DiagnosticsConfig

from toys import Classifier, Scale, blobs

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.PrecisionPerformanceWarning")


class Blowup(torch.nn.Module):
    """A classifier with one layer that multiplies by 1e5: its logits overflow fp16, never bf16."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), Scale(1e5), torch.nn.Linear(32, 4))

    def forward(self, features, labels=None):
        logits = self.net(features)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = torch.nn.functional.cross_entropy(logits.float(), labels) * 1e-4
        return out


def collapse_args(tmp_path, mode, **kw):
    return TrainingArguments(output_dir=str(tmp_path / "out"), fp16=True, max_steps=12, per_device_train_batch_size=16,
                             learning_rate=1e-3, logging_steps=4, save_strategy="steps", save_steps=10,
                             disable_tqdm=True, trace_overflow=True, on_loss_scale_collapse=mode,
                             loss_scaler={"max_consecutive_skips": 3}, **kw)


def test_a_collapsing_fp16_run_with_fallback_finishes_in_bf16_with_finite_loss(tmp_path, caplog):
    torch.manual_seed(0)
    trainer = Trainer(model=Blowup(), args=collapse_args(tmp_path, "fallback"), train_dataset=blobs(256))
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        out = trainer.train()
    # bf16-mixed where bf16 is native, else fp32 (CPUs without AVX512-BF16/AMX)
    target = "bf16-mixed" if detect_capability("cpu").is_native("bf16-mixed") else "fp32"
    assert out.global_step == 12 and trainer.accelerator.policy.name == target
    assert trainer.state.precision == target
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert all(torch.isfinite(torch.tensor(losses[-1:])))
    lines = [r.getMessage() for r in caplog.records if "collapsed" in r.getMessage()]
    assert len(lines) == 1 and f"to {target}" in lines[0] and "`net.1`" in lines[0]  # the Scale layer is blamed
    # The checkpoint records the switch: a resumed run stays in bf16.
    again = Trainer(model=Blowup(), args=collapse_args(tmp_path, "fallback").replace(max_steps=14),
                    train_dataset=blobs(256))
    again.train(resume_from_checkpoint=True)
    scaler = again.accelerator.scaler  # none, or the Trainer's inf/NaN guard, which scales nothing
    assert again.accelerator.policy.name == target and (scaler is None or scaler.get_scale() == 1.0)


def test_a_collapsing_fp16_run_with_raise_names_the_fix_and_the_module(tmp_path):
    torch.manual_seed(0)
    trainer = Trainer(model=Blowup(), args=collapse_args(tmp_path, "raise"), train_dataset=blobs(256))
    with pytest.raises(LossScaleCollapse, match=r"bf16-mixed.*`net\.1`"):
        trainer.train()


def train_run(tmp_path, name, **diag):
    torch.manual_seed(0)
    model = Classifier(hidden=32, dropout=0.2)
    args = TrainingArguments(output_dir=str(tmp_path / name), fp16=True, max_steps=12, per_device_train_batch_size=16,
                             learning_rate=3e-3, logging_steps=3, save_strategy="no", disable_tqdm=True, **diag)
    trainer = Trainer(model=model, args=args, train_dataset=blobs(256))
    trainer.train()
    return model, trainer


def test_diagnostics_on_observe_only_bit_for_bit(tmp_path):
    plain, _ = train_run(tmp_path, "plain")
    watched, trainer = train_run(tmp_path, "watched", diagnostics_steps=1, trace_overflow=True, drift_steps=2)
    for a, b in zip(plain.state_dict().values(), watched.state_dict().values()):
        assert torch.equal(a, b)
    logs = trainer.state.log_history
    assert any("grad_fp16_flush" in h for h in logs) and any("drift_rel" in h for h in logs)
    drift = [h["drift_rel"] for h in logs if "drift_rel" in h]
    assert len(drift) == 6 and all(0 <= d < 0.05 for d in drift)


def test_diagnostics_off_is_bit_for_bit_a_hand_written_grad_scaler_loop():
    data = blobs(128)
    x = torch.stack([d["features"] for d in data])
    y = torch.tensor([d["label"] for d in data])

    def run(accelerated, diagnostics=None):
        torch.manual_seed(0)
        model = Classifier(hidden=32)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        if accelerated:
            acc = Accelerator(mixed_precision="fp16", cpu=True, diagnostics=diagnostics)
            model, opt = acc.prepare(model, opt)
        else:
            scaler = torch.amp.GradScaler("cpu")
        for i in range(0, 128, 16):
            if accelerated:
                acc.backward(model(x[i:i + 16], labels=y[i:i + 16]).loss)
                opt.step()
            else:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(x[i:i + 16], labels=y[i:i + 16]).loss
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
        return model

    hand = run(False)
    for diag in (None, DiagnosticsConfig(gradient_stats_every=1, trace_overflow=True)):
        ours = run(True, diag)
        for a, b in zip(hand.parameters(), ours.parameters()):
            assert torch.equal(a, b)


def test_accelerator_diagnostics_report_underflow_of_a_tiny_loss():
    torch.manual_seed(0)
    model = Classifier(hidden=32)
    acc = Accelerator(mixed_precision="fp16", cpu=True, diagnostics={"gradient_stats_every": 1})
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = blobs(16)
    x, y = torch.stack([d["features"] for d in data]), torch.tensor([d["label"] for d in data])
    acc.backward(model(x, labels=y).loss * 1e-7)
    opt.step()
    values = acc.monitor.log_values()
    assert values["grad_fp16_flush"] > 0.5 and values["grad_fp16_flush_at_scale"] < 0.05


def test_hugging_face_trainer_gets_the_diagnostics_as_a_callback(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from mixprec.diagnostics.hf import DiagnosticsCallback

    torch.manual_seed(0)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=16,
                                          report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=Blowup(), args=args, train_dataset=blobs(64),
                                   callbacks=[DiagnosticsCallback(every_n_steps=2, trace_overflow=True)])
    trainer.train()
    rows = [json.loads(r) for r in (tmp_path / "diagnostics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "fp16_flush" in r] == [1, 3]
    assert "net.0" in rows[0]["fp16_flush"]


def test_bad_diagnostics_options_say_the_fix():
    with pytest.raises(ValueError, match="unknown diagnostics option"):
        Accelerator(cpu=True, diagnostics={"every": 3})
    with pytest.raises(ValueError, match="on_loss_scale_collapse must be"):
        Accelerator(cpu=True, on_loss_scale_collapse="ignore")
    with pytest.raises(ValueError, match="diagnostics_steps must be"):
        TrainingArguments(diagnostics_steps=-1)


def test_resumed_weights_are_loaded(tmp_path):
    # load_best/resume paths read model_0.safetensors: make sure a fallback checkpoint holds bf16-era weights
    torch.manual_seed(0)
    trainer = Trainer(model=Blowup(), args=collapse_args(tmp_path, "fallback"), train_dataset=blobs(256))
    trainer.train()
    saved = safetensors.torch.load_file(str(tmp_path / "out" / "checkpoint-10" / "model_0.safetensors"))
    assert all(torch.isfinite(v).all() for v in saved.values())
