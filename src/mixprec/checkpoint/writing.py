"""Writing a checkpoint's files: the one mapping of every write failure to an ``OSError`` that
names the checkpoint, and the handle of a checkpoint still being written in the background.

A full disk, a file size limit, an exhausted quota or a failing disk reach us in three shapes:
a plain ``OSError`` (Python's file writes), safetensors' ``SafetensorError`` ("... os error 28"),
and torch's zip writer's ``RuntimeError`` ("[enforce fail at inline_container.cc] . unexpected
pos ...", which names no cause). :func:`explain_write_error` turns each into an ``OSError`` with
its errno, the checkpoint's path, the reason, the bytes it needs and the fix.
"""

from __future__ import annotations

import errno
import logging
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors

__all__ = ["PendingSave", "explain_write_error", "is_write_failure"]

log = logging.getLogger("mixprec")

_TORCH_WRITER = re.compile(r"inline_container|unexpected pos|PytorchStreamWriter|file write failed", re.I)


_FULL = {errno.ENOSPC: "the disk is full", errno.EFBIG: "a file size limit was reached",
         errno.EDQUOT: "the disk quota is exhausted", errno.EIO: "the disk reported an I/O error"}


def is_write_failure(error: BaseException) -> bool:
    """Whether ``error`` is a failed write (an ``OSError``, safetensors' I/O error, or torch's zip
    writer's ``RuntimeError``) rather than a bug to let through."""
    if isinstance(error, (OSError, safetensors.SafetensorError)):
        return True
    return isinstance(error, RuntimeError) and bool(_TORCH_WRITER.search(str(error)))


def _free_bytes(final: Path) -> int | None:
    try:
        return shutil.disk_usage(final.parent if final.parent.exists() else ".").free
    except OSError:
        return None


def explain_write_error(error: BaseException, final: Path, need: int) -> OSError:
    """An ``OSError`` that says what happened: which checkpoint, why (by errno: a full disk, a file
    size limit, a quota, an I/O error), the bytes it needs, that nothing else changed, and the fix.

    The errno is ``error``'s own, or the one safetensors names ("os error 28"); torch's zip writer
    names none, so a failure of it with less free space than the checkpoint needs is ``ENOSPC``
    and any other is ``EIO``.
    """
    code = getattr(error, "errno", None)
    if code is None and (m := re.search(r"os error (\d+)", str(error))):
        code = int(m.group(1))
    free = _free_bytes(final)
    if code is None:
        code = errno.ENOSPC if free is not None and free < need else errno.EIO
    why = _FULL.get(code, getattr(error, "strerror", None) or str(error).splitlines()[0])
    where = f"; {free:,} bytes are free there" if free is not None else ""
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    msg = (f"the checkpoint {final} was not written: {why} ({first}). It needs about {need:,} bytes{where}. "
           "Nothing was left behind and an earlier checkpoint there is untouched; free space (or raise the "
           "limit) or save elsewhere, then save again")
    return OSError(code, msg)


class PendingSave:
    """A checkpoint being written; it appears at :attr:`path` (renamed into place) only when complete.

    When every future is done (at once if there are none), ``finish(error)`` runs, with the first
    error of the writes or ``None``: it gathers the processes' verdicts and commits the folder, or
    removes it and raises. ``wait()`` blocks until then, and raises what went wrong. With
    ``announce`` (a save in the background, that nobody may wait for) a failure is also logged.
    """

    def __init__(self, path: Path, futures: list[Any], finish: Callable[[BaseException | None], None],
                 error: BaseException | None = None, *, announce: bool = True) -> None:
        self.path, self._announce = path, announce
        self._finish_with = finish
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._left = len(futures)
        self.error: BaseException | None = error
        if not futures:
            self._finish()
        for f in futures:
            f.add_done_callback(self._one_done)

    def _one_done(self, future: Any) -> None:
        with self._lock:
            self._left -= 1
            if future.exception() is not None and self.error is None:
                self.error = future.exception()
            last = self._left == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        try:
            self._finish_with(self.error)
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            self.error = e
        if self.error is not None and self._announce:
            log.error("mixprec: the checkpoint %s was not written: %s", self.path, self.error)
        self._done.set()

    def done(self) -> bool:
        """Whether the checkpoint is complete (or failed)."""
        return self._done.is_set()

    def wait(self) -> Path:
        """Block until the checkpoint is in place; re-raise its error if writing it failed."""
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self.path
