"""What transformers' Trainer and the libraries on it (trl) rely on in Accelerate's objects, the
same script under Accelerate and under mixprec, on one process and on two (gloo, torchrun):
``gather_for_metrics`` at a short last batch (map and iterable datasets, a loss repeated to the
batch size as transformers' evaluation loop repeats it), a second ``prepare`` after
``free_memory`` (transformers' second ``train()``), Accelerate's free function
``skip_first_batches`` on a prepared loader (a mid-epoch resume), and the global RNG stream over
three epochs of training and evaluation (``tests/scripts/accelerate_contract.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader

import mixprec

from toys import SCRIPTS, torchrun

accelerate = pytest.importorskip("accelerate")

SCRIPT = SCRIPTS / "accelerate_contract.py"


def _run(lib: str, out, nproc: int) -> list[dict]:
    cmd = [sys.executable, str(SCRIPT), lib, str(out)] if nproc == 1 else torchrun(SCRIPT, lib, str(out), nproc=nproc)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(nproc)]


@pytest.fixture(scope="module", params=[1, pytest.param(2, marks=pytest.mark.slow)], ids=["1-process", "2-processes"])
def records(request, tmp_path_factory):
    n = request.param
    return _run("accelerate", tmp_path_factory.mktemp("acc"), n), _run("mixprec", tmp_path_factory.mktemp("mp"), n)


def test_gather_for_metrics_keeps_what_accelerate_keeps_of_a_short_last_batch(records):
    theirs, ours = records
    for t, o in zip(theirs, ours):
        assert o["gather"] == t["gather"]
        assert len(o["gather"]["map"]["losses"]) == 10  # the loss repeated to 4 rows is cut to the 2 real ones


def test_a_second_prepare_after_free_memory_registers_the_same_objects_again(records):
    theirs, ours = records
    for t, o in zip(theirs, ours):
        assert o["again"]["same"] and t["again"]["same"]
        # Models and optimizers are held again, as Accelerate holds them; the scheduler too, where
        # Accelerate drops it (its prepared scheduler is no LRScheduler, so prepare passes it by).
        assert o["again"]["held"] == [1, 1, 1] and t["again"]["held"][:2] == [1, 1]
        assert (o["again"]["weights"], o["again"]["lr"]) == (t["again"]["weights"], t["again"]["lr"])


def test_accelerates_skip_first_batches_resumes_a_prepared_loader_in_its_epochs_order(records):
    theirs, ours = records
    for t, o in zip(theirs, ours):
        assert o["skip"] == t["skip"]


def test_three_epochs_of_training_and_evaluation_draw_the_global_rng_as_accelerate_does(records):
    theirs, ours = records
    for t, o in zip(theirs, ours):
        assert o["epochs"]["epochs"] == t["epochs"]["epochs"]  # batch order and dropout, epoch after epoch
        assert o["epochs"]["weights"] == t["epochs"]["weights"]
        assert o["epochs"]["rng_after"] == t["epochs"]["rng_after"]


def test_a_loader_that_does_not_shuffle_draws_only_the_workers_base_seed_per_pass():
    acc = mixprec.Accelerator(cpu=True)
    loader = acc.prepare(DataLoader(list(range(10)), batch_size=4))
    torch.manual_seed(0)
    for _ in loader:
        pass
    after = torch.rand(1)
    torch.manual_seed(0)
    for _ in DataLoader(list(range(10)), batch_size=4):  # torch's own: one draw, the base seed
        pass
    assert torch.equal(after, torch.rand(1))


def test_gradient_states_remainder_is_the_real_samples_of_the_last_round():
    acc = mixprec.Accelerator(cpu=True)
    seen = []
    for batch in acc.prepare(DataLoader(list(range(10)), batch_size=4)):
        seen.append((len(batch), acc.gradient_state.end_of_dataloader, acc.gradient_state.remainder))
    assert seen == [(4, False, 2), (4, False, 2), (2, True, 2)]
    assert acc.gradient_state.remainder == -1  # outside a dataloader
    assert acc.prepare(DataLoader(list(range(10)), batch_size=4, drop_last=True)).remainder == -1
