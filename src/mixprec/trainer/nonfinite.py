"""Skipped steps by number, and the input batch behind one: what the Trainer tells about inf/NaN steps.

:class:`SkipRecorder` keeps each optimizer step's skip flag as the precision left it (a host
``bool``, or a device tensor) and reads the tensors once per log, so naming the skipped steps adds
no host sync per step. :func:`find_nonfinite_inputs` looks into the micro-batches of a step that
was skipped (only then) for float inputs holding inf/NaN, and names their rows and dataset indices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SkipRecorder", "BadBatch", "LossSinceLog", "find_nonfinite_inputs", "describe_steps"]


class LossSinceLog:
    """The training loss summed since the last log, on the device, with transformers'
    ``logging_nan_inf_filter`` (a non-finite loss counts as the sum so far over one more than the
    optimizer steps so far), at no per-step cost but a list append.

    The micro-batches' losses are kept as they come and folded into the sum every ``chunk`` of
    them and when the sum is read: the filter's sequential rule, ``S <- S + v`` for a finite loss
    and ``S <- S * (1 + 1 / (1 + k))`` for another (``k`` optimizer steps since the last log), is a
    linear recurrence, folded at once with a cumulative product. No host sync.

    Args:
        total: the sum to start from (a resumed run's), a 0-d tensor on the device.
        nan_inf_filter: apply the filter (``TrainingArguments.logging_nan_inf_filter``).
        chunk: how many losses are kept before they are folded.

    Example:
        >>> acc = LossSinceLog(torch.zeros(()), nan_inf_filter=True)
        >>> acc.add(torch.tensor(2.0), steps=0); acc.add(torch.tensor(float("nan")), steps=1)
        >>> float(acc.total())   # 2 + 2 / (1 + 1)
        3.0
    """

    def __init__(self, total: torch.Tensor, nan_inf_filter: bool, chunk: int = 64) -> None:
        self._sum, self.nan_inf_filter, self.chunk = total, nan_inf_filter, chunk
        self._losses: list[torch.Tensor] = []
        self._steps: list[int] = []

    def add(self, loss: torch.Tensor, steps: int) -> None:
        """Count one micro-batch's (0-d) loss; ``steps``: optimizer steps since the last log before it."""
        self._losses.append(loss)
        self._steps.append(steps)
        if len(self._losses) >= self.chunk:
            self._fold()

    def _fold(self) -> None:
        if not self._losses:
            return
        v = torch.stack(self._losses).to(self._sum.dtype)
        if self.nan_inf_filter:
            finite = torch.isfinite(v)
            k = torch.tensor(self._steps, dtype=v.dtype).to(v.device, non_blocking=True)
            grow = torch.where(finite, torch.ones_like(v), 1 + 1 / (1 + k))
            running = torch.cumprod(grow, 0)
            self._sum = running[-1] * (self._sum + (torch.where(finite, v, torch.zeros_like(v)) / running).sum())
        else:
            self._sum = self._sum + v.sum()
        self._losses, self._steps = [], []

    def total(self) -> torch.Tensor:
        """The sum since the last log (a 0-d tensor on the device; reading its value syncs)."""
        self._fold()
        return self._sum

    def reset(self) -> None:
        """Start a new sum (at a log)."""
        self._sum = torch.zeros_like(self._sum)
        self._losses, self._steps = [], []


class SkipRecorder:
    """The global step numbers of skipped optimizer steps since they were last taken.

    Args:
        known: steps already known to be skipped (a resumed run's, from its checkpoint).

    Example:
        >>> rec = SkipRecorder()
        >>> rec.record(1, False); rec.record(2, torch.tensor(1.0)); rec.record(3, True)
        >>> rec.take(), rec.take()
        ([2, 3], [])
    """

    def __init__(self, known: list[int] | tuple[int, ...] = ()) -> None:
        self._known: list[int] = list(known)
        self._pending: list[tuple[int, torch.Tensor]] = []  # (step, device flag), read at the next take

    def record(self, step: int, flag: bool | torch.Tensor) -> None:
        """Note step ``step``'s skip flag (a host ``bool``, or a device tensor, non-zero when skipped). No sync."""
        if isinstance(flag, torch.Tensor):
            self._pending.append((step, flag))
        elif flag:
            self._known.append(step)

    def steps(self) -> list[int]:
        """The skipped steps recorded since the last :meth:`take`, in order. Syncs once if any flag
        is still on the device (one read for all of them)."""
        if self._pending:
            flags = torch.stack([f.reshape(()).float() for _, f in self._pending]).tolist()
            self._known += [step for (step, _), f in zip(self._pending, flags) if f > 0]
            self._known.sort()
            self._pending.clear()
        return list(self._known)

    def take(self) -> list[int]:
        """:meth:`steps`, then forget them (the next log names only the later ones). Syncs as :meth:`steps`."""
        out = self.steps()
        self._known.clear()
        return out


def describe_steps(steps: list[int], limit: int = 10) -> str:
    """``"step 4"``, ``"steps 3, 4, 9"``, or the first ``limit`` and how many more."""
    shown = ", ".join(map(str, steps[:limit])) + (f", ... ({len(steps) - limit} more)" if len(steps) > limit else "")
    return f"step{'s' if len(steps) > 1 else ''} {shown}"


@dataclass(frozen=True)
class BadBatch:
    """A micro-batch whose float inputs hold inf/NaN.

    Args:
        epoch: the epoch (0-based).
        position: the batch's position in this process's share of the epoch (0-based).
        fields: ``{input name: rows of the batch holding inf/NaN}``.
        indices: ``{input name: the dataset indices of those rows}`` where the sampler tells them.
    """

    epoch: int
    position: int
    fields: dict[str, list[int]]
    indices: dict[str, list[int]] | None

    def __str__(self) -> str:
        parts = []
        for name, rows in self.fields.items():
            where = f"dataset indices {self.indices[name]}" if self.indices else f"rows {rows} of the batch"
            parts.append(f"{name!r} at {where}")
        return f"epoch {self.epoch}, batch {self.position} (0-based): inf/NaN in " + "; ".join(parts)


def _float_tensors(data: Any, name: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(data, torch.Tensor):
        return [(name or "input", data)] if data.is_floating_point() else []
    if isinstance(data, Mapping):
        return [t for k, v in data.items() for t in _float_tensors(v, f"{name}.{k}" if name else str(k))]
    if isinstance(data, (list, tuple)):
        return [t for i, v in enumerate(data) for t in _float_tensors(v, f"{name}[{i}]")]
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        return [t for f in dataclasses.fields(data)
                for t in _float_tensors(getattr(data, f.name), f"{name}.{f.name}" if name else f.name)]
    return []


def find_nonfinite_inputs(batches: list[tuple[int, int, Any]], loader: Any = None) -> list[BadBatch]:
    """The micro-batches among ``batches`` (``(epoch, position, batch)`` each) whose float tensors
    hold inf/NaN, with the rows and, where ``loader`` (a prepared dataloader) knows them, the
    dataset indices of those rows. Syncs once when every input is finite (the usual case: an fp16
    overflow skip), and once per float tensor more when one is not: call it for a skipped step only.

    Example:
        >>> x = torch.ones(4, 2); x[2, 1] = float("nan")
        >>> [str(b) for b in find_nonfinite_inputs([(0, 5, {"x": x, "y": torch.ones(4)})])]
        ["epoch 0, batch 5 (0-based): inf/NaN in 'x' at rows [2] of the batch"]
    """
    tensors = [t for _, _, batch in batches for _, t in _float_tensors(batch)]
    if not tensors or bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all()):
        return []  # one read for all of them
    found = []
    for epoch, position, batch in batches:
        fields: dict[str, list[int]] = {}
        for name, t in _float_tensors(batch):
            bad = ~torch.isfinite(t)
            if t.dim() == 0:
                if bool(bad):
                    fields[name] = [0]
                continue
            rows = bad.reshape(t.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
            if rows:
                fields[name] = rows
        if not fields:
            continue
        indices = None
        known = loader.batch_indices(position) if loader is not None and hasattr(loader, "batch_indices") else None
        if known is not None and all(r < len(known) for rows in fields.values() for r in rows):
            indices = {name: [known[r] for r in rows] for name, rows in fields.items()}
        found.append(BadBatch(epoch, position, fields, indices))
    return found
