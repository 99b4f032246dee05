"""What a model returns and how it is called: one rule for every layer that reads it.

Models are duck-typed (a Hugging Face model, a built-in task's model, a plain ``nn.Module``), so
the Trainer, the precision-drift check, the doctor and the bench all call a model, find its loss
and its logits the same way, here. The built-in models return :class:`ModelOutput`, which reads
like Hugging Face's (``out.loss``, ``out["loss"]``, ``"loss" in out``, ``out[0]``); it is a plain
dataclass rather than a ``dict`` subclass so that ``dataclasses.replace`` (which
``send_to_device`` uses) keeps its type. This module imports nothing of mixprec's, so every
layer may use it.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["CausalLMOutput", "ClassifierOutput", "ModelOutput", "ORIGINAL_FORWARD", "call_model", "extract_logits",
           "extract_loss", "loss_of", "original_forward"]

#: The attribute under which ``Accelerator.prepare`` keeps a model's own forward (see
#: :func:`mixprec.accelerator.accelerator.wrappers.patch_forward`).
ORIGINAL_FORWARD = "_mixprec_original_forward"


def original_forward(model: torch.nn.Module) -> Callable[..., Any]:
    """``model``'s own forward, without the precision around it (its ``forward`` if unpatched)."""
    return getattr(model, ORIGINAL_FORWARD, model.forward)


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


def extract_loss(outputs: Any) -> torch.Tensor | None:
    """The loss in a model's output, or ``None`` when it holds none.

    Looked for in this order: a 0-d tensor is the loss itself (a tensor with dimensions is
    logits, not a loss); a mapping's ``"loss"``; a ``.loss`` attribute that is not ``None``; the
    first item of a tuple or list when it is a 0-d tensor (Hugging Face models with
    ``return_dict=False`` return ``(loss, logits, ...)``); ``outputs["loss"]`` for other objects
    that answer it.

    Example:
        >>> extract_loss({"loss": torch.tensor(0.5), "logits": torch.zeros(2, 3)})
        tensor(0.5000)
        >>> extract_loss(torch.zeros(2, 3)) is None
        True
    """
    if isinstance(outputs, torch.Tensor):
        return outputs if outputs.dim() == 0 else None
    if isinstance(outputs, Mapping):
        return outputs.get("loss")
    loss = getattr(outputs, "loss", None)
    if loss is not None:
        return loss
    if isinstance(outputs, (tuple, list)):
        first = outputs[0] if outputs else None
        return first if isinstance(first, torch.Tensor) and first.dim() == 0 else None
    if hasattr(outputs, "__getitem__") and not isinstance(outputs, (str, bytes)):
        try:
            return outputs["loss"]
        except (KeyError, TypeError, IndexError):
            return None
    return None


def loss_of(outputs: Any) -> torch.Tensor:
    """:func:`extract_loss`, for callers that cannot go on without a loss.

    Raises:
        ValueError: when ``outputs`` holds no loss, saying what the model must return.

    Example:
        >>> loss_of((torch.tensor(2.0), torch.zeros(4)))
        tensor(2.)
    """
    loss = extract_loss(outputs)
    if loss is None:
        raise ValueError(f"the model returned {type(outputs).__name__} without a loss; its forward must return a "
                         "0-d loss tensor, an output with .loss or ['loss'], or a tuple starting with the loss "
                         "(Hugging Face models return one when the batch holds labels)")
    return loss


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
