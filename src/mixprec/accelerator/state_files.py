"""The prepared objects of one run, and what ``Accelerator.save_state`` writes of them.

One folder per checkpoint, written atomically by :mod:`mixprec.checkpoint.folder`: model weights as
safetensors, every other state with ``torch.save`` (read back with ``weights_only=True``), one
RNG file per process, the precision plugin's state (the loss scaler's) and the run's counters
and precision (a precision fallback survives a resume).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
from torch.utils.hooks import RemovableHandle

from mixprec.accelerator.configs import ProjectConfiguration
from mixprec.accelerator.wrappers import unwrap
from mixprec.checkpoint import folder as ckpt
from mixprec.distributed import groups as D
from mixprec.distributed.fsdp import load_sharded, save_sharded
from mixprec.nested import tree_leaves

__all__ = ["PendingSave", "PreparedObjects", "StateHooks", "load_accelerator_state", "resolve_load_dir", "resolve_save_dir",
           "save_accelerator_state", "save_model_weights"]

log = logging.getLogger("mixprec")


@dataclass
class PreparedObjects:
    """Everything ``prepare`` returned that a checkpoint holds, in the order it was prepared.

    ``custom`` are the objects given to ``register_for_checkpointing``.
    """

    models: list[torch.nn.Module] = field(default_factory=list)
    optimizers: list[Any] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    dataloaders: list[Any] = field(default_factory=list)
    custom: list[Any] = field(default_factory=list)

    def stateful(self) -> dict[str, list[Any]]:
        """The objects saved with their own ``state_dict()``, by the file name they are saved under."""
        return {"optimizer": self.optimizers, "scheduler": self.schedulers, "dataloader": self.dataloaders,
                "custom": self.custom}


class StateHooks:
    """The hooks registered with ``register_save_state_pre_hook`` / ``register_load_state_pre_hook``."""

    def __init__(self) -> None:
        self.save: OrderedDict[int, Callable[..., None]] = OrderedDict()
        self.load: OrderedDict[int, Callable[..., None]] = OrderedDict()

    def add_save(self, hook: Callable[..., None]) -> RemovableHandle:
        handle = RemovableHandle(self.save)
        self.save[handle.id] = hook
        return handle

    def add_load(self, hook: Callable[..., None]) -> RemovableHandle:
        handle = RemovableHandle(self.load)
        self.load[handle.id] = hook
        return handle

    @staticmethod
    def rotate(project: ProjectConfiguration) -> None:
        """Delete the oldest automatically named checkpoints beyond ``total_limit`` (after a save
        completed, so the newest complete one is never among them)."""
        if project.total_limit is None:
            return
        done = project.numbered_checkpoints()
        for old in done[: max(0, len(done) - project.total_limit)]:
            log.warning("mixprec: deleting %s (total_limit=%d)", old, project.total_limit)
            shutil.rmtree(old, ignore_errors=True)


def resolve_save_dir(output_dir: str | os.PathLike | None, project: ProjectConfiguration) -> Path:
    """Where ``save_state(output_dir)`` writes: ``output_dir``, else the next automatically named checkpoint."""
    if output_dir is not None:
        return Path(output_dir).expanduser()
    if not project.automatic_checkpoint_naming:
        raise ValueError("save_state() needs an output_dir, or a project with automatic checkpoint naming: "
                         "Accelerator(project_config=ProjectConfiguration(project_dir=..., "
                         "automatic_checkpoint_naming=True))")
    final = project.checkpoints_dir / f"checkpoint_{project.iteration}"
    if final.exists():
        raise ValueError(f"checkpoint folder {final} ({project.iteration}) already exists: set "
                         "ProjectConfiguration(iteration=...) to the number the next checkpoint should get")
    return final


def resolve_load_dir(input_dir: str | os.PathLike | None, project: ProjectConfiguration) -> Path:
    """Where ``load_state(input_dir)`` reads: ``input_dir``, else the newest automatically named checkpoint."""
    if input_dir is not None:
        path = Path(input_dir).expanduser()
        if not path.is_dir():
            raise ckpt.CheckpointNotFoundError(f"no checkpoint folder at {path}")
        return path
    if not project.automatic_checkpoint_naming:
        raise ValueError("load_state() needs an input_dir, or a project with automatic checkpoint naming")
    done = [p for p in project.numbered_checkpoints() if ckpt.is_complete_checkpoint(p)]
    if not done:
        raise ckpt.CheckpointNotFoundError(f"no complete checkpoint under {project.checkpoints_dir}")
    return done[-1]


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", str(size), re.I)
    if not m:
        raise ValueError(f"max_shard_size must be bytes or like '500MB' / '10GB', got {size!r}")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    return int(float(m.group(1)) * scale)


def save_model_weights(model: torch.nn.Module, directory: Path, *, max_shard_size: int | str = "10GB",
                       safe_serialization: bool = True, state: dict[str, torch.Tensor] | None = None) -> None:
    """See :meth:`Accelerator.save_model`: one weights file, or shards with an index, each written
    atomically. ``state`` overrides ``model.state_dict()`` (a sharded model's, gathered)."""
    directory.mkdir(parents=True, exist_ok=True)
    limit = _parse_size(max_shard_size)
    state = {k: v.detach().cpu().contiguous() for k, v in (state if state is not None else model.state_dict()).items()}
    seen: dict[tuple[int, int], str] = {}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen and t.numel() > 0:
            continue  # a tied weight: stored once, under its first name, as transformers does
        seen[key] = name
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")

    def write(tensors: dict[str, torch.Tensor], path: Path) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        if safe_serialization:
            safetensors.torch.save_file(tensors, str(tmp), metadata={"format": "pt"})
        else:
            torch.save(tensors, tmp)
        os.replace(tmp, path)

    if len(shards) == 1:
        write(shards[0], directory / f"{stem}.{ext}")
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"{stem}-{i:05d}-of-{len(shards):05d}.{ext}"
        write(shard, directory / fname)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
    index = directory / f"{stem}.{ext}.index.json"
    tmp = index.with_name(f".{index.name}.tmp")
    tmp.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    os.replace(tmp, index)


def save_accelerator_state(output_dir: Path, prepared: PreparedObjects, process: D.ProcessInfo,
                           precision_state: dict[str, Any], meta: dict[str, Any],
                           extra_files: dict[str, str | bytes], hooks: StateHooks | None = None,
                           sharded: bool = False, asynchronous: bool = False, process_group: Any = None,
                           after_commit: Callable[[], None] | None = None) -> PendingSave:
    """See :meth:`Accelerator.save_state`. ``meta`` (the run's counters and precision name) is
    written as ``accelerator.bin``; the main process writes all but the RNG files (and, with
    ``sharded``, the models' and optimizers' shards, which every rank writes with DCP into
    ``model_<i>/``). The staging folder is removed if anything fails, so no half-written
    checkpoint is left. With ``asynchronous`` (sharded only) the shards are written in the
    background and the folder is renamed into place when the last is on disk; the returned
    handle's ``wait()`` blocks until then. ``after_commit`` runs on the main process once the
    checkpoint is in place (rotation)."""
    final = output_dir
    main = process.rank == 0
    # The main process makes the staging folder; every process writes its own RNG state into it.
    tmp = Path(D.broadcast_object(str(ckpt.staging_dir(final)) if main else None))
    try:
        _torch_save(ckpt.rng_state(), tmp / f"random_states_{process.rank}.bin")
        futures = []
        if sharded:
            futures = save_sharded(tmp, [unwrap(m) for m in prepared.models], [o.optimizer for o in prepared.optimizers],
                                   asynchronous=asynchronous, process_group=process_group)
        D.barrier()
        if main:
            models = [] if sharded else list(prepared.models)
            if hooks is not None and hooks.save:
                weights = [unwrap(m).state_dict() for m in models]
                given = list(weights)
                for hook in hooks.save.values():
                    hook(models, weights, str(tmp))  # what the hook writes joins the atomic commit
                models = [m for m, w in zip(prepared.models, given) if any(w is x for x in weights)]
            for i, m in enumerate(models):
                safetensors.torch.save_model(unwrap(m), str(tmp / f"model_{i}.safetensors"))
            for name, objs in prepared.stateful().items():
                if sharded and name == "optimizer":
                    continue  # in the DCP shards, beside their model's
                for i, obj in enumerate(objs):
                    _torch_save(obj.state_dict(), tmp / f"{name}_{i}.bin")
            if precision_state:
                _torch_save(precision_state, tmp / "scaler.bin")
            _torch_save(meta, tmp / "accelerator.bin")
            for name, content in extra_files.items():
                (tmp / name).write_bytes(content.encode() if isinstance(content, str) else content)
    except (OSError, safetensors.SafetensorError) as e:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise explain_write_error(e, final, prepared) from e
    except BaseException:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    def commit() -> None:
        if main:
            ckpt.commit_checkpoint(tmp, final, meta={"num_processes": process.world_size, "precision": meta["precision"]})
            if after_commit is not None:
                after_commit()

    def discard() -> None:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)

    pending = PendingSave(final, futures, commit, discard)
    if not asynchronous:
        pending.wait()
        D.barrier()
    return pending


