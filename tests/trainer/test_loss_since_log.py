"""The training loss summed between logs (``LossSinceLog``): transformers' ``logging_nan_inf_filter``
rule, folded on the device every few steps instead of four tensor operations per step, gives the
sequential rule's sum; and the Trainer logs transformers' numbers for a run with non-finite losses."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mixprec
from mixprec.trainer.nonfinite import LossSinceLog

from toys import SineRegressor, SineRows

VALUES = st.one_of(st.floats(0.0, 10.0), st.sampled_from([float("nan"), float("inf"), float("-inf")]))


def sequential(start, values, steps, nan_inf_filter):
    """The rule, one micro-batch at a time, in float64 (transformers' _tr_loss update)."""
    total = start
    for v, k in zip(values, steps):
        total += v if (math.isfinite(v) or not nan_inf_filter) else total / (1 + k)
    return total


@settings(max_examples=200, deadline=None)
@given(values=st.lists(VALUES, max_size=80), per_step=st.integers(1, 4), start=st.floats(0.0, 5.0),
       chunk=st.sampled_from([1, 3, 32]), nan_inf_filter=st.booleans())
def test_the_folded_sum_is_the_sequential_rules(values, per_step, start, chunk, nan_inf_filter):
    steps = [i // per_step for i in range(len(values))]  # optimizer steps since the log, per micro-batch
    acc = LossSinceLog(torch.tensor(start), nan_inf_filter=nan_inf_filter, chunk=chunk)
    for v, k in zip(values, steps):
        acc.add(torch.tensor(v), k)
    got, want = float(acc.total()), sequential(start, values, steps, nan_inf_filter)
    if math.isfinite(want):
        assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-5)
    else:
        assert not math.isfinite(got)


def test_reset_starts_a_new_sum_and_nothing_is_lost_between_folds():
    acc = LossSinceLog(torch.zeros(()), nan_inf_filter=True, chunk=2)
    for i in range(5):
        acc.add(torch.tensor(float(i)), i)
    assert float(acc.total()) == 10.0
    acc.reset()
    acc.add(torch.tensor(1.5), 0)
    assert float(acc.total()) == 1.5


class NanAtTimes(SineRegressor):
    """A finite gradient always, a non-finite loss value at the 3rd and 7th call (a detached NaN)."""

    calls = 0

    def forward(self, x, labels=None):
        out = super().forward(x, labels)
        NanAtTimes.calls += 1
        if NanAtTimes.calls in (3, 7):
            out["loss"] = out["loss"] + torch.tensor(float("nan"))
        return out


def test_logged_losses_with_non_finite_values_are_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")

    def run(trainer_cls, args_cls, out):
        NanAtTimes.calls = 0
        torch.manual_seed(0)
        args = args_cls(output_dir=str(out), max_steps=8, per_device_train_batch_size=4, logging_steps=4,
                        learning_rate=1e-2, report_to="none", disable_tqdm=True, use_cpu=True, save_strategy="no",
                        logging_nan_inf_filter=True)
        trainer = trainer_cls(model=NanAtTimes(), args=args, train_dataset=SineRows())
        trainer.train()
        return [row["loss"] for row in trainer.state.log_history if "loss" in row]

    theirs = run(transformers.Trainer, transformers.TrainingArguments, tmp_path / "hf")
    ours = run(mixprec.Trainer, mixprec.TrainingArguments, tmp_path / "mp")
    assert len(ours) == len(theirs) == 2 and all(math.isfinite(v) for v in ours)
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(ours, theirs))
