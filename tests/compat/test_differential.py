"""The same script under the installed anchor and under mixprec, compared step for step.

An Accelerate loop (gradient accumulation, clipping, a scheduler, ``gather_for_metrics``) under
``accelerate.Accelerator`` and ``mixprec.Accelerator``; a Trainer run under ``transformers.Trainer``
and ``mixprec.Trainer``. Where they differ on purpose (fp16 on the CPU) the test says which is right.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import mixprec

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))


def accelerate_loop(accelerator_cls: type, mixed_precision: str) -> dict:
    """Accelerate's documented loop, two epochs; what it logs and the weights it ends with."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / 20))
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data(72)), batch_size=8)
    acc = accelerator_cls(mixed_precision=mixed_precision, gradient_accumulation_steps=2, cpu=True)
    try:
        model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
        seen: dict = {"loss": [], "lr": [], "grad_norm": []}
        for _ in range(2):
            model.train()
            for x, y in dl:
                with acc.accumulate(model):
                    loss = F.mse_loss(model(x), y)
                    acc.backward(loss)
                    if acc.sync_gradients:
                        seen["grad_norm"].append(float(acc.clip_grad_norm_(model.parameters(), 1.0)))
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                seen["loss"].append(loss.item())
                seen["lr"].append(sched.get_last_lr()[0])
        model.eval()
        with torch.no_grad():
            seen["predictions"] = torch.cat([acc.gather_for_metrics(model(x)) for x, _ in dl])
        seen["weights"] = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
        return seen
    finally:
        if accelerator_cls is accelerate.Accelerator:
            accelerate.state.AcceleratorState._reset_state(True)  # its process-wide singletons


def _same(a: dict, b: dict) -> None:
    assert a["loss"] == b["loss"] and a["lr"] == b["lr"] and a["grad_norm"] == b["grad_norm"]
    assert torch.equal(a["predictions"], b["predictions"])
    assert a["weights"].keys() == b["weights"].keys()
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_an_accelerate_loop_gives_accelerates_numbers_bit_for_bit(mixed_precision, one_thread):
    _same(accelerate_loop(accelerate.Accelerator, mixed_precision), accelerate_loop(mixprec.Accelerator, mixed_precision))


def test_fp16_on_the_cpu_is_real_where_accelerate_silently_trains_in_fp32(one_thread):
    theirs = accelerate_loop(accelerate.Accelerator, "fp16")
    _same(theirs, accelerate_loop(accelerate.Accelerator, "no"))  # Accelerate's fp16 on the CPU is fp32
    ours = accelerate_loop(mixprec.Accelerator, "fp16")
    assert ours["loss"] != theirs["loss"] and all(math.isfinite(v) for v in ours["loss"])
    assert abs(ours["loss"][-1] - theirs["loss"][-1]) < 0.05 * theirs["loss"][-1]  # close to fp32's, not equal


class _Rows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x, self.y = _data(40)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


class _Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _net()

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        out = self.body(x)
        return {"loss": F.mse_loss(out, labels), "logits": out}


def trainer_run(trainer_cls: type, args_cls: type, out: str) -> tuple[list[dict], dict, object]:
    model = _Regressor()
    args = args_cls(output_dir=out, num_train_epochs=2, per_device_train_batch_size=4, learning_rate=1e-2,
                    gradient_accumulation_steps=2, max_grad_norm=1.0, warmup_steps=2, weight_decay=0.01,
                    logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True, seed=3,
                    eval_strategy="epoch", per_device_eval_batch_size=8, train_sampling_strategy="sequential")
    trainer = trainer_cls(model=model, args=args, train_dataset=_Rows(), eval_dataset=_Rows())
    result = trainer.train()
    return trainer.state.log_history, {k: v.clone() for k, v in model.state_dict().items()}, result


def test_a_trainer_run_ends_with_transformers_weights_and_logs_its_gradient_norms(tmp_path, one_thread):
    theirs, their_weights, their_result = trainer_run(transformers.Trainer, transformers.TrainingArguments,
                                                      str(tmp_path / "hf"))
    ours, our_weights, our_result = trainer_run(mixprec.Trainer, mixprec.TrainingArguments, str(tmp_path / "mp"))

    def column(history: list[dict], key: str) -> list[tuple[int, float]]:
        return [(row["step"], row[key]) for row in history if key in row]

    assert all(torch.equal(their_weights[k], our_weights[k]) for k in their_weights)
    assert (our_result.global_step, our_result.training_loss) == (their_result.global_step, their_result.training_loss)
    assert column(ours, "grad_norm") == column(theirs, "grad_norm") and column(ours, "epoch") == column(theirs, "epoch")
    # mixprec logs the loss to 6 significant digits; the evaluation loss is averaged in another order.
    for key, tolerance in (("loss", 1e-5), ("eval_loss", 1e-6)):
        assert [s for s, _ in column(ours, key)] == [s for s, _ in column(theirs, key)]
        assert all(math.isclose(a, b, rel_tol=tolerance) for (_, a), (_, b) in zip(column(ours, key), column(theirs, key)))
