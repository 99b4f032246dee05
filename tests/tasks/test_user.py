"""A user's own task: one contract for what a data factory returns, one loader for every command."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mixprec.apps.bench import BenchConfig
from mixprec.apps.bench.config import build_job
from mixprec.tasks import TaskOptionError, check_task, load_task, split_data

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SAMPLES = [{"x": torch.zeros(2), "y": torch.zeros(1)}] * 6


@pytest.mark.parametrize("data, expected", [
    (SAMPLES, (SAMPLES, None)),
    ((SAMPLES[:4], SAMPLES[4:]), (SAMPLES[:4], SAMPLES[4:])),
    ([SAMPLES[:4], SAMPLES[4:]], (SAMPLES[:4], SAMPLES[4:])),
    ({"train": SAMPLES[:4], "validation": SAMPLES[4:]}, (SAMPLES[:4], SAMPLES[4:])),
    ({"train": SAMPLES[:4], "test": SAMPLES[4:]}, (SAMPLES[:4], SAMPLES[4:])),
    ({"train": SAMPLES}, (SAMPLES, None)),
])
def test_a_data_factory_may_return_a_dataset_a_pair_or_a_mapping_of_splits(data, expected):
    assert split_data(data) == expected


def test_a_list_of_two_samples_is_a_dataset_not_a_pair():
    two = SAMPLES[:2]
    assert split_data(two) == (two, None)


@pytest.mark.parametrize("data, match", [
    ({"validation": SAMPLES}, r"without a 'train' split \(keys: validation\)"),
    ({"train": SAMPLES, "valid": SAMPLES}, r"splits \['train', 'valid'\] but none is held out; name it 'validation'"),
    ([], "returned no training samples"),
])
def test_data_that_breaks_the_contract_is_refused_with_the_fix(data, match):
    with pytest.raises(ValueError, match=match):
        split_data(data, source="mod:data")


def test_the_examples_factory_loads_with_both_splits(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    task = load_task(model="user_task:model", data="user_task:data")
    assert (len(task.train_dataset), len(task.eval_dataset)) == (448, 64)
    assert task.name == "user_task:model" and task.collate_fn is None and task.compute_metrics is None


def test_the_bench_trains_on_the_train_split_of_a_mapping(monkeypatch):
    """The bug of issue 17: the bench took {"train": ..., "validation": ...} for a dataset of 2 samples."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    job = build_job(BenchConfig(model="user_task:model", data="user_task:data", precisions=("fp32",)))
    assert (len(job.train), len(job.eval)) == (448, 64)
    assert "training data" not in job.description


@pytest.mark.parametrize("kwargs, option, match", [
    ({"model": "a.b:c"}, "data", "needs both model and data"),
    ({"model": "a.b", "data": "a:b"}, "model", "must look like 'package.module:factory'"),
    ({"name": "digits", "model": "a:b", "data": "a:c"}, "name", "a user task .* takes no name"),
    ({}, "name", r"say which task: name one of \['pycode', 'digits'\]"),
    ({"name": "digits", "size": "tiny"}, "size", r"unknown option\(s\) \['size'\] for the digits task"),
])
def test_check_task_names_the_key_at_fault(kwargs, option, match):
    with pytest.raises(TaskOptionError, match=match) as info:
        check_task(**kwargs)
    assert info.value.option == option
