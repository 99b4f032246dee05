"""Calling duck-typed models and reading what they return.

The loss is found by :func:`mixprec.outputs.extract_loss` (re-exported here), the one rule every
layer uses; this module adds what only the Trainer needs: the call, the logits, and gathering
evaluation outputs into numpy arrays.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..nested import tree_map
from ..outputs import extract_loss
from ..wrappers import original_forward

__all__ = ["call_model", "extract_loss", "extract_logits", "nested_concat", "to_numpy"]

_UNEXPECTED = re.compile(r"unexpected keyword argument '(\w+)'")
_MISSING = re.compile(r"missing \d+ required positional arguments?: (.+)$")


def call_model(model: torch.nn.Module, inputs: Any, user_model: torch.nn.Module) -> Any:
    """``model(**inputs)`` for dict batches, ``model(*inputs)`` for tuples, else ``model(inputs)``.

    A batch the model cannot take gets an error naming the column and the model's signature.
    """
    try:
        if isinstance(inputs, Mapping):
            return model(**inputs)
        if isinstance(inputs, (tuple, list)):
            return model(*inputs)
        return model(inputs)
    except TypeError as e:
        text = str(e)
        m = _UNEXPECTED.search(text) or _MISSING.search(text)
        if m is None:
            raise
        forward = original_forward(user_model)
        sig = f"{type(user_model).__name__}.forward{inspect.signature(forward)}"
        have = ", ".join(inputs) if isinstance(inputs, Mapping) else f"{len(inputs)} positional values"
        what = (f"the batch has a column {m.group(1)!r} that {sig} does not accept"
                if m.re is _UNEXPECTED else f"{sig} needs {m.group(1)}, which the batch ({have}) lacks")
        raise ValueError(f"{what}. Rename or drop the column (remove_unused_columns=True drops the ones the "
                         "model does not take), or pass a data_collator that builds the model's inputs") from e


def extract_logits(outputs: Any, ignore_keys: list[str]) -> Any:
    """Everything a model returned except the loss (one tensor, or a tuple of them)."""
    if isinstance(outputs, torch.Tensor):
        return None if outputs.dim() == 0 else outputs
    if isinstance(outputs, Mapping) or hasattr(outputs, "__dataclass_fields__"):
        items = outputs.items() if isinstance(outputs, Mapping) else vars(outputs).items()
        found = tuple(v for k, v in items if k != "loss" and k not in ignore_keys and isinstance(v, torch.Tensor))
    elif isinstance(outputs, (tuple, list)):
        found = tuple(v for v in outputs if isinstance(v, torch.Tensor) and v.dim() > 0)
    else:
        return None
    if not found:
        return None
    return found[0] if len(found) == 1 else found


def _pad_cat(parts: list[torch.Tensor], pad: int = -100) -> torch.Tensor:
    if all(p.shape[1:] == parts[0].shape[1:] for p in parts):
        return torch.cat(parts)
    # Variable sequence lengths across batches: pad as Hugging Face does, with -100.
    dims = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
    out = parts[0].new_full((sum(len(p) for p in parts), *dims), pad)
    row = 0
    for p in parts:
        out[(slice(row, row + len(p)), *[slice(0, s) for s in p.shape[1:]])] = p
        row += len(p)
    return out


def nested_concat(parts: list[Any]) -> Any:
    """Concatenate per-batch tensors (or containers of them, all of one structure) along dim 0."""
    return tree_map(lambda *xs: _pad_cat(list(xs)), parts[0], *parts[1:])


def _numpy(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return np.asarray(x)
    return (x.float() if x.is_floating_point() and x.dtype != torch.float64 else x).numpy()


def to_numpy(x: Any) -> Any:
    """Tensors (or containers of them) as numpy arrays; bf16/fp16 become float32."""
    return tree_map(_numpy, x)
