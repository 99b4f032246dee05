"""A user's own task from two ``"package.module:factory"`` specs: one loader, one contract.

``mixprec train``, ``mixprec bench`` and ``mixprec doctor`` all take ``--model`` and ``--data``
and load them here, so a pair of factories that works for one works for all three.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mixprec.tasks.factory import load_factory
from mixprec.tasks.task import Task

__all__ = ["DATA_CONTRACT", "EVAL_SPLITS", "user_task", "split_data"]

EVAL_SPLITS = ("validation", "eval", "test")
DATA_CONTRACT = ("a dataset, a (train, eval) tuple, or a mapping {'train': ..., 'validation': ...} "
                 "('eval' or 'test' also name the held-out split)")


def user_task(model: str, data: str) -> Task:
    """The task two factories make: ``model()`` builds the model, ``data()`` returns its data.

    The model's forward must return a loss (a tensor, ``.loss`` or ``["loss"]``) when the batch
    holds labels. ``data()`` returns :data:`DATA_CONTRACT`; the samples are collated by the trainer
    (``Task.collate_fn`` is ``None``).

    Args:
        model: ``"package.module:factory"`` of the model factory (called once per model built).
        data: ``"package.module:factory"`` of the data factory (called once, here).

    Raises:
        ValueError: for a malformed spec, or data that does not follow the contract.
        ImportError, AttributeError, TypeError: from :func:`load_factory`, naming the spec.

    Example:
        >>> task = user_task("user_task:model", "user_task:data")  # doctest: +SKIP
        >>> len(task.train_dataset), len(task.eval_dataset)  # doctest: +SKIP
        (448, 64)
    """
    build_model, data_factory = load_factory(model), load_factory(data)
    train, evaluation = split_data(data_factory(), source=data)
    return Task(name=model, build_model=build_model, train_dataset=train, eval_dataset=evaluation, collate_fn=None,
                description=f"{model} on {data}")


def split_data(data: Any, source: str = "the data factory") -> tuple[Any, Any | None]:
    """``(train, eval)`` from what a data factory returned (:data:`DATA_CONTRACT`); eval may be ``None``.

    Example:
        >>> split_data({"train": [1, 2, 3], "validation": [4]})
        ([1, 2, 3], [4])
    """
    if isinstance(data, Mapping):
        if data.get("train") is None:
            raise ValueError(f"{source} returned a mapping without a 'train' split (keys: {', '.join(map(str, data))}); "
                             f"return {DATA_CONTRACT}")
        held_out = [k for k in EVAL_SPLITS if data.get(k) is not None]
        others = sorted(set(map(str, data)) - {"train", *EVAL_SPLITS})
        if not held_out and others:
            raise ValueError(f"{source} returned splits {['train', *others]} but none is held out; name it "
                             f"{' or '.join(map(repr, EVAL_SPLITS))}")
        train, evaluation = data["train"], data[held_out[0]] if held_out else None
    elif isinstance(data, tuple) and len(data) == 2 or _is_pair(data):
        train, evaluation = data
    else:
        train, evaluation = data, None
    if train is None or (hasattr(train, "__len__") and len(train) == 0):
        raise ValueError(f"{source} returned no training samples; return {DATA_CONTRACT}")
    return train, evaluation


def _is_pair(data: Any) -> bool:
    """A two-item list of datasets (lists, torch or Hugging Face datasets), not a list of two samples."""
    return (isinstance(data, list) and len(data) == 2
            and all(isinstance(d, (list, torch.utils.data.Dataset)) or hasattr(d, "column_names") for d in data))
