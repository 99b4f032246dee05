"""Checkpoint folders that are complete or absent, verified before anything is loaded.

A checkpoint is written into a temporary sibling folder, with a ``manifest.json`` listing each
file's size and sha256, flushed to disk, and only then renamed into place, so a crash mid-save
leaves the previous checkpoint (or none) and never a half-written one. Loading checks the
manifest first, then reads tensors with safetensors or ``torch.load(weights_only=True)``: a
checkpoint never runs code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["CheckpointError", "CheckpointNotFoundError", "commit_checkpoint", "is_complete_checkpoint", "load_tensor_file",
           "numbered_checkpoints", "rotate_checkpoints", "staging_dir", "verify_checkpoint", "write_checkpoint"]

log = logging.getLogger("mixprec")

MANIFEST = "manifest.json"
FORMAT = "mixprec-checkpoint-1"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, altered, or holds something other than tensors."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint folder where one was asked for (a ``FileNotFoundError``, as in Accelerate)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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


def commit_checkpoint(tmp: Path, final: str | os.PathLike, meta: dict[str, Any] | None = None) -> Path:
    """Write the manifest of everything in ``tmp``, flush it all, and rename ``tmp`` to ``final``.

    If ``final`` exists it is replaced only after the new folder is complete.
    """
    final = Path(final)
    files = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        rel = path.relative_to(tmp).as_posix()
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
        files[rel] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    manifest = {"format": FORMAT, "files": files, "meta": meta or {}}
    with open(tmp / MANIFEST, "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(tmp)
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


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder with a readable mixprec manifest (no hashing: cheap)."""
    try:
        with open(Path(path) / MANIFEST) as fh:
            return json.load(fh).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


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
    """Keep the newest ``limit`` complete ``<stem><n>`` folders of ``root`` and those in ``keep``
    (the best one); delete the older ones and the staging folders that crashed saves left. Call
    it after a save completed, so the newest complete checkpoint is never among those deleted."""
    root = Path(root)
    for stale in root.glob(f".{stem}*.tmp-*") if root.is_dir() else ():
        shutil.rmtree(stale, ignore_errors=True)
    if limit is None:
        return
    done = numbered_checkpoints(root, stem)
    kept = set(done[len(done) - limit:] if limit else []) | {Path(k) for k in keep}
    for old in done:
        if old not in kept:
            log.info("mixprec: deleting %s (a limit of %d checkpoints)", old, limit)
            shutil.rmtree(old, ignore_errors=True)


def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Check every file against the manifest; returns the manifest's ``files`` table.

    Raises:
        CheckpointError: naming the folder or the file that is missing, truncated or altered.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointNotFoundError(f"no checkpoint folder at {path}")
    try:
        with open(path / MANIFEST) as fh:
            manifest = json.load(fh)
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no {MANIFEST}: it is not a complete mixprec checkpoint") from None
    except ValueError as e:
        raise CheckpointError(f"{path / MANIFEST} is not valid JSON ({e}); the checkpoint is damaged") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path / MANIFEST} is not a {FORMAT} manifest")
    for rel, entry in manifest["files"].items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f} is missing")
        size = f.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(f"checkpoint file {f} is {size} bytes, the manifest says {entry['size']}: truncated or altered")
        if _sha256(f) != entry["sha256"]:
            raise CheckpointError(f"checkpoint file {f} does not match its sha256 in the manifest: it was altered")
    return manifest["files"]


def load_tensor_file(path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """``torch.load(path, weights_only=True)``, with a refusal that names the file.

    Raises:
        CheckpointError: if the file holds anything but tensors and plain containers (a pickle
            that would run code is refused before it runs).
    """
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, ValueError, EOFError) as e:
        raise CheckpointError(
            f"refusing to load {path}: it holds more than tensors and plain values, or is damaged "
            f"(torch.load(weights_only=True) said: {str(e).splitlines()[0] if str(e) else type(e).__name__})"
        ) from None


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
