"""mixprec as the engine under transformers' own Trainer (``mixprec.patch_transformers()``): the
switch itself, and transformers' Trainer under it against the same run under Accelerate, step for
step: losses, weights, ``eval_loss`` with a short last batch, a second ``train()``, a mid-epoch
resume from transformers' own checkpoints; and what only mixprec gives (real fp16 on the CPU, the
precision in force in the first log, skipped steps said aloud)."""

from __future__ import annotations

import logging
import math
import subprocess
import sys

import pytest
import torch

import mixprec
from mixprec.integrations import transformers_engine as engine

from toys import SineRegressor, SineRows

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")


@pytest.fixture
def switch():
    """The switch on for one test, off after it whatever happens."""
    yield mixprec.patch_transformers
    mixprec.unpatch_transformers()


class StartStep(transformers.TrainerCallback):
    """Notes the step each ``train()`` starts at (a resumed one starts at its checkpoint's)."""

    def __init__(self):
        self.steps = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


class StopAt(transformers.TrainerCallback):
    """Stops training after ``step`` (the learning-rate schedule stays the whole run's): an interruption."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def run(out, resume=None, trainer=None, callbacks=(), **more):
    """transformers' own Trainer on the sine regressor: 40 rows, batches of 4, an evaluation per
    epoch over batches of 12 (the last one short); its logs, weights and the Trainer."""
    settings = dict(output_dir=str(out), num_train_epochs=2, per_device_train_batch_size=4, learning_rate=1e-2,
                    logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True, seed=3,
                    eval_strategy="epoch", per_device_eval_batch_size=12)
    args = transformers.TrainingArguments(**{**settings, **more})
    if trainer is None:
        torch.manual_seed(0)
        trainer = transformers.Trainer(model=SineRegressor(), args=args, train_dataset=SineRows(),
                                       eval_dataset=SineRows(), callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return trainer.state.log_history, weights, trainer


def column(history, key):
    return [(row["step"], row[key]) for row in history if key in row]


def test_the_switch_replaces_the_one_name_is_idempotent_and_is_undone():
    import transformers.trainer as hf_trainer

    original = hf_trainer.Accelerator
    assert original is accelerate.Accelerator
    first = mixprec.patch_transformers()
    try:
        second = mixprec.patch_transformers("bf16")
        assert first is second and first.active and first.precision == "bf16-mixed"
        assert hf_trainer.Accelerator is engine.EngineAccelerator
        assert sum(c.__name__ == "PrecisionLogCallback" for c in hf_trainer.DEFAULT_CALLBACKS) == 1
        acc = hf_trainer.Accelerator(cpu=True)
        assert type(acc) is mixprec.Accelerator and isinstance(acc, hf_trainer.Accelerator)
        assert acc.policy.name == "bf16-mixed"
    finally:
        first.undo()
    assert hf_trainer.Accelerator is original and not first.active
    assert not any(c.__name__ == "PrecisionLogCallback" for c in hf_trainer.DEFAULT_CALLBACKS)
    mixprec.unpatch_transformers()  # undoing twice is harmless
    with mixprec.patch_transformers("fp16") as patch:
        assert hf_trainer.Accelerator is engine.EngineAccelerator and patch.precision == "fp16-mixed"
    assert hf_trainer.Accelerator is original


def test_a_wrong_precision_or_option_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="bf16-true"):
        mixprec.patch_transformers("bf17")
    with pytest.raises(TypeError, match="on_loss_scale_collapse"):
        mixprec.patch_transformers(mixed_precision="fp16")
    assert not engine.is_patched()


def test_without_transformers_the_switch_says_so_and_what_to_install():
    code = ("import sys; sys.modules['transformers'] = None; import mixprec\n"
            "try:\n    mixprec.patch_transformers()\nexcept ImportError as e:\n    print('ERR', e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert "ERR" in out and "pip install transformers" in out


def test_transformers_trainer_under_the_switch_ends_with_accelerates_numbers(tmp_path, switch):
    theirs, their_weights, _ = run(tmp_path / "acc")
    switch()
    ours, our_weights, trainer = run(tmp_path / "mp")
    assert type(trainer.accelerator) is mixprec.Accelerator
    assert all(torch.equal(their_weights[k], our_weights[k]) for k in their_weights)
    for key in ("loss", "grad_norm", "learning_rate"):
        assert column(ours, key) == column(theirs, key)
    # 40 rows in batches of 12: the last is short, its loss repeated to 12 rows and cut back to 4
    assert column(ours, "eval_loss") == column(theirs, "eval_loss")
    rows = SineRows()
    model = trainer.model.eval()
    with torch.no_grad():
        want = sum(model(rows.x[i:i + 12], rows.y[i:i + 12])["loss"].item() * len(rows.x[i:i + 12])
                   for i in range(0, 40, 12)) / 40
    assert math.isclose(column(ours, "eval_loss")[-1][1], want, rel_tol=1e-5)


def test_the_first_training_log_says_the_precision_in_force_once(tmp_path, switch):
    switch()
    history, _, trainer = run(tmp_path, bf16=True)
    reports = [row["precision_in_force"] for row in history if "precision_in_force" in row]
    assert len(reports) == 1 and "bf16-mixed" in reports[0] and "as the contract says" in reports[0]
    assert "precision_in_force" in next(row for row in history if "loss" in row)
    assert trainer.accelerator.precision_report().ok


def test_fp16_on_the_cpu_is_real_under_the_switch_where_accelerate_trains_in_fp32(tmp_path, switch):
    theirs, their_weights, hf = run(tmp_path / "acc", fp16=True, num_train_epochs=1)
    assert hf.accelerator.scaler is None  # Accelerate 1.16: fp16 on the CPU is fp32, in silence
    switch()
    ours, our_weights, trainer = run(tmp_path / "mp", fp16=True, num_train_epochs=1)
    report = trainer.accelerator.precision_report()
    assert report.ok and report.precision == "fp16-mixed" and "autocast float16" in report.line()
    assert trainer.accelerator.scaler is not None and all("loss_scale" in row for row in ours if "loss" in row)
    assert not all(torch.equal(their_weights[k], our_weights[k]) for k in their_weights)  # fp16 changed the numbers
    assert all(math.isclose(a, b, rel_tol=0.05) for (_, a), (_, b) in zip(column(ours, "loss"), column(theirs, "loss")))


def test_the_switchs_precision_overrides_the_training_arguments(tmp_path, switch):
    switch("bf16-true")
    _, _, trainer = run(tmp_path, fp16=True, num_train_epochs=1, eval_strategy="no")
    assert trainer.accelerator.policy.name == "bf16-true"
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    assert trainer.accelerator.precision_report().ok


def test_skipped_steps_are_logged_and_said_aloud(tmp_path, switch, caplog):
    # a scale of 2**40 overflows fp16 gradients at once: the first steps are skipped, the scale backs off
    switch(loss_scaler={"init_scale": 2.0 ** 40})
    with caplog.at_level(logging.WARNING, logger="mixprec.trainer"):
        history, _, trainer = run(tmp_path, fp16=True, num_train_epochs=1, eval_strategy="no")
    skipped = column(history, "skipped_steps")
    assert skipped[0][1] >= 1 and skipped[-1][1] == trainer.accelerator.scaler.skipped_steps
    assert column(history, "loss_scale")[-1][1] < 2.0 ** 40
    assert any("skipped since the last log" in r.getMessage() for r in caplog.records)


class EmbeddingLossTrainer(transformers.Trainer):
    """A subclass that names its loss as setfit's (and sentence-transformers') trainers do: its
    ``log`` renames ``loss`` to ``embedding_loss`` (and ``eval_loss`` to ``eval_embedding_loss``)
    before transformers' ``log`` hands the dict to the callbacks."""

    def log(self, logs, *args, **kwargs):
        renamed = {k.replace("loss", "embedding_loss") if k in ("loss", "eval_loss") else k: v for k, v in logs.items()}
        super().log(renamed, *args, **kwargs)


