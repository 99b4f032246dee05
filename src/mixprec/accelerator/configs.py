"""The Accelerator's configuration objects, under Hugging Face Accelerate's names and fields.

``ProjectConfiguration``, ``DataLoaderConfiguration`` and ``GradientAccumulationPlugin`` take the
arguments Accelerate's do. The Accelerator also accepts Accelerate's own objects of these names
(it reads their fields), so code that builds them from ``accelerate.utils`` runs unchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from mixprec.checkpoint.folder import numbered_checkpoints

__all__ = ["DataLoaderConfiguration", "GradientAccumulationPlugin", "ProjectConfiguration", "coerce_config"]


@dataclass
class ProjectConfiguration:
    """Where a run keeps its checkpoints and logs (Accelerate's ``ProjectConfiguration``).

    Args:
        project_dir: the run's folder.
        logging_dir: where loggers write; defaults to ``project_dir``.
        automatic_checkpoint_naming: ``save_state()`` without a folder writes
            ``<project_dir>/checkpoints/checkpoint_<iteration>`` and ``load_state()`` without one
            reads the newest of them.
        total_limit: keep at most this many of those checkpoints; the oldest is deleted only
            after the new one is complete (Accelerate deletes it before writing the new one).
        iteration: the number the next automatically named checkpoint gets.
        save_on_each_node: accepted for compatibility (one node per run here).

    Example:
        >>> ProjectConfiguration(project_dir="runs/a", automatic_checkpoint_naming=True, total_limit=2).logging_dir
        'runs/a'
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        if self.logging_dir is None:
            self.logging_dir = self.project_dir
        if self.total_limit is not None and (not isinstance(self.total_limit, int) or self.total_limit < 1):
            raise ValueError(f"total_limit must be None or an int >= 1, got {self.total_limit!r}")

    def set_directories(self, project_dir: str | os.PathLike | None = None) -> None:
        """Set ``project_dir`` (and ``logging_dir`` where it was unset), as Accelerate's does."""
        self.project_dir = None if project_dir is None else str(project_dir)
        if self.logging_dir is None:
            self.logging_dir = self.project_dir

    @property
    def checkpoints_dir(self) -> Path:
        """``<project_dir>/checkpoints``, where automatically named checkpoints go."""
        if self.project_dir is None:
            raise ValueError("automatic_checkpoint_naming needs a project folder: "
                             "Accelerator(project_dir=...) or ProjectConfiguration(project_dir=...)")
        return Path(self.project_dir) / "checkpoints"

    def numbered_checkpoints(self) -> list[Path]:
        """The ``checkpoint_<i>`` folders under :attr:`checkpoints_dir`, oldest (lowest ``i``) first.

        Staging folders of a save in progress or interrupted are not checkpoints and are left out.
        """
        return numbered_checkpoints(self.checkpoints_dir, "checkpoint_", complete=False)


@dataclass
class DataLoaderConfiguration:
    """How prepared dataloaders behave (Accelerate's ``DataLoaderConfiguration``).

    Args:
        split_batches: each batch of the original loader is split over the processes (its
            batch size must divide by their number) instead of each process drawing its own.
        dispatch_batches: process 0 alone reads the original loader, joins one batch per process
            (one batch with ``split_batches``) and sends every process its slice, as Accelerate's
            ``DataLoaderDispatcher`` does (the same batches for the same seed). ``None``: dispatch
            an ``IterableDataset``, shard the batches of any other dataset.
        even_batches: pad the last round with samples from the start so every process gets a
            batch (``gather_for_metrics`` drops the duplicates). ``False``: no padding, some
            processes get one batch fewer (wrap the loop in ``Accelerator.join_uneven_inputs``).
        use_seedable_sampler: accepted; prepared loaders always shuffle from a seed and the
            epoch (``set_epoch(e)`` replays epoch ``e``'s order), the same on every process.
        data_seed: the seed of that shuffle; ``None`` draws it from torch's RNG at ``prepare``.
        non_blocking: copy batches to the device with ``non_blocking=True``.
        use_stateful_dataloader: ``load_state`` restores each loader's position inside its epoch,
            so iteration continues at the next unseen batch. Off by default, as in Accelerate:
            after ``load_state`` an epoch starts at its first batch (in the order of the epoch that
            was running) and the loop skips what it has seen (``skip_first_batches``).

    Example:
        >>> DataLoaderConfiguration(use_stateful_dataloader=True).use_stateful_dataloader
        True
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


@dataclass
class GradientAccumulationPlugin:
    """Gradient accumulation settings (Accelerate's ``GradientAccumulationPlugin``).

    Args:
        num_steps: micro-batches per optimizer step.
        adjust_scheduler: count the accumulation steps in a prepared scheduler's step counter,
            as Accelerate does, for a schedule written in micro-batches.
        sync_with_dataloader: the last batch of a dataloader always steps the optimizer.
        sync_each_batch: all-reduce gradients on every micro-batch (more communication, less memory).
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


def coerce_config(value: Any, cls: type, arg: str) -> Any:
    """``value`` as a ``cls``: ``None`` gives the defaults, a dict its fields, and an object of
    another class with the same field names (Accelerate's own) is read field by field."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    names = [f.name for f in fields(cls)]
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise TypeError(f"{arg}: unknown field(s) {unknown}; {cls.__name__} has {names}")
        return cls(**value)
    if all(hasattr(value, n) for n in names if n not in ("logging_dir", "save_on_each_node")):
        return cls(**{n: getattr(value, n) for n in names if hasattr(value, n)})
    raise TypeError(f"{arg} must be a {cls.__name__} (or a dict of its fields {names}), got {type(value).__name__}")
