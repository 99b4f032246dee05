"""skip_nonfinite_steps: fp32, bf16-mixed and bf16-true skip a step whose gradients hold inf/NaN, like fp16 does."""

import pytest
import torch

from mixprec import Accelerator, LossScaleCollapse
from mixprec.apps.bench import count_host_syncs, host_side_tensors

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


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-true"])
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


def bf16_true_run(batches, guard, optimizer="adamw", compensation="kahan"):
    acc = Accelerator(mixed_precision="bf16-true", cpu=True, skip_nonfinite_steps=guard,
                      bf16_true_compensation=compensation)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
    model, opt = acc.prepare(model, opt)
    skipped = []
    for x in batches:
        acc.backward(model(x).float().pow(2).mean())
        opt.step()
        opt.zero_grad()
        skipped.append(opt.step_was_skipped)
    return acc, model, opt, skipped


@pytest.mark.parametrize("optimizer, compensation", [("adamw", "kahan"), ("sgd", "kahan"), ("adamw", "stochastic")])
def test_bf16_true_skips_a_nan_step_leaving_weights_moments_and_kahan_buffers_as_they_were(optimizer, compensation):
    """The control: the same run without the bad batches. A skipped step changes nothing, so both end
    bit for bit alike: weights (bf16, LayerNorm's fp32), moments, Kahan buffers and step counts."""
    g = torch.Generator().manual_seed(1)
    good = [torch.randn(8, 4, generator=g) for _ in range(4)]
    bad = [torch.randn(8, 4, generator=g) for _ in range(2)]
    bad[0][0, 0], bad[1][3, 2] = float("nan"), float("inf")
    acc, model, opt, skipped = bf16_true_run([good[0], bad[0], good[1], good[2], bad[1], good[3]], True,
                                             optimizer, compensation)
    _, control, control_opt, _ = bf16_true_run(good, False, optimizer, compensation)
    assert skipped == [False, True, False, False, True, False]
    assert opt.skipped_steps == 2 and acc.precision.log_values() == {"loss_scale": 1.0, "skipped_steps": 2}
    assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float32
    for a, b in zip(model.state_dict().values(), control.state_dict().values()):
        assert torch.equal(a, b)
    state, control_state = opt.optimizer.state_dict()["state"], control_opt.optimizer.state_dict()["state"]
    assert state.keys() == control_state.keys()
    assert (compensation == "kahan") == any("kahan_comp" in st for st in state.values())
    for i in state:
        assert state[i].keys() == control_state[i].keys()
        for k in state[i]:
            assert torch.equal(state[i][k], control_state[i][k]), (i, k)


def test_bf16_true_without_the_guard_one_nan_batch_poisons_the_weights():
    x = torch.randn(8, 4)
    x[0, 0] = float("nan")
    _, model, _, _ = bf16_true_run([x], False)
    assert not torch.isfinite(model[0].weight).all()


def test_bf16_true_max_consecutive_skips_stops_a_run_that_only_produces_nans():
    acc = Accelerator(mixed_precision="bf16-true", cpu=True, skip_nonfinite_steps=True,
                      loss_scaler={"max_consecutive_skips": 3})
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    x = torch.full((8, 4), float("nan"))
    with pytest.raises(LossScaleCollapse):
        for _ in range(4):
            acc.backward(model(x).float().pow(2).mean())
            opt.step()
            opt.zero_grad()


def test_the_bf16_true_guard_reads_the_found_inf_flag_once_per_step():
    """The compensated optimizer has no fused, scale-aware step: deciding to step reads the flag once
    (GradScaler's own cost for such optimizers), and nothing else syncs."""
    x = torch.randn(8, 4)
    acc, model, opt, _ = bf16_true_run([x, x], True)
    with count_host_syncs("cpu", ignore=host_side_tensors(opt.optimizer)) as syncs:
        acc.backward(model(x).float().pow(2).mean())
        opt.step()
        opt.zero_grad()
    assert syncs.count == 1, syncs.events


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


def nan_rows(n, rows):
    from toys import blobs

    data = blobs(n)
    for r in rows:
        data[r]["features"] = data[r]["features"].clone()
        data[r]["features"][1] = float("nan")
    return data


