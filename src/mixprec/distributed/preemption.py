"""Preemption: SIGTERM (what SLURM, Kubernetes and torchrun's agent send before SIGKILL) asks the
run to stop after the current optimizer step, on every process at the same step.

The signal handler only raises a flag. :meth:`Preemption.requested` reads it, and with several
processes agrees on it with one small all-reduce over a gloo group on the host (no device sync),
so a SIGTERM delivered to one rank, or to all at slightly different moments, stops them together.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch

__all__ = ["PREEMPTED_EXIT_CODE", "Preemption"]

#: The exit status of a run that stopped for a SIGTERM after saving a checkpoint (``EX_TEMPFAIL``:
#: "try again"; resume with ``resume_from_checkpoint=True`` or ``mixprec train --resume``).
PREEMPTED_EXIT_CODE = 75


class Preemption:
    """A context that turns SIGTERM into a flag the training loop checks once per step.

    Example:
        >>> with Preemption() as p:
        ...     p.requested()
        False
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self.signals = signals
        self.received: int | None = None  # the signal this process got, if any
        self._previous: dict[int, Any] = {}
        self._group: Any = None
        self._agreed = False
        self._several: bool | None = None  # whether several processes must agree (known at the first check)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():  # signal handlers live there only
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def requested(self) -> bool:
        """Whether any process was asked to stop (collective with several processes: call it at
        the same point of every process's loop, e.g. after each optimizer step)."""
        if self._agreed:
            return True
        dist = torch.distributed
        if self._several is None:  # asked once: the process group does not change while a loop runs
            self._several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if self._several:
            if self._group is None:
                self._group = dist.new_group(backend="gloo")  # on the host, whatever the device's backend
            flag = torch.tensor([1.0 if self.received is not None else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            self._agreed = bool(flag.item() > 0)
        else:
            self._agreed = self.received is not None
        return self._agreed
