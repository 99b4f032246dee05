"""Checkpoint folders that are complete or absent, verified as they are read.

A checkpoint is written into a temporary sibling folder; every process hashes and fsyncs the
files it writes as it writes them (:mod:`mixprec.checkpoint.integrity`), and the main process
writes the ``manifest.json`` listing each file's size and sha256, flushes it, and only then
renames the folder into place, so a crash mid-save leaves the previous checkpoint (or none) and
never a half-written one. Loading validates the manifest as a whole, then each process checks
the files it reads (:class:`CheckpointReader`), reading tensors with safetensors or
``torch.load(weights_only=True)``: a checkpoint never runs code.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import re
import shutil
import uuid
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from mixprec.checkpoint.integrity import hash_like, sha256_file

__all__ = ["CheckpointError", "CheckpointNotFoundError", "CheckpointReader", "checkpoint_problem", "commit_checkpoint",
           "is_complete_checkpoint", "load_tensor_file", "numbered_checkpoints", "raise_first_problem", "read_manifest",
           "rotate_checkpoints", "staging_dir", "verify_checkpoint", "write_checkpoint"]

log = logging.getLogger("mixprec")

MANIFEST = "manifest.json"
FORMAT = "mixprec-checkpoint-1"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, altered, or holds something other than tensors."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint folder where one was asked for (a ``FileNotFoundError``, as in Accelerate)."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def staging_dir(final: str | os.PathLike) -> Path:
    """A fresh temporary folder beside ``final`` (same filesystem, so the rename is atomic)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def commit_checkpoint(tmp: Path, final: str | os.PathLike, meta: dict[str, Any] | None = None,
                      written: dict[str, dict[str, Any]] | None = None) -> Path:
    """Write the manifest of everything in ``tmp``, flush it, and rename ``tmp`` to ``final``.

    ``written``: the rows (``{"size", "sha256"}``) of files their writers hashed and fsynced as
    they wrote them (every process its own, gathered here); only the files not in it (written by
    a hook, or a plain copy) are fsynced and hashed now. A hard link to a written file takes its
    row. If ``final`` exists it is replaced only after the new folder is complete.
    """
    final = Path(final)
    known = dict(written or {})
    by_inode = {}
    for rel in known:
        try:
            st = (tmp / rel).stat()
        except FileNotFoundError:
            raise CheckpointError(f"{tmp / rel} was reported written but is not in the staging folder: "
                                  "not committed; save again") from None
        by_inode[(st.st_dev, st.st_ino)] = known[rel]
    files = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        rel = path.relative_to(tmp).as_posix()
        st = path.stat()
        entry = known.get(rel) or by_inode.get((st.st_dev, st.st_ino))
        if entry is None:
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
            entry = {"size": st.st_size, "sha256": sha256_file(path)}
        files[rel] = {key: entry[key] for key in ROW_KEYS if key in entry}
    manifest = {"format": FORMAT, "files": files, "meta": meta or {}}
    with open(tmp / MANIFEST, "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    for folder in sorted({p.parent for p in tmp.rglob("*") if p.is_file()} | {tmp}, reverse=True):
        _fsync_dir(folder)
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def write_checkpoint(final: str | os.PathLike, writers: dict[str, Callable[[Path], None]],
                     meta: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint folder atomically: each ``writers[name](path)`` writes one file.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> _ = write_checkpoint(f"{d}/ckpt", {"x.bin": lambda p: torch.save({"x": torch.ones(1)}, p)})
        >>> sorted(verify_checkpoint(f"{d}/ckpt"))
        ['x.bin']
    """
    tmp = staging_dir(final)
    try:
        for name, write in writers.items():
            write(tmp / name)
        return commit_checkpoint(tmp, final, meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


_FIX = "load an earlier checkpoint instead, or restore this folder from a copy"
_HEX = re.compile(r"[0-9a-f]{64}")
#: A manifest row: the file's size, and its sha256, or the sha256 of each ``piece`` bytes of it.
ROW_KEYS = ("size", "sha256", "piece", "sha256_pieces")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the checkpoint folder ``path``, validated as a whole.

    Raises:
        CheckpointNotFoundError: no folder at ``path``.
        CheckpointError: naming the manifest and what is wrong in it (missing, not JSON, not a
            mixprec manifest, a row without a size or sha256, a path leaving the folder...).
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointNotFoundError(f"no checkpoint folder at {path}: check the path (a checkpoint is a folder "
                                      f"with a {MANIFEST})")
    where = path / MANIFEST
    try:
        with open(where, "rb") as fh:
            manifest = json.loads(fh.read())
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no {MANIFEST}: it is not a complete mixprec checkpoint (written by another "
                              f"tool, or damaged); {_FIX}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where} is not valid JSON ({e}): the checkpoint is damaged; {_FIX}") from None
    except OSError as e:
        raise CheckpointError(f"{where} cannot be read ({e}); fix the folder's permissions or {_FIX}") from None

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where} is damaged: {what}; {_FIX}")

    if not isinstance(manifest, dict):
        raise bad(f"it holds a {type(manifest).__name__}, not an object")
    if manifest.get("format") != FORMAT:
        raise bad(f"its format is {manifest.get('format')!r}, not {FORMAT!r}")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise bad("it has no 'files' table")
    for rel, entry in files.items():
        parts = Path(rel).parts
        if not rel or Path(rel).is_absolute() or ".." in parts:
            raise bad(f"the file name {rel!r} leaves the checkpoint folder")
        if not isinstance(entry, dict):
            raise bad(f"the row of {rel} is not an object")
        size, digest = entry.get("size"), entry.get("sha256")
        if not _count(size):
            raise bad(f"the row of {rel} has no valid 'size' (got {size!r})")
        if "sha256_pieces" in entry:  # a large file hashed in pieces (sync_and_hash)
            piece, pieces = entry.get("piece"), entry["sha256_pieces"]
            if not _count(piece) or not piece or not isinstance(pieces, list) or len(pieces) != -(-size // piece) \
                    or not all(isinstance(d, str) and _HEX.fullmatch(d) for d in pieces):
                raise bad(f"the row of {rel} has no valid 'piece' and 'sha256_pieces' (got {piece!r}, {pieces!r})")
        elif not isinstance(digest, str) or not _HEX.fullmatch(digest):
            raise bad(f"the row of {rel} has no valid 'sha256' (got {digest!r})")
    if not isinstance(manifest.get("meta", {}), dict):
        raise bad("its 'meta' is not an object")
    return manifest


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder with a valid mixprec manifest (no hashing: cheap)."""
    try:
        read_manifest(path)
    except CheckpointError:
        return False
    return True


def checkpoint_problem(path: str | os.PathLike, skip: Collection[str] = ()) -> str | None:
    """What makes ``path`` unloadable without reading its files (the manifest, and each file's
    presence and size), or ``None``; a changed byte is found only by hashing (:func:`verify_checkpoint`).
    The files of ``skip`` (names the manifest lists) are not checked: the caller reads others in their place."""
    try:
        for rel, entry in read_manifest(path)["files"].items():
            if rel not in skip:
                _check_size(Path(path), rel, entry)
    except CheckpointError as e:
        return str(e)
    return None


def _check_size(path: Path, rel: str, entry: dict[str, Any]) -> None:
    f = path / rel
    try:
        size = f.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {f} is missing; {_FIX}") from None
    if size != entry["size"]:
        raise CheckpointError(f"checkpoint file {f} is {size} bytes, the manifest says {entry['size']}: truncated "
                              f"or altered; {_FIX}")


def numbered_checkpoints(root: str | os.PathLike, stem: str, *, complete: bool = True) -> list[Path]:
    """The folders ``<stem><n>`` in ``root``, lowest ``n`` first (``stem``: the Trainer's
    ``"checkpoint-"``, Accelerate's ``"checkpoint_"``). Staging folders of a save in progress or
    interrupted are never listed; with ``complete``, only folders with a manifest are.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    pattern = re.compile(re.escape(stem) + r"(\d+)")
    found = sorted((int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := pattern.fullmatch(p.name)))
    return [p for _, p in found if not complete or is_complete_checkpoint(p)]


def rotate_checkpoints(root: str | os.PathLike, stem: str, limit: int | None, keep: tuple[Path, ...] = ()) -> None:
    """Keep at most ``limit`` complete ``<stem><n>`` folders of ``root``, as Hugging Face's Trainer
    keeps them: the newest and the one in ``keep`` (the best) are never deleted, and the oldest
    of the others go until ``limit`` remain (so a limit of 1 with an older best keeps two). While
    fewer than ``limit`` exist, none is deleted. Staging folders that crashed saves left are
    removed. Call it after a save completed, so the newest complete checkpoint is never deleted
    (a ``limit`` below 1 keeps that one alone)."""
    root = Path(root)
    remove_stale(root, stem)
    if limit is None:
        return
    order = numbered_checkpoints(root, stem)
    if not order:
        return
    protected = {order[-1]} | {Path(k) for k in keep if Path(k) in order}
    remaining = len(order)
    for old in order:
        if remaining <= max(limit, len(protected)):
            break
        if old not in protected:
            log.info("mixprec: deleting %s (a limit of %d checkpoints)", old, limit)
            retire_checkpoint(old)
            remaining -= 1


def retire_checkpoint(path: str | os.PathLike) -> None:
    """Delete a checkpoint folder so that it is whole or gone at every moment: it is first renamed
    out of its name (atomic), then removed; a kill during the removal leaves a hidden
    ``.<name>.old-<id>`` folder (which :func:`remove_stale` deletes), never a half-deleted folder
    under a checkpoint's name that still holds its manifest. A folder already gone is no error
    (another process on a shared filesystem retired it)."""
    path = Path(path)
    gone = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
    try:
        os.replace(path, gone)
    except FileNotFoundError:
        return
    _fsync_dir(path.parent)
    shutil.rmtree(gone, ignore_errors=True)


def remove_stale(root: str | os.PathLike, stem: str) -> None:
    """Remove what interrupted saves and deletions of ``<stem><n>`` checkpoints left in ``root``:
    their staging folders (``.<stem><n>.tmp-<id>``) and retired folders (``.<stem><n>.old-<id>``)."""
    root = Path(root)
    for stale in (*root.glob(f".{stem}*.tmp-*"), *root.glob(f".{stem}*.old-*")) if root.is_dir() else ():
        shutil.rmtree(stale, ignore_errors=True)


def verify_checkpoint(path: str | os.PathLike, skip: Collection[str] = ()) -> dict[str, Any]:
    """Check every file against the manifest (size, then sha256), but those of ``skip``; returns
    the manifest's ``files`` table.

    Raises:
        CheckpointError: naming the folder or the file that is missing, truncated or altered.
    """
    reader = CheckpointReader(path)
    reader.check([rel for rel in reader.files if rel not in skip])
    reader.verify()
    return reader.files


def raise_first_problem(verdicts: list[str | None]) -> None:
    """Given every process's verdict on the files it read (``None``: they verify), gathered on
    every process, raise the first problem as a :class:`CheckpointError` naming its process: each
    process raises the same error."""
    failed = [(rank, problem) for rank, problem in enumerate(verdicts) if problem is not None]
    if failed:
        rank, first = failed[0]
        raise CheckpointError(f"process {rank} of {len(verdicts)}: {first}" if len(verdicts) > 1 else first)


class CheckpointReader:
    """A checkpoint folder opened for reading: the manifest validated as a whole (on opening), and
    each file this process reads checked against it as it is read: its size at once, its sha256 on
    a worker thread while the caller reads and parses the same file (one pass over the disk).
    Files this process does not read are not touched.

    Example:
        >>> reader = CheckpointReader(folder)          # doctest: +SKIP
        >>> state = torch.load(reader.check("optimizer_0.bin"), weights_only=True)  # doctest: +SKIP
        >>> reader.verify()                            # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self.files: dict[str, Any] = self.manifest["files"]
        self._hashes: dict[str, Any] = {}

    def check(self, rel: str | Any) -> Path:
        """Start checking ``rel`` (or each name of an iterable of them); returns the (first) path.

        Raises:
            CheckpointError: the file is not in the manifest, is missing, or has the wrong size.
        """
        names = [rel] if isinstance(rel, str) else list(rel)
        for name in names:
            if name not in self.files:
                raise CheckpointError(f"{self.path / name} is not listed in {self.path / MANIFEST}: the checkpoint "
                                      f"does not hold what this run needs (another run's checkpoint?); {_FIX}")
            _check_size(self.path, name, self.files[name])
            if name not in self._hashes:
                self._hashes[name] = hash_like(self.path / name, self.files[name])
        return self.path / names[0] if names else self.path

    def read_bytes(self, rel: str) -> bytes:
        """The whole file ``rel``, verified (for small files: JSON, DCP's metadata)."""
        data = self.check(rel).read_bytes()
        self.verify((rel,))
        return data

    def verify(self, names: Any = None) -> None:
        """Wait for the hashes of the files checked so far (or of ``names``) and compare them.

        Raises:
            CheckpointError: naming every file whose sha256 is not the manifest's.
        """
        bad = []
        for name in list(self._hashes) if names is None else names:
            row = self.files[name]
            if self._hashes[name].result() != row.get("sha256_pieces", row.get("sha256")):
                bad.append(str(self.path / name))
        if bad:
            raise CheckpointError(f"the sha256 of {', '.join(bad)} is not the one in the manifest: the file was "
                                  f"altered or damaged on disk; {_FIX}")


def load_tensor_file(path: str | os.PathLike, map_location: Any = "cpu", *, numpy_arrays: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``, with a refusal that names the file.

    Args:
        numpy_arrays: also admit NumPy arrays and dtypes (what transformers' ``rng_state.pth``
            holds: ``np.random.get_state()``), as transformers reads that file; still nothing
            that runs code.

    Raises:
        CheckpointError: if the file holds anything but tensors and plain containers (a pickle
            that would run code is refused before it runs).
    """
    allowed = torch.serialization.safe_globals(_numpy_globals()) if numpy_arrays else contextlib.nullcontext()
    try:
        with allowed:
            return torch.load(path, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, ValueError, EOFError) as e:
        raise CheckpointError(
            f"refusing to load {path}: it holds more than tensors and plain values, or is damaged "
            f"(torch.load(weights_only=True) said: {str(e).splitlines()[0] if str(e) else type(e).__name__})"
        ) from None


def _numpy_globals() -> list[Any]:
    """The NumPy names an array's pickle refers to (rebuilding an array runs no user code)."""
    import numpy as np

    core = np._core if hasattr(np, "_core") else np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch and (where present) CUDA RNG states, as plain values and tensors
    that ``torch.load(weights_only=True)`` reads back."""
    import random

    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    import random

    import numpy as np

    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
