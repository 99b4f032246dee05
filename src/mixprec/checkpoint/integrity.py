"""The size and sha256 of a checkpoint's files, computed while they are written and while they are read.

Writing: :class:`HashingFile` is a file object whose every write is hashed on a worker thread
while the same bytes go to the disk (``torch.save`` and DCP's writer write through it;
:func:`write_safetensors` streams a safetensors file through it), so no file is read back to
hash it. :class:`WrittenFiles` keeps what one process wrote into a staging folder, and
``fsync``s each file on a background thread while the next is written.

Reading: :func:`hash_in_background` hashes a file on the worker thread while the caller reads
(and parses) the same file: one pass over the disk, the hash beside it rather than after it.

Files another writer wrote (:func:`sync_and_hash`: transformers' Trainer under the switch) are
hashed after the fact; one larger than :data:`PIECE` is hashed in pieces of that size, on every
hashing thread at once (one sha256 stream runs on one core), and its manifest row holds the
sha256 of each piece (``{"size", "piece", "sha256_pieces"}``) instead of the file's.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

__all__ = ["PIECE", "HashingFile", "WrittenFiles", "hash_in_background", "hash_like", "sha256_file", "sync_and_hash",
           "write_safetensors"]

# sha256 releases the GIL on large buffers: hashes run beside the writing or reading thread. One
# worker hashes what is written (a file's writes in order); two hash files being read (one file
# each); one fsyncs in the background (it waits on the disk, not the CPU).
_HASHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mixprec-sha256")
_READ_HASHERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="mixprec-sha256-read")
_SYNCER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mixprec-fsync")
_SMALL = 1 << 20  # writes up to this size are copied and hashed without waiting
#: Files hashed after the fact and larger than this are hashed in pieces of this size, in parallel.
PIECE = 64 << 20
_CHUNK = 64 << 20


def sha256_file(path: str | os.PathLike, start: int = 0, length: int | None = None) -> str:
    """The sha256 of a file (or of its ``length`` bytes from ``start``, a multiple of
    ``mmap.ALLOCATIONGRANULARITY``), read through a memory map (no copy into Python objects)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        length = size - start if length is None else min(length, size - start)
        if length > 0:
            with mmap.mmap(fh.fileno(), length, offset=start, access=mmap.ACCESS_READ) as m, memoryview(m) as view:
                for i in range(0, len(view), _CHUNK):
                    h.update(view[i:i + _CHUNK])
    return h.hexdigest()


class _Pieces:
    """The futures of a file's pieces' hashes, read as one result: the list of their digests."""

    def __init__(self, futures: list[Future[str]]) -> None:
        self._futures = futures

    def result(self) -> list[str]:
        return [f.result() for f in self._futures]


def _hash_pieces(path: str | os.PathLike, size: int, piece: int) -> _Pieces:
    return _Pieces([_READ_HASHERS.submit(sha256_file, path, start, piece) for start in range(0, size, piece)])


def hash_like(path: str | os.PathLike, row: Mapping[str, Any]) -> Any:
    """Start hashing ``path`` the way its manifest ``row`` was hashed: whole (``row["sha256"]``)
    or in pieces (``row["sha256_pieces"]``, each ``row["piece"]`` bytes); ``.result()`` is the
    value to compare with that field."""
    if "sha256_pieces" in row:
        return _hash_pieces(path, row["size"], row["piece"])
    return hash_in_background(path)


