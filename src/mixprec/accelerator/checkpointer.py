"""The Accelerator's checkpoints and the trained model out: a part the Accelerator holds.

``save`` / ``load`` write and read everything a bit-for-bit resume needs, through the checkpoint
layer (:mod:`mixprec.checkpoint`): one staging folder per checkpoint, committed once with its
manifest. Model weights as safetensors, every other state with ``torch.save`` (read back with
``weights_only=True``), one RNG file per process, the precision plugin's state (the loss
scaler's) and the run's counters; sharded models through ``torch.distributed.checkpoint``, in the
background with ``async_save``. Also here: the save/load pre-hooks, ``register_for_checkpointing``
and the model out (``unwrap_model``, ``get_state_dict``, ``save_model``).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch.utils.hooks import RemovableHandle

from mixprec.accelerator.configs import ProjectConfiguration
from mixprec.accelerator.prepare import PreparedObjects
from mixprec.accelerator.processes import Processes
from mixprec.accelerator.wrappers import unpatch_forward, unwrap, unwrap_keeping_compile
from mixprec.checkpoint.folder import (
    MANIFEST,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReader,
    commit_checkpoint,
    load_tensor_file,
    numbered_checkpoints,
    raise_first_problem,
    rng_state,
    rotate_checkpoints,
    set_rng_state,
    staging_dir,
)
from mixprec.checkpoint.integrity import WrittenFiles, write_safetensors
from mixprec.checkpoint.lock import RunLock
from mixprec.checkpoint.sharded import load_sharded, save_sharded
from mixprec.checkpoint.weights import save_model_weights, untied
from mixprec.checkpoint.writing import PendingSave, explain_write_error, is_write_failure
from mixprec.distributed import groups as D
from mixprec.distributed.fsdp import full_state_dict, is_sharded
from mixprec.nested import tree_leaves

__all__ = ["Checkpointer", "StateHooks"]

log = logging.getLogger("mixprec")

#: ``finish(folder, written)``: called on the main process before the commit, with the staging
#: folder and the files written by role (``"model"``, ``"optimizer"``, ``"scheduler"``, ``"scaler"``...).
Finish = Callable[[Path, dict[str, list[str]]], None]


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


class Checkpointer:
    """Checkpoints in and out, and the trained model out, for one Accelerator's prepared objects.

    Args:
        processes: who this process is (only the main process writes the shared files).
        prepared: the Accelerator's prepared objects (what a checkpoint holds).
        project: the project configuration (automatic checkpoint naming and ``total_limit``).
        device: where loaded optimizer state goes.
        sharded: whether models are written as DCP shards (FSDP2).
    """

    def __init__(self, *, processes: Processes, prepared: PreparedObjects, project: ProjectConfiguration,
                 device: torch.device, sharded: bool) -> None:
        self.processes, self.prepared, self.project = processes, prepared, project
        self.device, self.sharded = device, sharded
        self.hooks = StateHooks()
        self._pending: PendingSave | None = None
        self._async_group: Any = None

    # -- models out ---------------------------------------------------------------------
    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> torch.nn.Module:
        """See :meth:`Accelerator.unwrap_model`."""
        model = unwrap_keeping_compile(model) if keep_torch_compile else unwrap(model)
        if not keep_fp32_wrapper:
            unpatch_forward(unwrap(model))
        return model

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """See :meth:`Accelerator.get_state_dict`."""
        inner = self.unwrap_model(model, keep_torch_compile=False)
        if is_sharded(inner):
            return full_state_dict(inner)
        return (inner if unwrap else model).state_dict()

    def save_model(self, model: torch.nn.Module, save_directory: str | os.PathLike, max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> Path:
        """See :meth:`Accelerator.save_model`."""
        path = Path(save_directory)
        inner = unwrap(model)
        full = full_state_dict(inner) if is_sharded(inner) else None  # every rank takes part in the gather
        if self.processes.is_main_process:
            save_model_weights(inner, path, max_shard_size=max_shard_size, safe_serialization=safe_serialization,
                               state=full)
        self.processes.wait_for_everyone()
        return path

    def register(self, *objects: Any) -> None:
        """See :meth:`Accelerator.register_for_checkpointing`."""
        bad = [f"- Item at index {i}, `{type(obj).__name__}`" for i, obj in enumerate(objects)
               if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"))]
        if bad:
            raise ValueError("All `objects` must include a `state_dict` and `load_state_dict` function to be stored; "
                             "these do not (wrap a tensor in a torch.nn.Module, or register an object that has "
                             "both):\n" + "\n".join(bad))
        self.prepared.custom.extend(objects)

    # -- where --------------------------------------------------------------------------
    def save_dir(self, output_dir: str | os.PathLike | None) -> Path:
        """Where a save writes: ``output_dir``, else the project's next automatically named checkpoint."""
        if output_dir is not None:
            return Path(output_dir).expanduser()
        project = self.project
        if not project.automatic_checkpoint_naming:
            raise ValueError("save_state() needs an output_dir, or a project with automatic checkpoint naming: "
                             "Accelerator(project_config=ProjectConfiguration(project_dir=..., "
                             "automatic_checkpoint_naming=True))")
        final = project.checkpoints_dir / f"checkpoint_{project.iteration}"
        if final.exists():
            raise ValueError(f"checkpoint folder {final} ({project.iteration}) already exists: set "
                             "ProjectConfiguration(iteration=...) to the number the next checkpoint should get")
        return final

    def load_dir(self, input_dir: str | os.PathLike | None) -> Path:
        """Where a load reads: ``input_dir``, else the project's newest complete checkpoint."""
        if input_dir is not None:
            path = Path(input_dir).expanduser()
            if not path.is_dir():
                raise CheckpointNotFoundError(f"no checkpoint folder at {path}")
            return path
        if not self.project.automatic_checkpoint_naming:
            raise ValueError("load_state() needs an input_dir, or a project with automatic checkpoint naming")
        # The newest, whatever its state: a damaged one fails the load, naming it, rather than being skipped.
        done = numbered_checkpoints(self.project.checkpoints_dir, "checkpoint_", complete=False)
        if not done:
            raise CheckpointNotFoundError(f"no checkpoint under {self.project.checkpoints_dir}: save_state() one first, "
                                          "or pass load_state() the folder of one")
        return done[-1]

    # -- save ---------------------------------------------------------------------------
    def save(self, output_dir: str | os.PathLike | None, *, meta: dict[str, Any], precision_state: dict[str, Any],
             extra_files: dict[str, str | bytes] | None = None, async_save: bool = False,
             finish: Finish | None = None, model_only: bool = False) -> Path:
        """See :meth:`Accelerator.save_state`; ``meta`` (the run's counters and precision) is written
        as ``accelerator.bin``. Every process calls it. The main process writes all but the RNG
        files (and the DCP shards, which every rank writes into ``model_<i>/``), runs ``finish``,
        and commits the folder once. Whatever fails, the staging folder is removed. ``model_only``:
        the models (and ``meta``, ``extra_files``) alone, no optimizer, scheduler, scaler or RNG
        state (a checkpoint to load weights from, not to resume)."""
        self.wait()  # one checkpoint in flight at a time
        final = self.save_dir(output_dir)
        automatic = output_dir is None and self.project.automatic_checkpoint_naming
        lock = self._lock_checkpoints_dir() if automatic else None
        group = None
        if async_save and self.processes.num_processes > 1:
            if self._async_group is None:  # background writes coordinate on their own gloo group
                self._async_group = torch.distributed.new_group(backend="gloo")
            group = self._async_group
        after = (lambda: rotate_checkpoints(self.project.checkpoints_dir, "checkpoint_",
                                            self.project.total_limit)) if automatic else None
        release = (lambda: lock.__exit__(None, None, None)) if lock is not None else None
        self._pending = self._write(final, meta, precision_state, extra_files or {}, sharded=self.sharded or async_save,
                                    asynchronous=async_save, process_group=group, finish=finish, after_commit=after,
                                    release=release, model_only=model_only)
        if automatic:
            self.project.iteration += 1
        return final

    def _lock_checkpoints_dir(self) -> RunLock | None:
        """For an automatically named save, the main process takes the run lock of
        ``<project_dir>/checkpoints`` (the Trainer's lock on ``output_dir``) until the save is
        committed: while it holds it no other live process saves there, so the staging folders
        found there are leftovers of interrupted saves (a SIGKILL mid-save) and are removed. Held
        by another live run: refused on every process (its numbers would mix with this run's)."""
        lock, error = None, None
        if self.processes.is_main_process:
            folder = self.project.checkpoints_dir
            try:
                lock = RunLock(folder).__enter__()
            except RuntimeError as e:
                error = str(e).replace("output_dir", "the checkpoints folder")
            else:
                for stale in folder.iterdir():
                    if stale.is_dir() and _LEFTOVER.fullmatch(stale.name):
                        log.info("mixprec: removing %s, left by an interrupted save", stale)
                        shutil.rmtree(stale, ignore_errors=True)
        error = D.broadcast_object(error)
        if error is not None:
            raise RuntimeError(error)
        return lock

    def _write(self, final: Path, meta: dict[str, Any], precision_state: dict[str, Any],
               extra_files: dict[str, str | bytes], *, sharded: bool, asynchronous: bool, process_group: Any,
               finish: Finish | None, after_commit: Callable[[], None] | None,
               release: Callable[[], None] | None = None, model_only: bool = False) -> PendingSave:
        info = self.processes.info
        main = info.rank == 0
        prepared = self.prepared
        # The main process makes the staging folder; every process writes its own files into it
        # (its RNG state; with DCP, its shards), hashing and fsyncing each as it writes it.
        tmp = Path(D.broadcast_object(str(staging_dir(final)) if main else None))
        written = WrittenFiles(tmp)
        futures: list[Any] = []
        error: BaseException | None = None
        try:
            if not model_only:
                written.torch_save(rng_state(), f"random_states_{info.rank}.bin")
            if sharded:
                futures = save_sharded(tmp, [unwrap(m) for m in prepared.models],
                                       [] if model_only else [o.optimizer for o in prepared.optimizers],
                                       written=written, asynchronous=asynchronous, process_group=process_group)
            # Accelerate's protocol: the save hooks run on every process, before anything is written;
            # a hook that saves a model itself pops its state dict from ``weights``. What a hook
            # writes into the staging folder joins the atomic commit.
            models = [] if sharded else list(prepared.models)
            weights = [unwrap(m).state_dict() for m in models]
            for hook in self.hooks.save.values():
                hook(models, weights, str(tmp))
            if main:
                names = self._write_shared(written, weights, meta, {} if model_only else precision_state,
                                           extra_files, sharded=sharded, model_only=model_only)
                if finish is not None:
                    finish(tmp, names)
        except Exception as e:  # noqa: BLE001 - every process must reach the verdict below
            error = e
        except BaseException:  # an interrupt: no verdict to reach, nothing left behind
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
            if release is not None:
                release()
            raise

        def commit(error: BaseException | None) -> None:
            try:
                verdict(error)
            finally:
                if release is not None:
                    release()

        def verdict(error: BaseException | None) -> None:
            # The one verdict: every process's rows (or its error) gathered on every process.
            rows: dict[str, Any] = {}
            mine = None
            try:
                if error is None:
                    rows = written.entries()
            except Exception as e:  # noqa: BLE001 - a failed fsync: reported like a failed write
                error = e
            if error is not None:
                mine = (explain_write_error(error, final, checkpoint_bytes(prepared))
                        if is_write_failure(error) else error)
            why = None if mine is None else (f"{type(mine).__name__}: {mine}", getattr(mine, "errno", None))
            verdicts = D.all_gather_object((rows, why), group=process_group)
            failed = [(rank, why) for rank, (_, why) in enumerate(verdicts) if why is not None]
            if main and not failed:
                try:
                    every = {rel: row for part, _ in verdicts for rel, row in part.items()}
                    commit_checkpoint(tmp, final, meta={"num_processes": info.world_size,
                                                        "precision": meta["precision"]}, written=every)
                except Exception as e:  # noqa: BLE001 - told to every process below
                    mine = explain_write_error(e, final, checkpoint_bytes(prepared)) if is_write_failure(e) else e
                    failed = [(0, (f"{type(mine).__name__}: {mine}", getattr(mine, "errno", None)))]
            if main and failed:
                shutil.rmtree(tmp, ignore_errors=True)
            failed = D.broadcast_object(failed, group=process_group)
            if mine is not None:
                raise mine from error if mine is not error else None
            if failed:
                rank, (text, code) = failed[0]
                msg = (f"the checkpoint {final} was not written: process {rank} failed ({text}); nothing was left "
                       "behind and an earlier checkpoint there is untouched; fix that process's problem and save again")
                raise OSError(code, msg) if code is not None else RuntimeError(msg)  # a write failure stays one
            if main and after_commit is not None:
                after_commit()

        pending = PendingSave(final, futures, commit, error=error, announce=asynchronous)
        if not asynchronous:
            pending.wait()
        return pending

    def _write_shared(self, written: WrittenFiles, weights: list[dict[str, torch.Tensor]], meta: dict[str, Any],
                      precision_state: dict[str, Any], extra_files: dict[str, str | bytes], *, sharded: bool,
                      model_only: bool = False) -> dict[str, list[str]]:
        """The main process's files (``weights``: the models' state dicts the save hooks left);
        returns their names by role."""
        prepared = self.prepared
        names: dict[str, list[str]] = {}
        tmp = written.root
        for i, state in enumerate(weights):  # what the hooks left, numbered again from 0, as Accelerate does
            with written.open(tmp / f"model_{i}.safetensors") as fh:
                write_safetensors(untied(state), fh, metadata={"format": "pt"})
            names.setdefault("model", []).append(f"model_{i}.safetensors")
        for name, objs in ({} if model_only else prepared.stateful()).items():
            if sharded and name == "optimizer":
                continue  # in the DCP shards, beside their model's
            for i, obj in enumerate(objs):
                written.torch_save(obj.state_dict(), f"{name}_{i}.bin")
                names.setdefault(name, []).append(f"{name}_{i}.bin")
        if precision_state:
            written.torch_save(precision_state, "scaler.bin")
            names["scaler"] = ["scaler.bin"]
        written.torch_save(meta, "accelerator.bin")
        for name, content in extra_files.items():
            written.write_bytes(name, content.encode() if isinstance(content, str) else content)
        return names

    def wait(self) -> Path | None:
        """Block until the checkpoint being written in the background is in place; returns its
        folder (``None`` if none was pending). Raises what made it fail."""
        pending, self._pending = self._pending, None
        return pending.wait() if pending is not None else None

    # -- load ---------------------------------------------------------------------------
    def load(self, input_dir: str | os.PathLike | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """See :meth:`Accelerator.load_state`: restores the prepared objects and this process's RNG;
        returns the run's ``meta`` and the precision plugin's state (``{}`` if none).

        Each process reads only the files it needs, checking each against the manifest as it reads
        it (the sha256 beside the reading), and nothing is restored until every process's files
        verify: the processes agree on the verdict with one collective, so each raises the same
        :class:`CheckpointError` and none waits for one that gave up.

        Load pre-hooks run as in Accelerate: after the files verify, before anything is restored,
        with the prepared models and the folder; a hook that loads a model itself pops it from the
        list, and the models left take the weights files in order (``model_0.safetensors`` for the
        first left, ...). Since a hook may read any file, with load hooks every file of the
        manifest this process could read is verified first (what a save hook kept out of the
        checkpoint is simply not asked for).
        """
        self.wait()
        path = self.load_dir(input_dir)
        prepared = self.prepared
        staged: dict[str, Any] = {}
        problem = None
        reader = None
        try:
            reader = CheckpointReader(path)
            staged = self._read(reader, hooked=bool(self.hooks.load))
        except CheckpointError as e:
            problem = str(e)
        except Exception as e:  # noqa: BLE001 - every process must reach the verdict
            problem = f"could not read {path} ({type(e).__name__}: {e}); load it into a run prepared like the one that saved it"
        raise_first_problem(D.all_gather_object(problem))
        assert reader is not None
        models = list(prepared.models)
        for hook in self.hooks.load.values():
            hook(models, str(path))
        if staged["sharded"]:
            load_sharded(path, [unwrap(m) for m in models], [o.optimizer for o in prepared.optimizers], reader=reader,
                         agree=D.all_gather_object)
            models = []
        if self.hooks.load:  # (checked in _read where there are none)
            _check_weights_held(reader, len(models))
        for i, m in enumerate(models):
            safetensors.torch.load_model(unwrap(m), str(path / f"model_{i}.safetensors"), strict=True,
                                         device=str(self.device))
        for name, states in staged["stateful"].items():
            for obj, state in zip(prepared.stateful()[name], states):
                obj.load_state_dict(state)
        set_rng_state(staged["rng"])
        return staged["meta"], staged["scaler"]

    def _read(self, reader: CheckpointReader, *, hooked: bool = False) -> dict[str, Any]:
        """This process's files of the checkpoint, parsed (nothing restored yet) and verified: the
        hashes run beside the parsing; the models' safetensors are only hashed here (read into the
        models once they verify). ``hooked``: load hooks will run, so which models take weights
        files is known only after them; every file they could read is verified too."""
        path, prepared, info = reader.path, self.prepared, self.processes.info
        sharded = (path / "model_0").is_dir()  # written by DCP: any number of ranks reads it
        if hooked:
            reader.check([f for f in reader.files if _readable_by(f, info.rank)])
        elif not sharded:
            reader.check(_check_weights_held(reader, len(prepared.models)))
        rng = f"random_states_{info.rank}.bin"
        if rng not in reader.files:
            # Written by fewer processes (a resharded resume): every new rank continues from rank 0's RNG.
            log.warning("mixprec: %s was written by fewer processes than this run's %d; process %d continues from "
                        "process 0's random state", path, info.world_size, info.rank)
            rng = "random_states_0.bin"
        stateful: dict[str, list[Any]] = {}
        for name, objs in prepared.stateful().items():
            if sharded and name == "optimizer":
                continue
            for i in range(len(objs)):
                f = f"{name}_{i}.bin"
                if f not in reader.files:
                    raise CheckpointError(f"{path / f} is missing: the checkpoint holds fewer {name}s than were "
                                          f"prepared; load it into a run prepared like the one that saved it")
                where = self.device if name == "optimizer" else "cpu"
                stateful.setdefault(name, []).append(load_tensor_file(reader.check(f), map_location=where))
        staged = {"sharded": sharded, "stateful": stateful, "rng": load_tensor_file(reader.check(rng)),
                  "scaler": load_tensor_file(reader.check("scaler.bin")) if "scaler.bin" in reader.files else {},
                  "meta": load_tensor_file(reader.check("accelerator.bin"))}
        reader.verify()
        return staged


#: A staging folder (``.<name>.tmp-<hex>``) or a replaced checkpoint awaiting removal (``.<name>.old-<hex>``).
_LEFTOVER = re.compile(r"\..+\.(tmp|old)-[0-9a-f]{8}")
_RNG_FILE = re.compile(r"random_states_(\d+)\.bin")
_DCP_DIR = re.compile(r"model_\d+")


def _check_weights_held(reader: CheckpointReader, n: int) -> list[str]:
    """The weights files of ``n`` models to load, which the manifest must list.

    Raises:
        CheckpointError: one is not there, with the usual cause (save and load hooks that do not
            match) and the other (a run prepared otherwise).
    """
    files = [f"model_{i}.safetensors" for i in range(n)]
    missing = [f for f in files if f not in reader.files]
    if missing:
        raise CheckpointError(f"{reader.path / missing[0]} is not listed in {reader.path / MANIFEST}: the checkpoint "
                              f"holds the weights of {n - len(missing)} model(s) and {n} are to be loaded (those the "
                              "load_state pre-hooks left); a load hook must pop each model whose weights a save hook "
                              "popped (and load it itself), or the checkpoint is another run's: load it into a run "
                              "prepared like the one that saved it")
    return files


def _readable_by(rel: str, rank: int) -> bool:
    """Whether process ``rank`` may read the checkpoint file ``rel``: all but the other processes'
    random states and DCP's shards (``model_<i>/``, which the sharded load verifies itself)."""
    rng = _RNG_FILE.fullmatch(rel)
    return not (rng is not None and int(rng.group(1)) != rank) and not _DCP_DIR.fullmatch(rel.split("/")[0])


def checkpoint_bytes(prepared: PreparedObjects) -> int:
    """About how many bytes a checkpoint of ``prepared`` takes: its models' and optimizers' tensors."""
    def nbytes(obj: Any) -> int:
        local = [t.to_local() if hasattr(t, "to_local") else t for t in tree_leaves(obj) if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in local)
    return (sum(nbytes(unwrap(m).state_dict()) for m in prepared.models)
            + sum(nbytes(o.optimizer.state) for o in prepared.optimizers))
