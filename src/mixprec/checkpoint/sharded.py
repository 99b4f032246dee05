"""Sharded state through ``torch.distributed.checkpoint`` (DCP): each rank writes its own shards of
each model and of the optimizers holding its parameters; a checkpoint saved by N ranks loads on
M. DCP writes its ``.metadata`` with pickle: it is read here by an unpickler that allows only
DCP's own record types, so loading never runs code from a file.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch

__all__ = ["load_sharded", "save_sharded"]


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


def _safe_reader(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as fh:
                metadata = _SafeMetadataUnpickler(io.BytesIO(fh.read())).load()
            if getattr(metadata, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def save_sharded(directory: Path, models: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer], *,
                 asynchronous: bool = False, process_group: Any = None) -> list[Any]:
    """Every rank writes its shards of each model (and of the optimizers holding its parameters)
    into ``directory/model_<i>/`` with DCP (collective: call on every rank).

    With ``asynchronous`` the call returns once the shards are copied to CPU memory, with one
    future per model that completes when its files (and, on the coordinator, DCP's metadata,
    written after every rank's files) are on disk.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    futures = []
    for i, model in enumerate(models):
        mine = _optimizers_of(model, optimizers)
        msd, osd = get_state_dict(model, mine)
        where = str(directory / f"model_{i}")
        if asynchronous:
            futures.append(dcp.async_save({"model": msd, "optimizer": osd}, checkpoint_id=where,
                                          process_group=process_group))
        else:
            dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=where)
    return futures


def load_sharded(directory: Path, models: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
    """Read what :func:`save_sharded` wrote, resharded to this run's ranks (any number, 1 included)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    for i, model in enumerate(models):
        mine = _optimizers_of(model, optimizers)
        msd, osd = get_state_dict(model, mine)
        state = {"model": msd, "optimizer": osd}
        dcp.load(state, storage_reader=_safe_reader(directory / f"model_{i}"))
        set_state_dict(model, mine, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _optimizers_of(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    held = {id(p) for p in model.parameters()}
    return [o for o in optimizers if any(id(p) in held for g in o.param_groups for p in g["params"])]
