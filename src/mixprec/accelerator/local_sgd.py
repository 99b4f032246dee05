"""Local SGD (Accelerate's ``LocalSGD``): each process steps on its own gradients, and the
processes average their parameters every ``local_sgd_steps`` optimizer steps instead of
all-reducing gradients every step: less communication, for slow links between processes.

Example (the loop Accelerate's ``examples/by_feature/local_sgd.py`` writes)::

    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=8) as local_sgd:
        for batch in dataloader:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                optimizer.step()
                optimizer.zero_grad()
                local_sgd.step()
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["LocalSGD"]


class LocalSGD:
    """Average a prepared model's parameters over the processes every ``local_sgd_steps`` calls
    of :meth:`step`, and once more when the block ends; inside the block the model's gradients
    are not synchronised (the Accelerator's ``no_sync``).

    Args:
        accelerator: the :class:`~mixprec.Accelerator` that prepared ``model``.
        model: the prepared model (DDP, or a plain module in one process).
        local_sgd_steps: optimizer steps between two averagings.
        enabled: ``False`` makes the block and :meth:`step` do nothing (gradients synchronise as usual).

    Raises:
        NotImplementedError: for a model sharded with FSDP2 (each process holds only a shard:
            there is nothing local to average); use plain data parallelism.
    """

    def __init__(self, accelerator: Any, model: torch.nn.Module, local_sgd_steps: int, enabled: bool = True) -> None:
        if local_sgd_steps < 1:
            raise ValueError(f"local_sgd_steps must be >= 1, got {local_sgd_steps}")
        self.enabled = enabled and accelerator.num_processes > 1
        if self.enabled and getattr(accelerator.state, "is_fsdp2", False):
            raise NotImplementedError("LocalSGD averages whole parameters; a model sharded with FSDP2 holds only a "
                                      "shard on each process: prepare it without fsdp_plugin (DDP)")
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self.num_steps = 0
        self._no_sync: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._no_sync = self.accelerator.no_sync(self.model)
            self._no_sync.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool | None:
        if self.enabled:
            if exc_type is None:
                self._average()
            no_sync, self._no_sync = self._no_sync, None
            return no_sync.__exit__(exc_type, exc, tb)
        return None

    def step(self) -> None:
        """Count one optimizer step; average the parameters on every ``local_sgd_steps``-th."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average()

    def _average(self) -> None:
        self.accelerator.wait_for_everyone()
        with torch.no_grad():
            for p in self.model.parameters():
                p.data.copy_(self.accelerator.reduce(p.data, reduction="mean"))
