"""The anchors' public surface, read from the installed accelerate, transformers and torch: every
public name of their classes and every field of their configs, against mixprec's.

The names mixprec lacks today are listed in ``surface_missing.txt`` (issues 23 and 24 fill them
in). A name mixprec has never goes missing again: a test fails on any missing name not in that
list, and on a listed name that is now present (the list is then stale: delete its line).
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

import mixprec

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

LISTED = Path(__file__).with_name("surface_missing.txt")


def _public(obj: object) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _accelerate_instances() -> tuple[object, object]:
    from accelerate.state import AcceleratorState

    try:
        theirs = accelerate.Accelerator(cpu=True)
        names = (_public(theirs), _public(theirs.state), _public(theirs.gradient_state))
    finally:
        AcceleratorState._reset_state(True)  # Accelerate's process-wide singletons
    ours = mixprec.Accelerator(cpu=True)
    return names, (_public(ours), _public(ours.state), _public(ours.gradient_state))


def surfaces() -> dict[str, tuple[set[str], set[str]]]:
    """What each anchor offers and what mixprec offers, by surface."""
    (acc, state, grad), (m_acc, m_state, m_grad) = _accelerate_instances()
    init = lambda cls: set(inspect.signature(cls.__init__).parameters) - {"self"}  # noqa: E731
    return {
        "accelerate.Accelerator": (acc, m_acc),
        "accelerate.Accelerator()": (init(accelerate.Accelerator), init(mixprec.Accelerator)),
        "accelerator.state": (state, m_state),
        "accelerator.gradient_state": (grad, m_grad),
        "accelerate.DistributedType": (set(accelerate.utils.DistributedType.__members__),
                                       set(mixprec.DistributedType.__members__)),
        **{f"accelerate.{c}": (_fields(getattr(accelerate.utils, c)), _fields(getattr(mixprec, c)))
           for c in ("ProjectConfiguration", "DataLoaderConfiguration", "GradientAccumulationPlugin",
                     "FullyShardedDataParallelPlugin")},
        "transformers.Trainer": (_public(transformers.Trainer), _public(mixprec.Trainer)),
        "transformers.TrainingArguments": (_fields(transformers.TrainingArguments), _fields(mixprec.TrainingArguments)),
        "transformers.TrainerCallback": (_public(transformers.TrainerCallback), _public(mixprec.TrainerCallback)),
        "transformers.TrainerState": (_fields(transformers.TrainerState), _fields(mixprec.TrainerState)),
        "torch.amp.GradScaler": (_public(torch.amp.GradScaler), _public(mixprec.LossScaler)),
    }


def listed() -> set[str]:
    lines = (line.split("#")[0].strip() for line in LISTED.read_text().splitlines())
    return {line for line in lines if line}


def test_no_public_name_of_the_anchors_goes_missing_beyond_the_listed_ones():
    missing = {f"{where} {name}" for where, (theirs, ours) in surfaces().items() for name in theirs - ours}
    counts = {where: f"{len(theirs & ours)}/{len(theirs)}" for where, (theirs, ours) in surfaces().items()}
    print("\n".join(f"{where}: {c}" for where, c in counts.items()))
    assert not missing - listed(), f"names mixprec lost (or the anchor added): {sorted(missing - listed())}"
    assert not listed() - missing, f"present now, delete from {LISTED.name}: {sorted(listed() - missing)}"