def test_a_subclass_that_renames_its_loss_gets_the_audit_in_its_training_logs_only(tmp_path, switch, caplog):
    switch(loss_scaler={"init_scale": 2.0 ** 40})  # the first fp16 steps overflow and are skipped
    args = transformers.TrainingArguments(output_dir=str(tmp_path), num_train_epochs=1, per_device_train_batch_size=4,
                                          logging_steps=1, report_to="none", disable_tqdm=True, use_cpu=True, seed=3,
                                          fp16=True, save_strategy="no", eval_strategy="epoch")
    torch.manual_seed(0)
    trainer = EmbeddingLossTrainer(model=SineRegressor(), args=args, train_dataset=SineRows(), eval_dataset=SineRows())
    with caplog.at_level(logging.WARNING, logger="mixprec.trainer"):
        trainer.train()
    history = trainer.state.log_history
    training = [row for row in history if "embedding_loss" in row]
    assert len(training) == 10 and "precision_in_force" in training[0] and "fp16-mixed" in training[0]["precision_in_force"]
    assert all("loss_scale" in row and "skipped_steps" in row for row in training)
    assert training[-1]["skipped_steps"] == trainer.accelerator.scaler.skipped_steps >= 1
    assert any("skipped since the last log" in r.getMessage() for r in caplog.records)
    others = [row for row in history if "embedding_loss" not in row]  # the evaluation's and train()'s summary
    assert any("eval_embedding_loss" in row for row in others) and any("train_runtime" in row for row in others)
    assert not any("loss_scale" in row or "precision_in_force" in row for row in others)


