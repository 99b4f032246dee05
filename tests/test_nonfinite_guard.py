"""skip_nonfinite_steps: fp32 and bf16-mixed skip a step whose gradients hold inf/NaN, like fp16 does."""

import pytest
import torch

from mixprec import Accelerator, LossScaleCollapse
from mixprec.bench import count_host_syncs, host_side_tensors

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.PrecisionPerformanceWarning")


def run(precision, bad_steps, steps=5, fused=False, **kw):
    acc = Accelerator(mixed_precision=precision, cpu=True, skip_nonfinite_steps=True, **kw)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    model, opt = acc.prepare(model, opt)
    skipped = []
    for i in range(steps):
        x = torch.randn(8, 4)
        if i in bad_steps:
            x[0, 0] = float("nan")  # one bad row: every gradient becomes NaN
        acc.backward(model(x).float().pow(2).mean())
        opt.step()
        opt.zero_grad()
        skipped.append(opt.step_was_skipped)
    return acc, model, opt, skipped


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_nan_batch_is_skipped_and_counted_and_the_weights_stay_finite(precision):
    acc, model, opt, skipped = run(precision, bad_steps={1, 3})
    assert skipped == [False, True, False, True, False]
    assert torch.isfinite(model.weight).all() and opt.skipped_steps == 2
    assert acc.precision.log_values() == {"loss_scale": 1.0, "skipped_steps": 2}  # nothing is scaled


def test_without_the_guard_one_nan_batch_poisons_every_weight():
    acc = Accelerator(mixed_precision="fp32", cpu=True)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(8, 4)
    x[0, 0] = float("nan")
    acc.backward(model(x).pow(2).mean())
    opt.step()
    assert not torch.isfinite(model.weight).any()


def test_max_consecutive_skips_stops_a_run_that_only_produces_nans():
    with pytest.raises(LossScaleCollapse):
        run("fp32", bad_steps={0, 1, 2, 3}, loss_scaler={"max_consecutive_skips": 3})


def test_the_guard_makes_no_host_sync_with_a_fused_optimizer():
    acc, model, opt, _ = run("bf16", bad_steps=set(), steps=2, fused=True)
    x = torch.randn(8, 4)
    with count_host_syncs("cpu", ignore=host_side_tensors(opt.optimizer)) as syncs:
        acc.backward(model(x).float().pow(2).mean())
        opt.step()
        opt.zero_grad()
    assert syncs.count == 0, syncs.events


def test_bf16_true_says_it_has_no_guard_yet():
    with pytest.raises(NotImplementedError, match="bf16-true.*bf16-mixed"):
        Accelerator(mixed_precision="bf16-true", cpu=True, skip_nonfinite_steps=True)


@pytest.mark.parametrize("guard", [True, False])
def test_the_trainer_guard_skips_a_nan_row_and_without_it_the_row_poisons_the_model(tmp_path, guard):
    from mixprec import Trainer, TrainingArguments

    from toys import Classifier, blobs

    data = blobs(64)
    data[20]["features"] = data[20]["features"].clone()
    data[20]["features"][0] = float("nan")
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=8,
                             save_strategy="no", disable_tqdm=True, report_to="none", skip_nonfinite_steps=guard,
                             train_sampling_strategy="sequential")
    torch.manual_seed(0)
    trainer = Trainer(model=Classifier(), args=args, train_dataset=data)
    trainer.train()
    finite = all(torch.isfinite(p).all() for p in trainer.model.parameters())
    if guard:
        assert finite and trainer.state.skipped_steps == 1
    else:
        assert not finite
