"""The collate function shared by the built-in datasets, which fetch whole batches at once."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["collate"]


def collate(batch: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Turn what a DataLoader fetched into a batch dict of stacked tensors.

    torch's ``DataLoader`` calls a dataset's ``__getitems__(indices)`` when it has one and passes
    its result to ``collate_fn``. The built-in datasets return the batch already stacked from
    ``__getitems__`` (one tensor index instead of a Python loop over samples), so this passes a
    dict through and stacks a list of per-sample dicts otherwise. The default
    ``torch.utils.data.default_collate`` would fail on an already-stacked dict: pass
    ``collate_fn=collate`` with these datasets.

    Args:
        batch: A dict of stacked tensors, or a list of per-sample dicts with the same keys.

    Example:
        >>> collate([{"x": torch.tensor(1)}, {"x": torch.tensor(2)}])
        {'x': tensor([1, 2])}
    """
    if isinstance(batch, Mapping):
        return dict(batch)
    if len(batch) == 0:
        raise ValueError("collate() got an empty list of samples; the DataLoader's batch_size must be at least 1")
    first: Any = batch[0]
    if not isinstance(first, Mapping):
        raise TypeError(f"collate() expects a dict or a list of dicts, got a list of {type(first).__name__}; "
                        "use torch.utils.data.default_collate for other sample types")
    return {key: torch.stack([sample[key] for sample in batch]) for key in first}
