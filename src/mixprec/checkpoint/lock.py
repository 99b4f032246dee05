"""One live run per output folder: a lock the kernel holds for the run, taken before the first step.

The lock is ``fcntl.flock`` on ``<folder>/.mixprec.lock``: the kernel releases it when its process
ends, however it ends (a SIGKILL, a crash, a zombie not yet reaped), so a dead run never blocks a
new one and a reused pid is never taken for the run. The file holds the holder's pid and host, for
the message that refuses a second run. In one process the lock is re-entrant (the Trainer and the
Accelerator may both ask for the same folder's).

A folder that cannot be written (permissions, a read-only filesystem) is refused before any
training, with the reason. On a filesystem without locks the lock falls back to the pid in the file
(a live pid on this host refuses; a dead one is taken over), with a warning that says what it
cannot see.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RunLock"]

_log = logging.getLogger("mixprec")
LOCK_NAME = ".mixprec.lock"
#: What flock raises where the filesystem has no locks (some network and FUSE filesystems; Lustre
#: mounted without ``flock`` says ENOSYS).
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}


@dataclass
class _Held:
    """This process's hold on one lock file: the flocked fd (None in the pid fallback) and its holders."""

    fd: int | None
    count: int = 1


_held: dict[Path, _Held] = {}
_guard = threading.Lock()
_warned_no_locks = False


def _forget_after_fork() -> None:
    # A forked child (a dataloader worker) is not the run: it must not count as a holder, nor keep
    # the flock alive after the run dies. Closing its copy of the fd leaves the parent's lock held.
    global _guard
    _guard = threading.Lock()
    for h in _held.values():
        if h.fd is not None:
            try:
                os.close(h.fd)
            except OSError:
                pass
    _held.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _read_owner(fd: int) -> dict:
    try:
        owner = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


class RunLock:
    """Hold ``folder``'s lock for the duration of a ``with`` block.

    Another process holding it (on this host, or on another one where the filesystem shares locks)
    is refused with its pid and host. A lock file left by a run that died is taken over. In one
    process a second ``RunLock`` on the same folder succeeds; the lock is released, and its file
    removed, when the last one exits.

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
        self._key: Path | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now (inside its ``with`` block)."""
        return self._key is not None

    def _refuse(self, e: OSError) -> RuntimeError:
        why = {errno.EROFS: "it is on a read-only filesystem", errno.EACCES: "permission denied",
               errno.EPERM: "permission denied", errno.ENOSPC: "the disk is full"}.get(e.errno, str(e))
        return RuntimeError(f"output_dir {self.folder} cannot be written ({why}); nothing was trained. Choose a "
                            "writable output_dir (or fix its permissions)")

    def _in_use(self, pid: object, host: object) -> RuntimeError:
        who = f"pid {pid} on {host}" if pid is not None else "a process that has not written its pid yet"
        return RuntimeError(f"output_dir {self.folder} is in use by a live run ({who}, lock {self.path}); "
                            "wait for it to finish, stop it, or choose another output_dir")

    def __enter__(self) -> RunLock:
        if self._key is not None:
            raise RuntimeError(f"this RunLock on {self.folder} is already held; use another RunLock object "
                               "to take the same folder's lock again")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            key = self.path.resolve()
        except OSError as e:
            raise self._refuse(e) from e
        with _guard:
            held = _held.get(key)
            if held is not None:  # this process holds it already: one more holder
                held.count += 1
            else:
                _held[key] = _Held(fd=self._take())
        self._key = key
        return self

    def _me(self) -> bytes:
        return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode()

    def _take(self) -> int | None:
        """Take the lock for this process: the flocked fd, or None where the pid fallback took it."""
        for _ in range(100):
            try:
                try:
                    fd, created = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644), True
                except FileExistsError:
                    fd, created = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644), False
            except OSError as e:
                raise self._refuse(e) from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read_owner(fd)
                for _ in range(20):  # the holder writes its pid just after taking the lock
                    if owner.get("pid") is not None:
                        break
                    time.sleep(0.05)
                    owner = _read_owner(fd)
                os.close(fd)
                raise self._in_use(owner.get("pid"), owner.get("host")) from None
            except OSError as e:
                if e.errno not in _NO_LOCKS:
                    os.close(fd)
                    raise self._refuse(e) from e
                return self._take_by_pid(fd, created, e)
            if not _same_file(fd, self.path):
                os.close(fd)  # the holder removed the file as we locked it: lock the path's new file
                continue
            try:
                previous = _read_owner(fd)
                os.ftruncate(fd, 0)
                os.pwrite(fd, self._me(), 0)
            except OSError as e:
                os.close(fd)
                raise self._refuse(e) from e
            if previous.get("pid") is not None:
                _log.info("mixprec: taking over %s, left by pid %s on %s, which no longer holds it", self.path,
                          previous.get("pid"), previous.get("host"))
            return fd
        raise RuntimeError(f"could not take the lock {self.path}: other processes keep removing it; make sure "
                           "only one run uses this output_dir")

    def _take_by_pid(self, fd: int, created: bool, why: OSError) -> None:
        """The fallback where the filesystem has no locks: the pid in the file decides (as before flock)."""
        global _warned_no_locks
        if not _warned_no_locks:
            _warned_no_locks = True
            _log.warning("mixprec: the filesystem of %s has no file locks (%s); the run lock falls back to the pid "
                         "in %s, which cannot see a run on another host nor tell a reused pid from the run: do not "
                         "start two runs on one output_dir", self.folder, why.strerror or why, self.path)
        me = {"pid": os.getpid(), "host": socket.gethostname()}
        try:
            if created:  # made by O_EXCL: this process's
                os.pwrite(fd, self._me(), 0)
                return None
        except OSError as e:
            raise self._refuse(e) from e
        finally:
            os.close(fd)
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
                    raise self._in_use(pid, host) from None
                if isinstance(pid, int) and host not in (None, me["host"]):
                    raise RuntimeError(
                        f"output_dir {self.folder} is locked by pid {pid} on another host ({host}); if that run is "
                        f"over, delete {self.path}, or choose another output_dir") from None
                _log.warning("mixprec: taking over %s, left by process %s, which is no longer running", self.path, pid)
                self.path.unlink(missing_ok=True)
                continue
            except OSError as e:
                raise self._refuse(e) from e
            try:
                os.write(fd, self._me())
            finally:
                os.close(fd)
            return None
        raise RuntimeError(f"could not take the lock {self.path}: another process keeps creating it; make sure "
                           "only one run uses this output_dir")

    def __exit__(self, *exc: object) -> None:
        key, self._key = self._key, None
        if key is None:
            return
        with _guard:
            held = _held.get(key)
            if held is None:  # forgotten after a fork: the parent holds it
                return
            held.count -= 1
            if held.count > 0:
                return
            del _held[key]
            try:
                # Remove the file first, then release: a process that locks the old file in between
                # sees it is no longer at the path and retries on a new one.
                if held.fd is None or _same_file(held.fd, self.path):
                    self.path.unlink(missing_ok=True)
            except OSError:
                pass
            finally:
                if held.fd is not None:
                    os.close(held.fd)
