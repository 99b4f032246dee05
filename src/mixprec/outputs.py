"""Where the loss is in what a model returns: one rule for every layer that reads it.

Models are duck-typed (a Hugging Face model, a built-in task's model, a plain ``nn.Module``), so
the Trainer, the precision-drift check, the doctor and the bench all find the loss the same way,
here. This module imports nothing of mixprec's, so every layer may use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["extract_loss", "loss_of"]


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
