"""Name the first module whose activations or gradients overflow their dtype.

:class:`OverflowTracer` hooks every submodule. In forward, each output tensor's max magnitude is
reduced on the device (one kernel per tensor: ``vector_norm(ord=inf)``, which propagates NaN, so
the same number answers "non-finite?" and "near the dtype's max?"). For the backward, the forward
hook registers a tensor hook on each output that requires grad, which sees the gradient flowing
into that output. ``end_step`` reads all the maxima back at once and names the first culprit.

Tensor hooks are used for the backward instead of ``register_full_backward_hook``: full backward
hooks wrap a module's outputs in a view-producing autograd function, which makes a following
in-place op (``ReLU(inplace=True)``) raise, so they would change what a model can do.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

import torch

from mixprec.nested import tree_leaves

__all__ = ["OverflowTracer", "TraceEvent"]

_MAX_DEPTH = 4  # how deep the tracer looks into objects' attributes (the containers are walked whole)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TraceEvent:
    """The first module output (or output gradient) that overflowed at one step.

    Args:
        step: the step passed to :meth:`OverflowTracer.end_step`.
        module_path: the module's name in ``model.named_modules()``.
        kind: ``"forward"`` (an activation) or ``"backward"`` (the gradient w.r.t. an output).
        dtype: the tensor's dtype, e.g. ``"float16"``.
        max_abs: its largest magnitude (``inf`` or ``nan`` when non-finite).
        nonfinite: whether it held an inf or a NaN (else it was only above the threshold).
    """

    step: int
    module_path: str
    kind: str
    dtype: str
    max_abs: float
    nonfinite: bool


class OverflowTracer:
    """Find the first module whose output or output gradient is non-finite or near overflow.

    A tensor is flagged when it holds an inf/NaN or when ``max|x| > threshold *
    torch.finfo(x.dtype).max`` (its own dtype: an fp32 activation is compared with fp32's range).
    Hooks only read; no output or gradient is changed. Activations are checked first: the first
    flagged forward output, in the order the modules finished, is the event; if none, the first
    flagged gradient in the order backward reached it.

    Args:
        model: the module whose submodules (``named_modules()``, the root excluded unless it has
            no submodules) are traced.
        threshold: fraction of the dtype's max above which a finite tensor is flagged, in (0, 1].
        enabled: ``False`` registers no hooks at all; every method is then a no-op.
        history: how many events :attr:`events` keeps.

    The per-tensor maxima stay on the device until :meth:`end_step`, which syncs once. Call
    it once per step (after backward); records pile up until then.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> with OverflowTracer(model) as tracer:
        ...     model(torch.full((2, 4), float("inf"))).sum().backward()
        ...     event = tracer.end_step(0)
        >>> event.module_path, event.kind, event.nonfinite
        ('0', 'forward', True)
    """

    def __init__(self, model: torch.nn.Module, threshold: float = 0.5, enabled: bool = True,
                 *, history: int = 1000) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"OverflowTracer needs a torch.nn.Module, got {type(model).__name__}")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be a number in (0, 1] (0.5 = half the dtype's max), got {threshold!r}")
        if not isinstance(enabled, bool):
            raise ValueError(f"enabled must be True or False, got {enabled!r}")
        if not isinstance(history, int) or isinstance(history, bool) or history < 1:
            raise ValueError(f"history must be an int >= 1, got {history!r}")
        self._threshold = float(threshold)
        self._enabled = enabled
        self._handles: list[Any] = []
        self._paths: list[str] = []
        # One entry per traced tensor, in hook order: (module index, kind, dtype, 0-d fp32 max |x|).
        self._forward: list[tuple[int, torch.dtype, torch.Tensor]] = []
        self._backward: list[tuple[int, torch.dtype, torch.Tensor]] = []
        self._events: collections.deque[TraceEvent] = collections.deque(maxlen=history)
        if not enabled:
            return
        modules = [(n, m) for n, m in model.named_modules() if n != ""] or [("", model)]
        for index, (name, module) in enumerate(modules):
            self._paths.append(name)
            self._handles.append(module.register_forward_hook(self._make_forward_hook(index)))

    @property
    def enabled(self) -> bool:
        """Whether hooks were registered."""
        return self._enabled

    @property
    def events(self) -> list[TraceEvent]:
        """The events found by :meth:`end_step` so far (the last ``history``). No sync."""
        return list(self._events)

    def _make_forward_hook(self, index: int):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if not self._handles:  # removed while a forward was running
                return None
            for t in _tensors(output):
                self._forward.append((index, t.dtype, _max_abs(t)))
                if t.requires_grad:
                    t.register_hook(self._make_grad_hook(index))
            return None  # never replace the output

        return hook

    def _make_grad_hook(self, index: int):
        def hook(grad: torch.Tensor) -> None:
            # After remove(), hooks already on this step's outputs may still fire: ignore them.
            if self._handles and grad is not None and grad.is_floating_point() and grad.numel():
                self._backward.append((index, grad.dtype, _max_abs(grad)))
            return None  # never replace the gradient

        return hook

    def end_step(self, step: int) -> TraceEvent | None:
        """Name the first overflowing module since the last call, and start a new step. One host sync.

        Returns:
            The :class:`TraceEvent` (also appended to :attr:`events`), or ``None`` when every
            traced tensor was finite and under the threshold (or the tracer is disabled).
        """
        records = self._forward + self._backward
        n_forward = len(self._forward)
        self._forward, self._backward = [], []
        if not records:
            return None
        by_device: dict[torch.device, list[int]] = {}
        for i, r in enumerate(records):
            by_device.setdefault(r[2].device, []).append(i)
        values = [0.0] * len(records)
        for idx in by_device.values():  # one transfer per device (one in the usual case)
            for i, v in zip(idx, torch.stack([records[i][2] for i in idx]).cpu().tolist()):
                values[i] = v
        for i, (index, dtype, _) in enumerate(records):
            v = values[i]
            nonfinite = not math.isfinite(v)
            if nonfinite or v > self._threshold * torch.finfo(dtype).max:
                event = TraceEvent(step=step, module_path=self._paths[index],
                                   kind="forward" if i < n_forward else "backward",
                                   dtype=str(dtype).removeprefix("torch."), max_abs=v, nonfinite=nonfinite)
                self._events.append(event)
                return event
        return None

    def remove(self) -> None:
        """Remove every hook (tensor hooks already registered on this step's outputs die with them)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._forward, self._backward = [], []

    def __enter__(self) -> OverflowTracer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        if not self._enabled:
            return "OverflowTracer(enabled=False)"
        return f"OverflowTracer(modules={len(self._paths)}, threshold={self._threshold}, hooked={bool(self._handles)})"


def _max_abs(t: torch.Tensor) -> torch.Tensor:
    # vector_norm(ord=inf) is max|x| in one kernel, NaN-propagating; dtype=float32 reads fp16/bf16
    # without a separate cast and gives every maximum the same dtype, so they stack.
    return torch.linalg.vector_norm(t.detach(), ord=math.inf, dtype=torch.float32)


def _tensors(obj: Any, depth: int = 0) -> list[torch.Tensor]:
    """The non-empty floating tensors in a module output: any container :mod:`mixprec.nested`
    walks (tuples, dicts, dataclasses, model outputs), and other objects holding tensors as
    attributes, looked into ``_MAX_DEPTH`` objects deep."""
    found = []
    for leaf in tree_leaves(obj):
        if isinstance(leaf, torch.Tensor):
            if leaf.is_floating_point() and leaf.numel() and not leaf.is_sparse:
                found.append(leaf)
        elif (depth < _MAX_DEPTH and hasattr(leaf, "__dict__")
              and not isinstance(leaf, (torch.nn.Module, type, str, bytes, int, float, bool))):
            found += _tensors(list(vars(leaf).values()), depth + 1)
    return found