def _torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` through a Python file: a write that fails (a full disk, a file size limit, EIO)
    raises ``OSError`` with its errno, where torch's own file writer turns it into a RuntimeError
    ("unexpected pos ...") that names no cause."""
    with open(path, "wb") as f:
        torch.save(obj, f)


_FULL = {errno.ENOSPC: "the disk is full", errno.EFBIG: "a file size limit was reached",
         errno.EDQUOT: "the disk quota is exhausted", errno.EIO: "the disk reported an I/O error"}


def checkpoint_bytes(prepared: PreparedObjects) -> int:
    """About how many bytes a checkpoint of ``prepared`` takes: its models' and optimizers' tensors."""
    def nbytes(obj: Any) -> int:
        local = [t.to_local() if hasattr(t, "to_local") else t for t in tree_leaves(obj) if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in local)
    return (sum(nbytes(unwrap(m).state_dict()) for m in prepared.models)
            + sum(nbytes(o.optimizer.state) for o in prepared.optimizers))


def explain_write_error(error: Exception, final: Path, prepared: PreparedObjects) -> OSError:
    """An ``OSError`` (of ``error``'s errno; safetensors' own I/O error too) that says what happened:
    which checkpoint, why, the bytes it needs, that nothing else changed, and the fix."""
    code = getattr(error, "errno", None)
    if code is None and (m := re.search(r"os error (\d+)", str(error))):
        code = int(m.group(1))
    why = _FULL.get(code, getattr(error, "strerror", None) or str(error))
    need = checkpoint_bytes(prepared)
    free = ""
    try:
        free = f"; {shutil.disk_usage(final.parent if final.parent.exists() else '.').free:,} bytes are free there"
    except OSError:
        pass
    msg = (f"the checkpoint {final} was not written: {why} ({error}). It needs about {need:,} bytes{free}. "
           "Nothing was left behind and an earlier checkpoint there is untouched; free space (or raise the "
           "limit) or save elsewhere, then save again")
    return OSError(code, msg)


class PendingSave:
    """A checkpoint being written; it appears at :attr:`path` (renamed into place) only when complete.

    ``wait()`` blocks until it is, and raises what went wrong (the staging folder is then removed).
    """

    def __init__(self, path: Path, futures: list[Any], commit: Callable[[], None], discard: Callable[[], None]) -> None:
        self.path = path
        self._commit, self._discard = commit, discard
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._left = len(futures)
        self.error: BaseException | None = None
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
            if self.error is None:
                self._commit()
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            self.error = e
        if self.error is not None:
            self._discard()
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


def load_accelerator_state(input_dir: Path, prepared: PreparedObjects, process: D.ProcessInfo,
                           device: torch.device, hooks: StateHooks | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """See :meth:`Accelerator.load_state`: verifies, restores the prepared objects and this
    process's RNG; returns the run's ``meta`` and the precision plugin's state (``{}`` if none)."""
    path = input_dir
    ckpt.verify_checkpoint(path)  # before anything is read
    load = ckpt.load_tensor_file
    models = list(prepared.models)
    if hooks is not None:
        for hook in hooks.load.values():
            hook(models, str(path))
    sharded = (path / "model_0").is_dir()  # written by DCP: any number of ranks reads it
    if sharded:
        load_sharded(path, [unwrap(m) for m in models], [o.optimizer for o in prepared.optimizers])
        models = []
    for i, m in enumerate(models):
        safetensors.torch.load_model(unwrap(m), str(path / f"model_{i}.safetensors"), strict=True, device=str(device))
    for name, objs in prepared.stateful().items():
        if sharded and name == "optimizer":
            continue
        for i, obj in enumerate(objs):
            f = path / f"{name}_{i}.bin"
            if not f.exists():
                raise ckpt.CheckpointError(f"{f} is missing: the checkpoint holds fewer {name}s than were prepared")
            obj.load_state_dict(load(f, map_location=device if name == "optimizer" else "cpu"))
    rng = path / f"random_states_{process.rank}.bin"
    if not rng.exists():
        # Written by fewer processes (a resharded resume): every new rank continues from rank 0's RNG.
        log.warning("mixprec: %s was written by fewer processes than this run's %d; process %d continues from "
                    "process 0's random state", path, process.world_size, process.rank)
        rng = path / "random_states_0.bin"
    ckpt.set_rng_state(load(rng))
    precision_state = load(path / "scaler.bin") if (path / "scaler.bin").exists() else {}
    return load(path / "accelerator.bin"), precision_state
