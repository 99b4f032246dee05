"""``TrainingArguments`` normalised and validated as transformers' are: the same inputs give the
same fields, or an error under both."""

from __future__ import annotations

import warnings

import pytest

import mixprec

transformers = pytest.importorskip("transformers")

SAME = [dict(output_dir="~/mixprec-runs", use_cpu=True),
        dict(output_dir="o", report_to="none"),
        dict(output_dir="o", report_to=["none"]),
        dict(output_dir="o", use_cpu=True, dataloader_pin_memory=True),
        dict(output_dir="o", lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs='{"min_lr_rate": 0.1}'),
        dict(output_dir="o", optim="adafactor", optim_args="beta1=0.9")]


def _both(kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.TrainingArguments(**kwargs), mixprec.TrainingArguments(**kwargs)


@pytest.mark.parametrize("kwargs", SAME)
def test_the_same_inputs_give_transformers_fields(kwargs):
    theirs, ours = _both(kwargs)
    fields = [*kwargs, "dataloader_pin_memory"]  # (the defaults that differ on purpose: the README's table)
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(theirs, f) for f in fields}


@pytest.mark.parametrize("kwargs", [dict(output_dir="o", fp16=True, bf16=True, use_cpu=True),
                                    dict(output_dir="o", dataloader_prefetch_factor=2),
                                    dict(output_dir="o", lr_scheduler_type="reduce_lr_on_plateau"),
                                    dict(output_dir="o", optim="adamw_nonexistent")])
def test_what_transformers_refuses_is_refused(kwargs):
    with pytest.raises(ValueError):
        transformers.TrainingArguments(**kwargs)
    with pytest.raises(ValueError):
        mixprec.TrainingArguments(**kwargs)