def test_a_collapsing_loss_scale_falls_back_when_asked_and_the_log_says_so(tmp_path, switch):
    class Exploding(SineRegressor):
        def forward(self, x, labels=None):
            out = super().forward(x, labels)
            out["loss"] = out["loss"] * 1e30  # inf in fp16 whatever the scale
            return out

    switch(loss_scaler={"max_consecutive_skips": 3}, on_loss_scale_collapse="fallback")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4,
                                          logging_steps=1, report_to="none", disable_tqdm=True, use_cpu=True,
                                          fp16=True, save_strategy="no")
    trainer = transformers.Trainer(model=Exploding(), args=args, train_dataset=SineRows())
    trainer.train()
    assert trainer.accelerator.policy.name in ("bf16-mixed", "fp32")
    assert [row["precision"] for row in trainer.state.log_history if "precision" in row] == [trainer.accelerator.policy.name]


def test_a_second_train_prepares_the_same_objects_again(tmp_path, switch):
    switch()
    first, _, trainer = run(tmp_path, num_train_epochs=1, eval_strategy="no")
    second, weights, trainer = run(tmp_path, trainer=trainer, num_train_epochs=1, eval_strategy="no")
    assert len(trainer.accelerator._models) == 1 and len(trainer.accelerator._optimizers) == 1
    assert column(second, "loss")[-1][1] < column(first, "loss")[0][1]


def test_a_mid_epoch_resume_from_transformers_checkpoints_continues_as_under_accelerate(tmp_path, switch):
    # 10 steps an epoch; the checkpoint at step 15 is mid-way through the second (shuffled) epoch
    more = dict(save_strategy="steps", save_steps=15, eval_strategy="no", num_train_epochs=3)
    full, full_weights, _ = run(tmp_path / "acc", **more)
    run(tmp_path / "acc-resumed", callbacks=[StopAt(15)], **more)
    theirs, their_weights, _ = run(tmp_path / "acc-resumed", resume=str(tmp_path / "acc-resumed" / "checkpoint-15"),
                                   **more)
    switch()
    run(tmp_path / "mp", callbacks=[StopAt(15)], **more)
    start = StartStep()
    ours, our_weights, trainer = run(tmp_path / "mp", resume=str(tmp_path / "mp" / "checkpoint-15"),
                                     callbacks=[start], **more)
    assert start.steps == [15]  # it resumed at the checkpoint's step, not from the start
    assert column(ours, "loss") == column(theirs, "loss")
    assert all(torch.equal(their_weights[k], our_weights[k]) for k in their_weights)
    # and Accelerate's resumed run is the uninterrupted one: the second epoch's order was kept
    assert column(theirs, "loss") == column(full, "loss")
    assert all(torch.equal(their_weights[k], full_weights[k]) for k in their_weights)
