"""torch.compile composes with autocast and the loss scaler (slow: it compiles)."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec import Accelerator, Trainer, TrainingArguments

from toys import Classifier, blobs

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::mixprec.PrecisionPerformanceWarning")]


def run(precision, compiled):
    torch.manual_seed(0)
    model = Classifier(hidden=32)
    acc = Accelerator(mixed_precision=precision, cpu=True, compile=compiled)
    prepared, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    data = blobs(64)
    x, y = torch.stack([d["features"] for d in data]), torch.tensor([d["label"] for d in data])
    for i in range(0, 64, 16):
        out = prepared(x[i:i + 16], labels=y[i:i + 16])
        acc.backward(out.loss)
        opt.step()
        opt.zero_grad()
    return model, out, acc


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_compiled_training_matches_eager_to_the_precisions_tolerance(precision):
    eager, _, _ = run(precision, False)
    compiled, out, acc = run(precision, True)
    # autocast ran inside the compiled forward; the outputs come back in fp32, as Accelerate returns them
    assert acc.precision_report().observed["autocast"] == ("bfloat16" if precision == "bf16" else "float16")
    assert out.logits.dtype == torch.float32
    assert acc.unwrap_model(acc.prepared.models[0], keep_torch_compile=False) is compiled
    for a, b in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_trainer_torch_compile_trains(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), torch_compile=True, bf16=True, max_steps=6, disable_tqdm=True,
                             save_strategy="no", per_device_train_batch_size=16)
    torch.manual_seed(0)
    model = Classifier()
    data = blobs(128)
    x, y = torch.stack([d["features"] for d in data]), torch.tensor([d["label"] for d in data])
    before = model(x, labels=y).loss.item()
    trainer = Trainer(model=model, args=args, train_dataset=data)
    out = trainer.train()
    assert isinstance(trainer.accelerator.prepared.models[0], torch._dynamo.eval_frame.OptimizedModule)
    assert out.global_step == 6 and math.isfinite(out.training_loss)
    assert model(x, labels=y).loss.item() < before  # it trained: the compiled steps updated the weights
