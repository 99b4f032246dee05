"""Count the host-device syncs in a block of code: the reads that stall the host until the device
has finished everything queued before them.

Two mechanisms, both always on:

* **Reasoning** (any device, the CPU included): a ``TorchFunctionMode`` and a
  ``TorchDispatchMode`` see every read of a tensor's values into Python and every op whose
  output shape depends on the data. On an accelerator each of them copies to the host and
  waits; on the CPU nothing waits, but the same code would, so the CPU counts what *would* be
  a sync there. Counted (each one checked in ``tests/test_syncs.py``):

  - Python reads, named as the method: ``item``, ``__bool__`` (``if t:``, ``while t:``),
    ``__float__``, ``__int__``, ``__index__`` (``range(t)``, ``lst[t]``), ``__complex__``,
    ``__format__`` (``f"{t:.3f}"``), ``__repr__`` (``print(t)``), ``tolist``, ``numpy``,
    ``__array__`` (``np.asarray(t)``);
  - ops, named as the aten op: ``aten._local_scalar_dense`` (a tensor passed where torch wants a
    Python number: ``torch.full(shape, t)``, a read inside a torch Python function such as
    ``Tensor.__contains__``), ``aten.nonzero`` (also ``torch.where(cond)``, ``argwhere``),
    ``aten.masked_select``, ``aten._unique2`` / ``aten.unique_dim`` / ``aten.unique_consecutive``
    (``torch.unique``), ``aten.equal``, ``aten.allclose``, ``aten.bincount``,
    ``aten.repeat_interleave`` with tensor repeats and no ``output_size``, ``aten.index`` and
    ``aten.index_put_`` with a boolean mask (``t[mask]``, ``t[mask] = v``; ``masked_fill`` and
    ``torch.where(cond, a, b)`` do not sync), and, on an accelerator, a blocking copy to the
    host (``.cpu()``, ``.to("cpu")``).

  Pure compute, shapes and metadata (``.shape``, ``len``, ``.device``) are not reads.
* **The device's own word** (CUDA): ``torch.cuda.set_sync_debug_mode("warn")`` makes every
  synchronizing CUDA call warn; each warning is caught (not shown) and counted in
  ``device_events``, which should agree with ``events``.

On an accelerator only tensors on it are counted: a CPU tensor's read waits for nothing. On the
CPU every tensor is "on the device", so tensors that live on the host by design even on an
accelerator must be named in ``ignore=``: torch's optimizers keep ``state[p]["step"]`` on the
CPU (unless fused or capturable) and read it with ``.item()`` every step;
:func:`host_side_tensors` lists them.

Limits: a read inside a torch *Python* function that torch-function modes intercept (most of
``torch.nn.functional``, ``Tensor.__contains__``) runs with the function mode paused, so it is
counted by the dispatch mode under its aten name (a ``tolist``/``numpy`` there goes unseen);
``torch.compile``d code under the modes runs as torch decides for an active dispatch mode;
explicit waits (``torch.cuda.synchronize()``, ``Event.synchronize()``) are not counted by reasoning.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections import Counter
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["count_host_syncs", "host_side_tensors", "HostSyncs", "SyncEvent"]

_T = torch.Tensor
# Python-level reads of a tensor's values, as the function mode sees them.
_PY_READS = {
    _T.item: "item", _T.__bool__: "__bool__", _T.__float__: "__float__", _T.__int__: "__int__",
    _T.__index__: "__index__", _T.__complex__: "__complex__", _T.__format__: "__format__",
    _T.__repr__: "__repr__", _T.tolist: "tolist", _T.numpy: "numpy", _T.__array__: "__array__",
}
_aten = torch.ops.aten
# Ops whose result (a Python number, or an output's size) needs the data on the host.
_DATA_DEPENDENT = {
    _aten._local_scalar_dense, _aten.nonzero, _aten.masked_select, _aten._unique, _aten._unique2,
    _aten.unique_dim, _aten.unique_consecutive, _aten.equal, _aten.allclose, _aten.bincount,
}
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_SYNC_WARNING = "called a synchronizing CUDA operation"


class SyncEvent(NamedTuple):
    """One host-device sync: the read (``"item"``, ``"aten.nonzero"``, ...) and the ``file:line``
    outside torch that made it."""

    what: str
    where: str


class HostSyncs:
    """The syncs counted in one ``with count_host_syncs(...)`` block (see :func:`count_host_syncs`).

    Attributes:
        device: the device whose syncs are counted.
        events: each sync found by reasoning, in order, as :class:`SyncEvent`.
        device_events: on CUDA, each sync CUDA itself reported (``set_sync_debug_mode``); ``None``
            on other devices.
    """

    def __init__(self, device: torch.device | str, ignore: Iterable[torch.Tensor] = ()) -> None:
        self.device = torch.device(device)
        # Identity, not equality: keep the tensors themselves so their ids stay theirs.
        self._ignored = {id(t): t for t in ignore}
        for t in self._ignored.values():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"ignore= takes tensors, got a {type(t).__name__}; pass "
                                "host_side_tensors(optimizer) or a list of tensors")
        self.events: list[SyncEvent] = []
        self.device_events: list[SyncEvent] | None = [] if self.device.type == "cuda" else None
        self._reading = 0  # > 0 while a counted Python read runs: its aten op is the same sync
        self._modes: list[Any] = []
        self._cuda_state: tuple[Any, int] | None = None
        self._entered = False

    @property
    def count(self) -> int:
        """How many syncs the block made (by reasoning; ``device_count`` is CUDA's own count)."""
        return len(self.events)

    @property
    def device_count(self) -> int | None:
        """On CUDA, how many syncs CUDA reported; ``None`` elsewhere."""
        return None if self.device_events is None else len(self.device_events)

    def by_what(self) -> Counter[str]:
        """The events counted by kind: ``Counter({"item": 2, "aten.nonzero": 1})``."""
        return Counter(e.what for e in self.events)

    # -- what counts ---------------------------------------------------------------------
    def _counts(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor) or id(t) in self._ignored:
            return False
        # On an accelerator a host tensor's read waits for nothing; on the CPU every tensor counts.
        return self.device.type == "cpu" or t.device.type != "cpu"

    def _record(self, what: str) -> None:
        self.events.append(SyncEvent(what, _where()))

    def _on_dispatch(self, func: Any, args: tuple, kwargs: dict) -> None:
        if self._reading:
            return
        packet = func.overloadpacket
        if packet in _DATA_DEPENDENT:
            if self._counts(args[0]):
                self._record(f"aten.{packet.__name__}")
        elif packet is _aten.repeat_interleave:
            if isinstance(args[0], torch.Tensor) and kwargs.get("output_size") is None and self._counts(args[0]):
                self._record("aten.repeat_interleave")
        elif packet in (_aten.index, _aten.index_put_, _aten.index_put, _aten._index_put_impl_):
            masks = [i for i in args[1] if i is not None and i.dtype in (torch.bool, torch.uint8)]
            if masks and self._counts(masks[0]):
                self._record(f"aten.{packet.__name__}")
        elif packet in (_aten._to_copy, _aten.copy_) and self.device.type != "cpu":
            src = args[1] if packet is _aten.copy_ else args[0]
            dst_cpu = args[0].device.type == "cpu" if packet is _aten.copy_ else \
                torch.device(kwargs.get("device") or src.device).type == "cpu"
            if src.device.type != "cpu" and dst_cpu and not kwargs.get("non_blocking", False) \
                    and not (packet is _aten.copy_ and len(args) > 2 and args[2]) and self._counts(src):
                self._record(f"aten.{packet.__name__} (device to host)")

    def _on_cuda_warning(self) -> None:
        self.device_events.append(SyncEvent("cuda sync", _where()))

    # -- entering and leaving ----------------------------------------------------------------
    def __enter__(self) -> HostSyncs:
        if self._entered:
            raise RuntimeError("this HostSyncs was already used; call count_host_syncs() again for a new count")
        self._entered = True
        if self.device.type == "cuda":
            self._enter_cuda()
        for mode in (_ReadMode(self), _OpMode(self)):
            mode.__enter__()
            self._modes.append(mode)
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._modes:
            self._modes.pop().__exit__(None, None, None)
        if self._cuda_state is not None:
            catcher, previous_mode = self._cuda_state
            torch.cuda.set_sync_debug_mode(previous_mode)
            catcher.__exit__(None, None, None)
            self._cuda_state = None

    def _enter_cuda(self) -> None:
        catcher = warnings.catch_warnings()  # restores the filters and showwarning on exit
        catcher.__enter__()
        warnings.filterwarnings("always", message=".*" + _SYNC_WARNING)  # every one, not once per line
        previous_show = warnings.showwarning

        def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
            if _SYNC_WARNING in str(message):
                self._on_cuda_warning()
                if getattr(previous_show, "_mixprec_sync_counter", False):  # an enclosing count
                    previous_show(message, category, filename, lineno, file, line)
                return
            previous_show(message, category, filename, lineno, file, line)

        show._mixprec_sync_counter = True
        warnings.showwarning = show
        previous_mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        self._cuda_state = (catcher, previous_mode)

    def __repr__(self) -> str:
        kinds = ", ".join(f"{k}: {n}" for k, n in self.by_what().items())
        device = "" if self.device_count is None else f", device_count={self.device_count}"
        return f"HostSyncs(device={str(self.device)!r}, count={self.count}{device}{' (' + kinds + ')' if kinds else ''})"


class _ReadMode(TorchFunctionMode):
    """Sees the Python-level reads (``item``, ``__bool__``, ``tolist`` ...) and names them."""

    def __init__(self, counter: HostSyncs) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        what = _PY_READS.get(func)
        if what is None:
            return func(*args, **kwargs)
        c = self.counter
        if c._counts(args[0]):
            c._record(what)
        c._reading += 1  # the aten op under it (_local_scalar_dense, _to_copy) is this same read
        try:
            return func(*args, **kwargs)
        finally:
            c._reading -= 1


class _OpMode(TorchDispatchMode):
    """Sees the aten ops: scalar reads made from C++ and the ops with data-dependent shapes."""

    def __init__(self, counter: HostSyncs) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.counter._on_dispatch(func, args, kwargs)
        return func(*args, **kwargs)


def _where() -> str:
    """``file:line`` of the innermost frame outside torch and this module."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(_TORCH_DIR) or name == __file__ or name == warnings.__file__):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def count_host_syncs(device: torch.device | str, *, ignore: Iterable[torch.Tensor] = ()) -> HostSyncs:
    """Count the host-device syncs made inside a ``with`` block (see the module docstring for what counts).

    Reads outside the block are not counted; blocks nest (an outer count includes the inner
    block's syncs); nothing computed inside changes. On CUDA the previous sync-debug mode is
    restored on exit.

    Args:
        device: the device the code runs on (``accelerator.device``). On the CPU every read of
            a tensor's values counts, as it would sync on an accelerator; on CUDA, reads of
            tensors on the device, counted by reasoning and by CUDA itself.
        ignore: tensors that live on the host by design, whose reads are not syncs (matched by
            identity), such as :func:`host_side_tensors` of an optimizer.

    Returns:
        A :class:`HostSyncs` context manager: ``count`` and ``events`` (``device_count`` and
        ``device_events`` on CUDA) fill in as the block runs.

    Example:
        >>> x = torch.tensor([1.0, -2.0, 3.0])
        >>> with count_host_syncs("cpu") as syncs:
        ...     y = x.relu() * 2  # compute: no sync
        ...     if y.sum() > 0:  # __bool__: one sync
        ...         n = y.nonzero()  # a shape that depends on the data: one sync
        >>> syncs.count, [what for what, _ in syncs.events]
        (2, ['__bool__', 'aten.nonzero'])
    """
    return HostSyncs(device, ignore)


def host_side_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The tensors an optimizer keeps on the host by design and reads every step: the CPU
    ``state[p]["step"]`` counters of torch's (non-fused, non-capturable) optimizers and of
    :mod:`mixprec.precision.optim`'s.

    Wrapped optimizers (an Accelerator's prepared optimizer, anything with ``.optimizer``) are
    unwrapped. The counters are made by the first ``step()``: call this after it.

    Args:
        optimizer: a ``torch.optim.Optimizer``, or a wrapper of one.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.AdamW([w], foreach=True)
        >>> w.grad = torch.ones(2); opt.step()
        >>> with count_host_syncs("cpu", ignore=host_side_tensors(opt)) as syncs:
        ...     w.grad = torch.ones(2); opt.step()  # reads its step counter with .item()
        >>> syncs.count
        0
    """
    seen: set[int] = set()
    while hasattr(optimizer, "optimizer") and id(optimizer) not in seen:
        seen.add(id(optimizer))
        optimizer = optimizer.optimizer
    if not hasattr(optimizer, "state"):
        raise TypeError(f"host_side_tensors() takes an optimizer (or a wrapper with .optimizer), "
                        f"got a {type(optimizer).__name__}")
    return [s["step"] for s in optimizer.state.values()
            if isinstance(s.get("step"), torch.Tensor) and s["step"].device.type == "cpu"]
