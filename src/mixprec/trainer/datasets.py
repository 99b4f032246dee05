"""Turn what users pass as a dataset into fast batches for the model.

Small models are easily slowed by the input pipeline: torch's default fetches one
``__getitem__`` per sample and collates them in Python. Here a batch is fetched at once where
the dataset allows it: tensor indexing for data held as tensors (lists of dicts are stacked
into columns once, up front), ``__getitems__`` where the dataset has it, and a column slice of
a Hugging Face ``datasets.Dataset``.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

from mixprec.data import collate
from mixprec.models import original_forward
from mixprec.trainer.adapters import model_to_inspect

__all__ = ["collate", "drop_unused_columns", "model_input_names", "prepare_dataset"]  # collate: re-exported from mixprec.data


def model_input_names(model: torch.nn.Module) -> tuple[list[str], bool]:
    """The names ``model.forward`` accepts, and whether its ``**kwargs`` take dataset columns too.

    A peft model's are the names of the model it wraps, as transformers reads them. A transformers
    model's ``**kwargs`` are its attention and loss options, not columns: as transformers does, only
    its named arguments are (a plain module's ``**kwargs`` take every column).
    """
    inspected = model_to_inspect(model)
    params = inspect.signature(original_forward(inspected)).parameters.values()
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return names, any(p.kind is p.VAR_KEYWORD for p in params) and not _is_transformers_model(inspected)


def _is_transformers_model(model: torch.nn.Module) -> bool:
    transformers = sys.modules.get("transformers")  # a transformers model means transformers is imported already
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


class _ColumnDataset(Dataset):
    """Columns of equal-length tensors, fetched a whole batch at a time by tensor indexing."""

    def __init__(self, columns: dict[str, torch.Tensor] | tuple[torch.Tensor, ...]) -> None:
        self.columns = columns
        first = next(iter(columns.values())) if isinstance(columns, dict) else columns[0]
        self.n = len(first)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if isinstance(self.columns, dict):
            return {k: v[i] for k, v in self.columns.items()}
        return tuple(v[i] for v in self.columns)

    def __getitems__(self, indices: Sequence[int]) -> Any:
        idx = torch.as_tensor(indices, dtype=torch.long)
        if isinstance(self.columns, dict):
            return {k: v[idx] for k, v in self.columns.items()}
        return tuple(v[idx] for v in self.columns)


class _HFDataset(Dataset):
    """A Hugging Face ``datasets.Dataset`` in torch format: a batch is one column slice."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds.with_format("torch")

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> Any:
        return self.ds[int(i)]

    def __getitems__(self, indices: Sequence[int]) -> Any:
        batch = self.ds[list(indices)]
        if all(isinstance(v, torch.Tensor) for v in batch.values()):
            return batch  # equal-length columns came back stacked
        return [{k: v[j] for k, v in batch.items()} for j in range(len(indices))]  # ragged: collate per sample


class _DropColumns:
    """A collate function that first drops the keys of each dict sample the model does not take,
    then calls ``collate_fn``: transformers' ``RemoveColumnsCollator``. The dataset stays the
    user's (``dataloader.dataset`` is what was passed), as in transformers. Picklable where
    ``collate_fn`` is (worker processes started by ``spawn``)."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any], allowed: frozenset[str]) -> None:
        self.collate_fn, self.allowed = collate_fn, allowed

    def __call__(self, samples: list[Any]) -> Any:
        return self.collate_fn([{k: v for k, v in s.items() if k in self.allowed} if isinstance(s, Mapping) else s
                                for s in samples])


def _is_hf_dataset(ds: Any) -> bool:
    return hasattr(ds, "column_names") and hasattr(ds, "with_format") and hasattr(ds, "remove_columns")


def _stack_columns(samples: list[Mapping[str, Any]]) -> dict[str, torch.Tensor] | None:
    """A list of dict samples as a dict of stacked tensors, or None where shapes differ."""
    keys = list(samples[0])
    if any(list(s) != keys for s in samples):
        return None
    columns = {}
    for k in keys:
        try:
            values = [torch.as_tensor(s[k]) for s in samples]
            columns[k] = torch.stack(values)
        except (RuntimeError, TypeError, ValueError):
            return None
    return columns


def _kept_columns(model: torch.nn.Module, label_names: list[str]) -> tuple[list[str], frozenset[str] | None]:
    """The names of ``model.forward``'s arguments, and the columns a dataset keeps for it: those
    and the labels (``None``: every column, the forward takes ``**kwargs``)."""
    names, takes_kwargs = model_input_names(model)
    return names, None if takes_kwargs else frozenset(names) | set(label_names) | {"label", "label_ids", "labels"}


def _fetched_by_sample(dataset: Any) -> bool:
    """Whether the loader fetches ``dataset`` one sample at a time (a map-style dataset without
    ``__getitems__``): its unused columns are then dropped from each sample as it is collated."""
    return (not isinstance(dataset, IterableDataset) and hasattr(dataset, "__getitem__")
            and not hasattr(dataset, "__getitems__"))


def drop_unused_columns(collate_fn: Callable[[list[Any]], Any], dataset: Any, model: torch.nn.Module, *,
                        remove_unused_columns: bool, label_names: list[str]) -> Callable[[list[Any]], Any]:
    """``collate_fn``, dropping first the columns ``model`` does not take from each dict sample
    where ``dataset`` (as :func:`prepare_dataset` returned it) is fetched a sample at a time, as
    transformers' ``RemoveColumnsCollator`` does (the other datasets lose them in
    :func:`prepare_dataset`); ``collate_fn`` itself where nothing is to be dropped.

    Example:
        >>> class Net(torch.nn.Module):
        ...     def forward(self, x, labels=None): ...
        >>> fn = drop_unused_columns(lambda s: s, range(1), Net(), remove_unused_columns=True, label_names=[])
        >>> fn([{"x": 1, "labels": 0, "text": "a"}])
        [{'x': 1, 'labels': 0}]
    """
    if not remove_unused_columns or _is_hf_dataset(dataset) or not _fetched_by_sample(dataset):
        return collate_fn
    _, kept = _kept_columns(model, label_names)
    return collate_fn if kept is None else _DropColumns(collate_fn, kept)


def prepare_dataset(dataset: Any, model: torch.nn.Module, *, remove_unused_columns: bool,
                    label_names: list[str], custom_collator: bool) -> Dataset:
    """Adapt ``dataset`` for fast batched fetching and drop the columns the model cannot take (from
    a dataset fetched a sample at a time, which is returned as it is, they are dropped as the
    samples are collated: :func:`drop_unused_columns`).

    Args:
        dataset: a torch ``Dataset``/``IterableDataset``, a list of dicts (or of tuples), or a
            Hugging Face ``datasets.Dataset``.
        model: the model whose ``forward`` signature decides which columns are kept.
        remove_unused_columns: drop columns the forward does not accept (Hugging Face's rule).
        label_names: label columns, always kept.
        custom_collator: the user gave a ``data_collator``; samples are then handed to it one by
            one as dicts, so no stacking is done here.
    """
    names, kept = _kept_columns(model, label_names)

    def keep(column: str) -> bool:
        return not remove_unused_columns or kept is None or column in kept

    if _is_hf_dataset(dataset):
        unused = [c for c in dataset.column_names if not keep(c)]
        if unused and len(unused) == len(dataset.column_names):
            raise ValueError(f"none of the dataset's columns ({', '.join(dataset.column_names)}) is an argument of "
                             f"the model's forward({', '.join(names)}); rename them, or set remove_unused_columns=False")
        if unused:
            dataset = dataset.remove_columns(unused)
        return dataset.with_format("torch") if custom_collator else _HFDataset(dataset)
    if isinstance(dataset, IterableDataset):
        return dataset
    if isinstance(dataset, torch.utils.data.TensorDataset):
        return _ColumnDataset(tuple(dataset.tensors))
    if isinstance(dataset, list) and dataset and not custom_collator:
        if isinstance(dataset[0], Mapping):
            columns = _stack_columns([{k: v for k, v in s.items() if keep(k)} for s in dataset])
            if columns is not None:
                return _ColumnDataset(columns)
        elif isinstance(dataset[0], (tuple, list)):
            try:
                return _ColumnDataset(tuple(torch.stack([torch.as_tensor(s[j]) for s in dataset])
                                            for j in range(len(dataset[0]))))
            except (RuntimeError, TypeError, ValueError):
                pass
    return dataset  # (one fetched a sample at a time loses its unused columns as it is collated)
