"""Learning-rate schedules by name, as Hugging Face's ``get_scheduler`` builds them."""

from __future__ import annotations

import math

import torch

__all__ = ["get_scheduler"]


class _Schedule:
    """A multiplier of the base learning rate per step; a plain object, so LambdaLR saves its state."""

    def __init__(self, kind: str, warmup: int, total: int) -> None:
        self.kind, self.warmup, self.total = kind, warmup, max(total, 1)

    def __call__(self, step: int) -> float:
        if self.kind == "constant":
            return 1.0
        if step < self.warmup:
            return step / max(1, self.warmup)
        if self.kind == "constant_with_warmup":
            return 1.0
        progress = (step - self.warmup) / max(1, self.total - self.warmup)
        if self.kind == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))  # cosine


def get_scheduler(name: str, optimizer: torch.optim.Optimizer, num_warmup_steps: int = 0,
                  num_training_steps: int = 1) -> torch.optim.lr_scheduler.LambdaLR:
    """``"linear"``, ``"cosine"``, ``"constant"`` or ``"constant_with_warmup"`` over ``num_training_steps``.

    Example:
        >>> opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0)
        >>> s = get_scheduler("linear", opt, num_warmup_steps=2, num_training_steps=10)
        >>> s.get_last_lr()
        [0.0]
    """
    if name not in ("linear", "cosine", "constant", "constant_with_warmup"):
        raise ValueError(f"unknown scheduler {name!r}; choose linear, cosine, constant or constant_with_warmup")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _Schedule(name, num_warmup_steps, num_training_steps))
