"""Sharded state through ``torch.distributed.checkpoint`` (DCP): each rank writes its own shards of
each model and of the optimizers holding its parameters, hashing them as it writes; a checkpoint
saved by N ranks loads on M, each rank verifying only the files its load plan reads. DCP writes
its ``.metadata`` with pickle: it is read here by an unpickler that allows only DCP's own record
types, so loading never runs code from a file.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import queue
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import torch

from mixprec.checkpoint.folder import CheckpointError, CheckpointReader, raise_first_problem
from mixprec.checkpoint.integrity import WrittenFiles

__all__ = ["load_sharded", "save_sharded"]

#: Every process's verdict (``None``: its files verify), gathered on every process: one collective.
Agree = Callable[[str | None], list[str | None]]


class _SafeMetadataUnpickler(pickle.Unpickler):
    """DCP writes its ``.metadata`` with pickle; this reads it allowing only DCP's record types,
    torch's dtypes/sizes and builtins, so loading a checkpoint never runs code from it."""

    _ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                        "torch.distributed.checkpoint.planner")

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(self._ALLOWED_MODULES):
            return super().find_class(module, name)
        if module == "torch" and (name in ("Size", "device", "layout", "memory_format")
                                  or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":  # torch.layout by its name
            return super().find_class(module, name)
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            return super().find_class(module, name)  # the checkpoint_id DCP records
        if module == "collections" and name == "OrderedDict":
            return super().find_class(module, name)
        if module == "builtins" and name in ("set", "frozenset", "slice", "complex"):
            return super().find_class(module, name)
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            raise pickle.UnpicklingError("a tensor in DCP metadata")
        raise pickle.UnpicklingError(f"DCP metadata refers to {module}.{name}, which a checkpoint never needs: "
                                     "not loaded (it could run code)")


def _hashing_writer(path: Path, written: WrittenFiles) -> Any:
    """DCP's file writer, every file it writes hashed as written and recorded in ``written``.

    DCP writes each rank's shards through ``FileSystem.create_stream`` and fsyncs them itself
    (``sync_files``); a file system whose streams are :class:`HashingFile` s gives each rank the
    size and sha256 of its own shard files (and the coordinator of DCP's ``.metadata``) with no
    second pass. One writing thread per rank: a file's bytes reach the hash in order.
    """
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
            if "w" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with written.open(path, sync=False) as stream:  # DCP fsyncs it (sync_files=True)
                yield stream

        def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
            super().rename(path, new_path)
            written.rename(path, new_path)

    class SplitWriter(FileSystemWriter):
        """Each rank's shards in ``__<rank>_0.distcp``, what is replicated (written once, by rank 0:
        the optimizer's step counts and settings) in ``__<rank>_1.distcp``: a rank loading the
        same layout then reads its own shards and rank 0's small file, never another rank's shards."""

        def write_data(self, plan: Any, planner: Any) -> Any:
            from torch.distributed.checkpoint.planner import WriteItemType

            prefix = plan.storage_data.prefix
            files: queue.Queue = queue.Queue()
            shards = [item for item in plan.items if item.type == WriteItemType.SHARD]
            rest = [item for item in plan.items if item.type != WriteItemType.SHARD]
            for n, items in enumerate((shards, rest)):
                if items:
                    name = f"{prefix}{n}.distcp"
                    files.put((self.fs.concat_path(self.path, name), name, items))
            return self._write_data(planner, files)  # DCP's own writing loop (torch 2.13)

    writer = SplitWriter(str(path), single_file_per_rank=True, sync_files=True, thread_count=1)
    writer.fs = HashingFileSystem()
    return writer


def _verifying_reader(path: Path, reader: CheckpointReader, agree: Agree) -> Any:
    """DCP's file reader for ``path`` (a ``model_<i>`` folder of the checkpoint ``reader`` opened).

    DCP's metadata is read verified, by an unpickler that allows only DCP's record types, so
    loading never runs code from a file. Before any tensor is copied, each rank checks the files
    its own load plan reads (its shards and those holding what it needs; never the others), and
    the ranks agree on the verdict (``agree``, one collective), so every rank raises the same error.
    """
    from torch.distributed.checkpoint import FileSystemReader

    prefix = path.relative_to(reader.path).as_posix()

    class VerifyingReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            name = Path(self._get_metadata_path(rank)).name
            data = reader.read_bytes(f"{prefix}/{name}")
            metadata = _SafeMetadataUnpickler(io.BytesIO(data)).load()
            if getattr(metadata, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan: Any, planner: Any) -> Any:
            names = sorted({f"{prefix}/{self.storage_data[item.storage_index].relative_path}" for item in plan.items})
            problem = None
            try:
                reader.check(names)
                reader.verify(names)
            except CheckpointError as e:
                problem = str(e)
            except Exception as e:  # noqa: BLE001 - every rank must reach the verdict
                problem = f"could not read {reader.path} ({type(e).__name__}: {e})"
            raise_first_problem(agree(problem))
            return super().read_data(plan, planner)

    return VerifyingReader(str(path))


def save_sharded(directory: Path, models: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer], *,
                 written: WrittenFiles, asynchronous: bool = False, process_group: Any = None) -> list[Any]:
    """Every rank writes its shards of each model (and of the optimizers holding its parameters)
    into ``directory/model_<i>/`` with DCP (collective: call on every rank), recording the size
    and sha256 of each file it writes in ``written``.

    With ``asynchronous`` the call returns once the shards are copied to CPU memory, with one
    future per model that completes when its files (and, on the coordinator, DCP's metadata,
    written after every rank's files) are on disk.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict

    futures = []
    for i, model in enumerate(models):
        mine = _optimizers_of(model, optimizers)
        msd, osd = get_state_dict(model, mine)
        writer = _hashing_writer(directory / f"model_{i}", written)
        planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)  # replicated values: rank 0 writes them
        if asynchronous:
            futures.append(dcp.async_save({"model": msd, "optimizer": osd}, storage_writer=writer, planner=planner,
                                          process_group=process_group))
        else:
            dcp.save({"model": msd, "optimizer": osd}, storage_writer=writer, planner=planner)
    return futures


def load_sharded(directory: Path, models: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer], *,
                 reader: CheckpointReader, agree: Agree) -> None:
    """Read what :func:`save_sharded` wrote, resharded to this run's ranks (any number, 1 included),
    each rank verifying the files it reads (see :func:`_verifying_reader`).

    Raises:
        CheckpointError: on every rank alike, naming the first damaged file and the rank that read it.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    for i, model in enumerate(models):
        mine = _optimizers_of(model, optimizers)
        msd, osd = get_state_dict(model, mine)
        state = {"model": msd, "optimizer": osd}
        try:
            dcp.load(state, storage_reader=_verifying_reader(directory / f"model_{i}", reader, agree))
        except CheckpointException as e:
            errors = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
            damaged = [err for err in errors if isinstance(err, CheckpointError)]
            if damaged:
                raise CheckpointError(str(damaged[0])) from None
            raise
        set_state_dict(model, mine, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
def _optimizers_of(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    held = {id(p) for p in model.parameters()}
    return [o for o in optimizers if any(id(p) in held for g in o.param_groups for p in g["params"])]
