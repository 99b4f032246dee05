"""One live run per output folder: a lock file holding the owner's pid, taken before the first step.

A folder that cannot be written (permissions, a read-only filesystem) is refused before any
training, with the reason; a lock whose owner is alive is refused with its pid; a lock left by
a process that died (a SIGKILL, a crashed node) is taken over with a warning.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import time
from pathlib import Path

__all__ = ["RunLock"]

_log = logging.getLogger("mixprec")
LOCK_NAME = ".mixprec.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


class RunLock:
    """Hold ``folder``'s lock for the duration of a ``with`` block.

    Raises:
        RuntimeError: the folder is used by a live run (naming its pid), or cannot be written.

    Example:
        >>> import tempfile
        >>> with RunLock(tempfile.mkdtemp()) as lock:
        ...     lock.path.name
        '.mixprec.lock'
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self._held = False

    def _refuse(self, e: OSError) -> RuntimeError:
        why = {errno.EROFS: "it is on a read-only filesystem", errno.EACCES: "permission denied",
               errno.EPERM: "permission denied", errno.ENOSPC: "the disk is full"}.get(e.errno, str(e))
        return RuntimeError(f"output_dir {self.folder} cannot be written ({why}); nothing was trained. Choose a "
                            "writable output_dir (or fix its permissions)")

    def __enter__(self) -> RunLock:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise self._refuse(e) from e
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    owner = json.loads(self.path.read_text())
                except (OSError, ValueError):
                    owner = {}
                pid, host = owner.get("pid"), owner.get("host")
                if isinstance(pid, int) and host == me["host"] and pid != me["pid"] and _alive(pid):
                    raise RuntimeError(
                        f"output_dir {self.folder} is in use by a live run (pid {pid} on {host}, lock {self.path}); "
                        "wait for it to finish, stop it, or choose another output_dir") from None
                if isinstance(pid, int) and host not in (None, me["host"]):
                    raise RuntimeError(
                        f"output_dir {self.folder} is locked by pid {pid} on another host ({host}); if that run is "
                        f"over, delete {self.path}, or choose another output_dir") from None
                _log.warning("mixprec: taking over %s, left by process %s, which is no longer running", self.path, pid)
                self.path.unlink(missing_ok=True)
                continue
            except OSError as e:
                raise self._refuse(e) from e
            with os.fdopen(fd, "w") as fh:
                json.dump(me, fh)
            self._held = True
            return self
        raise RuntimeError(f"could not take the lock {self.path}: another process keeps creating it")

    def __exit__(self, *exc: object) -> None:
        if self._held:
            self.path.unlink(missing_ok=True)
            self._held = False