def hash_in_background(path: str | os.PathLike) -> Future[str]:
    """Start hashing ``path`` on the worker thread; the future holds its sha256 hex digest."""
    return _READ_HASHERS.submit(sha256_file, path)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def sync_and_hash(root: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """fsync and hash every file under ``root`` that another writer wrote (transformers' Trainer,
    which neither fsyncs nor hashes): each file's fsync runs on the fsync thread while the
    hashing threads read it back from the page cache, so the hash costs little beyond the fsync
    the disk needs anyway. Returns the manifest's rows (``{"size", "sha256"}``) by relative path,
    for :func:`~mixprec.checkpoint.folder.commit_checkpoint`'s ``written``.

    Raises:
        OSError: a failed fsync or read (a full disk can first show here).
    """
    root = Path(root)
    files = sorted(((p, p.stat().st_size) for p in root.rglob("*") if p.is_file()), key=lambda f: -f[1])
    syncs = [_SYNCER.submit(_fsync_file, p) for p, _ in files]
    hashes = {p.relative_to(root).as_posix(): (size, _hash_pieces(p, size, PIECE) if size > PIECE
                                               else _READ_HASHERS.submit(sha256_file, p)) for p, size in files}
    for s in syncs:
        s.result()
    return {rel: {"size": size, "piece": PIECE, "sha256_pieces": digest.result()} if isinstance(digest, _Pieces)
            else {"size": size, "sha256": digest.result()} for rel, (size, digest) in hashes.items()}


class HashingFile:
    """A file open for writing whose size and sha256 are computed as it is written.

    Each large write is hashed on the worker thread while the calling thread writes the same
    buffer, and waited for before ``write`` returns (the caller may free the buffer then); small
    writes are copied and hashed without waiting. ``close()`` fsyncs (unless ``sync=False``, for
    a writer that fsyncs itself) and calls ``on_close(size, sha256)``.

    A failed write (a full disk, a file size limit) is kept and raised by ``close()`` with its
    errno: torch's zip writer would turn an error raised inside its write into "unexpected pos".
    """

    def __init__(self, path: str | os.PathLike, on_close: Callable[[int, str], None] | None = None, *,
                 sync: bool | Callable[[int], None] = True) -> None:
        self.name = str(path)
        self._file = open(path, "wb", buffering=0)  # noqa: SIM115 - closed by close()
        self._hash = hashlib.sha256()
        self._size = 0
        self._on_close, self._sync = on_close, sync
        self._error: OSError | None = None
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        n = view.nbytes
        if n == 0 or self._error is not None:
            return n
        if n <= _SMALL:
            _HASHER.submit(self._hash.update, bytes(view))
            self._write_all(view)
        else:
            hashed = _HASHER.submit(self._hash.update, view)
            try:
                self._write_all(view)
            finally:
                hashed.result()  # the buffer is the caller's: done with it before returning
        self._size += n
        return n

    def _write_all(self, view: memoryview) -> None:
        done = 0
        try:
            while done < len(view):
                done += self._file.write(view[done:])
        except OSError as e:
            if e.filename is None:
                e.filename = self.name  # which file met the full disk
            self._error = e

    def tell(self) -> int:
        return self._size

    def flush(self) -> None:
        pass  # unbuffered: every write is already the operating system's

    def fileno(self) -> int:
        return self._file.fileno()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            digest = _HASHER.submit(self._hash.hexdigest).result()  # one thread: after every update
            if self._error is not None:
                raise self._error
            if callable(self._sync):
                self._sync(os.dup(self._file.fileno()))
            elif self._sync:
                os.fsync(self._file.fileno())
        finally:
            self._file.close()
        if self._on_close is not None:
            self._on_close(self._size, digest)

    def __enter__(self) -> HashingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None and not self.closed:
            self.closed = True
            self._file.close()
            return
        self.close()


class WrittenFiles:
    """What one process wrote into a checkpoint's staging folder ``root``: each file's size and
    sha256 (computed while writing), each file fsynced on a background thread.

    ``entries()`` waits for the fsyncs and returns the manifest's rows of these files.
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self._entries: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._syncs: list[Future[None]] = []

    def rel(self, path: str | os.PathLike) -> str:
        return Path(path).relative_to(self.root).as_posix()

    def open(self, path: str | os.PathLike, *, sync: bool = True) -> HashingFile:
        """A :class:`HashingFile` at ``path`` (inside the folder) recorded here when closed; with
        ``sync``, fsynced in the background (``False``: the writer fsyncs it itself)."""
        rel = self.rel(path)
        return HashingFile(path, lambda size, digest: self.record(rel, size, digest),
                           sync=self._sync_later if sync else False)

    def _sync_later(self, fd: int) -> None:
        def sync() -> None:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        with self._lock:
            self._syncs.append(_SYNCER.submit(sync))

    def record(self, rel: str, size: int, sha256: str) -> None:
        with self._lock:
            self._entries[rel] = {"size": size, "sha256": sha256}

    def rename(self, old: str | os.PathLike, new: str | os.PathLike) -> None:
        """Follow a rename of a recorded file (DCP writes its metadata under a temporary name)."""
        with self._lock:
            entry = self._entries.pop(self.rel(old), None)
            if entry is not None:
                self._entries[self.rel(new)] = entry

    def torch_save(self, obj: Any, name: str) -> None:
        """``torch.save(obj)`` into ``root/name``, hashed as written."""
        with self.open(self.root / name) as fh:
            torch.save(obj, fh)

    def write_bytes(self, name: str, content: bytes) -> None:
        with self.open(self.root / name) as fh:
            fh.write(content)

    def entries(self) -> dict[str, dict[str, Any]]:
        """Every recorded file's ``{"size", "sha256"}``, once all are fsynced (raises a failed fsync)."""
        with self._lock:
            syncs, self._syncs = self._syncs, []
        for s in syncs:
            s.result()
        with self._lock:
            return dict(self._entries)


# safetensors' names of torch's dtypes; a dtype not here is written by safetensors itself (in memory).
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
                       torch.float8_e5m2: "F8_E5M2", torch.complex64: "C64"}


def write_safetensors(tensors: Mapping[str, torch.Tensor], fh: Any, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` to the file object ``fh`` in the safetensors format, streamed tensor by
    tensor (safetensors' own ``save`` would first build the whole file in memory, and
    ``save_file`` takes only a path, which cannot be hashed as it is written).

    The layout is safetensors': an 8-byte little-endian header length, the JSON header padded
    with spaces to 8 bytes, then the tensors' bytes, largest elements first, by name. Tensors
    must not share memory (as for ``safetensors.torch.save``).
    """
    tensors = {k: v.detach() for k, v in tensors.items()}
    if any(t.dtype not in _SAFETENSORS_DTYPES for t in tensors.values()):
        fh.write(safetensors.torch.save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata))
        return
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    fh.write(len(text).to_bytes(8, "little") + text)
    for name in order:
        t = tensors[name]
        if t.numel():
            fh.write(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
