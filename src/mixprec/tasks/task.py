"""The one record of a training task: a model factory, its data and, optionally, its metric.

Built-in tasks (:func:`mixprec.tasks.get_task`) and a user's own model and data factories
(:func:`mixprec.tasks.user_task`) both give a :class:`Task`; ``mixprec train``, ``bench`` and
``doctor`` run nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec.data import collate

__all__ = ["Task"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Task:
    """A model, its data and its metric, ready for a Trainer.

    The fields mirror what Hugging Face's ``Trainer`` takes, so a task plugs into either trainer:
    ``compute_metrics`` receives an object with ``.predictions`` and ``.label_ids`` numpy arrays
    (an ``EvalPrediction``), after ``preprocess_logits_for_metrics(logits, labels)`` (when set)
    has reduced each batch's logits on the device.

    Args:
        name: The task's name, with its size (``"pycode/mini"``), or the model factory's spec.
        build_model: Builds a freshly initialised model (seed torch first for a fixed init).
        train_dataset: Training samples.
        eval_dataset: Held-out samples, or ``None`` when the task has none.
        collate_fn: The DataLoader's ``collate_fn`` for both datasets; ``None`` leaves it to the
            trainer (mixprec's Trainer then stacks whole batches of a list or tensor dataset at
            once, with :func:`mixprec.data.collate`).
        compute_metrics: ``EvalPrediction -> {metric: float}``, or ``None`` (the loss only).
        metric_name: The key of ``compute_metrics``'s result that ranks checkpoints (required
            with ``compute_metrics``).
        greater_is_better: Whether a larger ``metric_name`` is better.
        preprocess_logits_for_metrics: Optional ``(logits, labels) -> tensor`` kept instead of
            the logits, so evaluation does not hold every batch's logits in memory.
        description: One line for humans.

    Example:
        >>> task = get_task("digits")
        >>> task.metric_name, task.greater_is_better
        ('accuracy', True)
    """

    name: str
    build_model: Callable[[], nn.Module]
    train_dataset: torch.utils.data.Dataset
    eval_dataset: torch.utils.data.Dataset | None = None
    collate_fn: Callable[[Any], Any] | None = collate
    compute_metrics: Callable[[Any], dict[str, float]] | None = None
    metric_name: str | None = None
    greater_is_better: bool | None = None
    preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if not callable(self.build_model):
            raise TypeError(f"Task.build_model must be callable, got {type(self.build_model).__name__}")
        for field in ("collate_fn", "compute_metrics", "preprocess_logits_for_metrics"):
            value = getattr(self, field)
            if value is not None and not callable(value):
                raise TypeError(f"Task.{field} must be callable or None, got {type(value).__name__}")
        if self.compute_metrics is not None and not self.metric_name:
            raise ValueError("Task.metric_name must name a key returned by compute_metrics, e.g. 'accuracy'")
