"""Which process runs this, under Hugging Face Accelerate's names: a part the Accelerator holds,
and its ``state`` holds the same one (so ``accelerator.set_trigger()`` and
``accelerator.state.set_trigger()`` raise one flag).

Who this process is (``process_index``, ``num_processes``, ...), decorators
(``on_main_process``, ``on_local_main_process``, ``on_last_process``, ``on_process``,
``on_local_process``), ordered sections (``main_process_first``, ``local_main_process_first``)
and the cross-process trigger (``set_trigger`` / ``check_trigger``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mixprec.distributed import groups as D

__all__ = ["PROCESS_API", "Processes", "expose"]


class Processes:
    """Run code on chosen processes, in order, or when any process asks for it.

    Args:
        info: this process's rank, local rank and the world size (from the launcher).
        device: the device collectives' tensors go on (the trigger's all-reduce).

    Example:
        >>> from mixprec.distributed import ProcessInfo
        >>> procs = Processes(ProcessInfo(rank=0, local_rank=0, world_size=1), torch.device("cpu"))
        >>> procs.is_main_process, procs.check_trigger()
        (True, False)
    """

    def __init__(self, info: D.ProcessInfo, device: torch.device) -> None:
        self.info = info
        self.device = device
        self._trigger = False

    @property
    def process_index(self) -> int:
        return self.info.rank

    @property
    def local_process_index(self) -> int:
        return self.info.local_rank

    @property
    def num_processes(self) -> int:
        return self.info.world_size

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    def wait_for_everyone(self) -> None:
        """A barrier across processes (a no-op in one process)."""
        D.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def _first(self, me: bool) -> Iterator[None]:
        if not me:
            self.wait_for_everyone()
        yield
        if me:
            self.wait_for_everyone()

    def main_process_first(self) -> contextlib.AbstractContextManager:
        """Run the body on the main process first, then on the others (e.g. to build a cache once)."""
        return self._first(self.is_main_process)

    def local_main_process_first(self) -> contextlib.AbstractContextManager:
        """Run the body on each node's main process first, then on the others."""
        return self._first(self.is_local_main_process)

    def _only_if(self, function: Callable[..., Any] | None, run: Callable[[], bool]) -> Any:
        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                return fn(*args, **kwargs) if run() else None
            return wrapper
        return decorate if function is None else decorate(function)

    def on_main_process(self, function: Callable[..., Any] | None = None) -> Any:
        """Decorator: ``function`` runs on the main process only (elsewhere it returns ``None``)."""
        return self._only_if(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Callable[..., Any] | None = None) -> Any:
        """Decorator: ``function`` runs on each node's main process only."""
        return self._only_if(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable[..., Any] | None = None) -> Any:
        """Decorator: ``function`` runs on the last process only."""
        return self._only_if(function, lambda: self.is_last_process)

    def on_process(self, function: Callable[..., Any] | None = None, process_index: int | None = None) -> Any:
        """Decorator: ``function`` runs on process ``process_index`` only."""
        if function is not None and process_index is None:
            raise TypeError("on_process() needs process_index=")
        return self._only_if(function, lambda: self.process_index == process_index)

    def on_local_process(self, function: Callable[..., Any] | None = None,
                         local_process_index: int | None = None) -> Any:
        """Decorator: ``function`` runs on local process ``local_process_index`` only."""
        if function is not None and local_process_index is None:
            raise TypeError("on_local_process() needs local_process_index=")
        return self._only_if(function, lambda: self.local_process_index == local_process_index)

    # -- a flag any process can raise, seen by all at the next check --------------------
    def set_trigger(self) -> None:
        """Raise this process's flag; the next :meth:`check_trigger` on every process returns True."""
        self._trigger = True

    def check_trigger(self) -> bool:
        """Whether any process called :meth:`set_trigger` since the last check (an all-reduce;
        resets the flag). Use it to stop every process together, e.g. on a loss that went NaN."""
        flag = torch.tensor(1.0 if self._trigger else 0.0, device=self.device)
        flag = D.reduce(flag, "sum")
        self._trigger = False
        return bool(flag.item() >= 1)


#: What an Accelerator and its ``state`` show of their :class:`Processes` (Accelerate's names).
PROCESS_API = ("process_index", "local_process_index", "num_processes", "is_main_process", "is_local_main_process",
               "is_last_process", "wait_for_everyone", "print", "main_process_first", "local_main_process_first",
               "on_main_process", "on_local_main_process", "on_last_process", "on_process", "on_local_process",
               "set_trigger", "check_trigger")


def expose(names: tuple[str, ...], part: str) -> Callable[[type], type]:
    """Class decorator: each of ``names`` becomes a read-only property forwarding to the same name
    of the part held in attribute ``part`` (its methods come back bound to the part)."""
    def forward(name: str) -> property:
        def get(self: Any) -> Any:
            held = self.__dict__.get(part)
            return getattr(held, name) if held is not None else self.__getattr__(name)
        return property(get, doc=getattr(Processes, name).__doc__)

    def decorate(cls: type) -> type:
        for name in names:
            if name not in cls.__dict__:  # what the class defines itself wins
                setattr(cls, name, forward(name))
        return cls
    return decorate