@pytest.mark.parametrize("precision", ["fp32", "bf16-true"])
def test_skipped_steps_are_logged_by_number_once_per_log(tmp_path, capsys, precision):
    """Rows 20, 45 and 61 hold NaN; in order, batches of 8 put them in steps 3, 6 and 8: the log at
    step 4 names [3], the one at step 8 names [6, 8], in metrics.jsonl, log_history and one line each."""
    import json

    from mixprec import Trainer, TrainingArguments

    from toys import Classifier

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=8, logging_steps=4,
                             save_strategy="no", skip_nonfinite_steps=True, train_sampling_strategy="sequential",
                             precision=precision)
    torch.manual_seed(0)
    trainer = Trainer(model=Classifier(), args=args, train_dataset=nan_rows(64, [20, 45, 61]))
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["skipped_steps"], r["skipped_steps_at"]) for r in rows if "skipped_steps_at" in r] == [
        (4, 1, [3]), (8, 3, [6, 8])]
    assert [h["skipped_steps_at"] for h in trainer.state.log_history if "skipped_steps_at" in h] == [[3], [6, 8]]
    captured = capsys.readouterr()
    lines = [ln for ln in (captured.out + captured.err).splitlines() if "skipped for overflow" in ln]
    assert len(lines) == 2 and "last log: step 3;" in lines[0] and "last log: steps 6, 8;" in lines[1], lines
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_skipped_step_numbers_logged_after_a_resume_include_those_before_the_checkpoint(tmp_path):
    """Step 3 is skipped, checkpoint-5 is written, the run resumes from it: the log at step 8 names
    [3, 7], as the uninterrupted run's does."""
    import json

    from mixprec import Trainer, TrainingArguments

    from toys import Classifier

    def train(out, resume=None):
        args = TrainingArguments(output_dir=str(out), max_steps=8, per_device_train_batch_size=8, logging_steps=8,
                                 save_steps=5, skip_nonfinite_steps=True, train_sampling_strategy="sequential",
                                 disable_tqdm=True)
        torch.manual_seed(0)
        Trainer(model=Classifier(), args=args, train_dataset=nan_rows(64, [20, 50])).train(resume_from_checkpoint=resume)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [r for r in rows if "skipped_steps_at" in r]

    full = train(tmp_path / "full")
    resumed = train(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-5"))
    assert [r["step"] for r in full] == [r["step"] for r in resumed] == [8]
    assert full[-1]["skipped_steps_at"] == resumed[-1]["skipped_steps_at"] == [3, 7]


def test_a_nan_row_is_reported_with_its_epoch_batch_position_and_dataset_index(tmp_path, caplog):
    """Row 20 holds NaN; shuffled, it lands in some batch of each epoch: each skipped step's warning
    names the epoch, the batch's position in it (which matches the step) and dataset index 20."""
    import re

    from mixprec import Trainer, TrainingArguments

    from toys import Classifier

    args = TrainingArguments(output_dir=str(tmp_path), num_train_epochs=2, per_device_train_batch_size=8,
                             save_strategy="no", skip_nonfinite_steps=True, disable_tqdm=True, report_to="none")
    torch.manual_seed(0)
    trainer = Trainer(model=Classifier(), args=args, train_dataset=nan_rows(64, [20]))
    with caplog.at_level("WARNING", logger="mixprec.trainer"):
        trainer.train()
    told = [r.getMessage() for r in caplog.records if "holds inf/NaN" in r.getMessage()]
    assert len(told) == 2, told  # once per epoch: the row is seen once per epoch
    found = [re.search(r"step (\d+) was skipped.*epoch (\d), batch (\d+) \(0-based\): inf/NaN in 'features' at "
                       r"dataset indices \[20\]$", m) for m in told]
    assert all(found), told
    steps = [tuple(map(int, f.groups())) for f in found]
    assert [e for _, e, _ in steps] == [0, 1]
    assert all(step == epoch * 8 + position + 1 for step, epoch, position in steps)  # 8 batches per epoch
    assert trainer.state.skipped_steps == 2
