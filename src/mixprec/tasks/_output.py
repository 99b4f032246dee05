"""The output type of the built-in models: a dataclass that also reads like a dict.

Hugging Face models return a ``ModelOutput``, which code reads as ``out.loss``, ``out["loss"]``,
``"loss" in out`` or ``out[0]``. The built-in models return the same shapes of access so that any
loop written for Hugging Face models runs on them unchanged. This is a plain dataclass rather
than a ``dict`` subclass so that ``dataclasses.replace`` (which ``send_to_device`` uses) keeps
its type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["ModelOutput", "CausalLMOutput", "ClassifierOutput"]


@dataclasses.dataclass(kw_only=True)
class ModelOutput:
    """Base of the model outputs: fields set to ``None`` are absent, as in Hugging Face.

    Keys are the names of the fields that are not ``None``, in declaration order; an integer
    index or a slice reads the tuple of those values (``out[0]`` is the loss when there is one).

    Example:
        >>> out = CausalLMOutput(loss=None, logits=torch.zeros(1, 2, 3))
        >>> "loss" in out, list(out.keys())
        (False, ['logits'])
    """

    def keys(self) -> list[str]:
        """The names of the fields that are set (not ``None``)."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]

    def values(self) -> list[Any]:
        """The values of the fields that are set."""
        return [getattr(self, k) for k in self.keys()]

    def items(self) -> list[tuple[str, Any]]:
        """``(name, value)`` for the fields that are set."""
        return [(k, getattr(self, k)) for k in self.keys()]

    def to_tuple(self) -> tuple[Any, ...]:
        """The values of the fields that are set, as a tuple (Hugging Face's ``to_tuple``)."""
        return tuple(self.values())

    def get(self, key: str, default: Any = None) -> Any:
        """``self[key]`` if that field is set, else ``default``."""
        return getattr(self, key) if key in self else default

    def __getitem__(self, key: str | int | slice) -> Any:
        if isinstance(key, str):
            if key not in self.keys():
                raise KeyError(f"{key!r} is not set in this {type(self).__name__}; the keys set are {self.keys()}")
            return getattr(self, key)
        return self.to_tuple()[key]

    def __contains__(self, key: object) -> bool:
        return key in self.keys()

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())


@dataclasses.dataclass(kw_only=True)
class CausalLMOutput(ModelOutput):
    """What a language model returns.

    Args:
        loss: Mean next-token cross-entropy in nats (float32), when labels were given.
        logits: Scores over the vocabulary, ``[batch, time, vocab]``.
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


@dataclasses.dataclass(kw_only=True)
class ClassifierOutput(ModelOutput):
    """What a classifier returns.

    Args:
        loss: Mean cross-entropy in nats (float32), when labels were given.
        logits: Class scores, ``[batch, num_classes]``.
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
