"""Several processes through torch.distributed, as started by ``torchrun``.

mixprec has no launcher of its own: ``torchrun --nproc_per_node N train.py`` sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``, and :func:`init_from_env`
turns them into a process group (gloo on the CPU, nccl on CUDA).
"""

from __future__ import annotations

import atexit
import datetime
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mixprec.nested import tree_map

__all__ = ["ProcessInfo", "all_gather_object", "init_from_env", "gather", "reduce", "broadcast_object", "barrier"]


@dataclass(frozen=True, kw_only=True)
class ProcessInfo:
    """Where this process stands among all of them."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_distributed(self) -> bool:
        """Whether more than one process takes part."""
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer (torchrun sets it)") from None


def init_from_env(device_type: str, timeout_s: float = 600.0, backend: str | None = None) -> ProcessInfo:
    """Read torchrun's variables and initialise the process group once if several processes run.

    A group this creates stays usable after training (a script may go on with collectives) and is
    destroyed at interpreter exit, unless it was destroyed or replaced before; a group the script
    initialised itself is used as it is and left to it.

    Args:
        device_type: ``"cpu"`` uses gloo, ``"cuda"`` uses nccl.
        timeout_s: how long a collective may wait for the others before failing.
        backend: another backend than the device's (``"gloo"`` on CUDA, say).
    """
    if dist.is_available() and dist.is_initialized():
        return ProcessInfo(rank=dist.get_rank(), world_size=dist.get_world_size(),
                           local_rank=_env_int("LOCAL_RANK", 0))
    world = _env_int("WORLD_SIZE", 1)
    info = ProcessInfo(rank=_env_int("RANK", 0), world_size=world, local_rank=_env_int("LOCAL_RANK", 0))
    if world > 1:
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise RuntimeError(
                f"WORLD_SIZE={world} but {', '.join(missing)} is not set; start the script with "
                "`torchrun --nproc_per_node N script.py`, which sets them"
            )
        backend = backend or ("nccl" if device_type == "cuda" else "gloo")
        timeout = datetime.timedelta(seconds=timeout_s)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is not None:
            # Under torchrun's elastic agent the group may be a restart of a failed one: its keys in
            # the store get the attempt's prefix, so no process reads a dead peer's address.
            agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                  is_master=not agent_store and info.rank == 0, timeout=timeout,
                                  multi_tenant=not agent_store)
            dist.init_process_group(backend=backend, store=dist.PrefixStore(f"mixprec/attempt_{attempt}", store),
                                    rank=info.rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, rank=info.rank, world_size=world, timeout=timeout)
        atexit.register(_destroy_at_exit, weakref.ref(dist.group.WORLD))
    return info


def _destroy_at_exit(created: weakref.ref) -> None:
    """At interpreter exit, destroy the process group :func:`init_from_env` created, if it is still the one in use.

    Left to the interpreter's teardown, a gloo group (after an elastic restart, say) can abort its
    process with ``terminate called without an active exception``, and torchrun then reports a run
    that finished as failed. A group already destroyed, or replaced by another, is left alone; this
    never raises (the exit's status is the script's).
    """
    try:
        group = created()
        if group is not None and dist.is_initialized() and dist.group.WORLD is group:
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - at exit there is nothing left to tell
        pass


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    """Wait until every process gets here (no-op in one process)."""
    if _active():
        dist.barrier()


def gather(data: Any) -> Any:
    """Concatenate ``data`` (a tensor, or any container of them :mod:`mixprec.nested` walks) from
    every process along dim 0, one collective per tensor.

    Every process must pass tensors of the same shape (mixprec's sharded dataloaders make the
    last batch the same size on every process for this reason). A 0-d tensor is gathered as a
    1-element one.
    """
    return tree_map(_gather_tensor, data)


def _gather_tensor(data: Any) -> torch.Tensor:
    _check_tensor("gather", data)
    tensor = data.reshape(1) if data.dim() == 0 else data
    if not _active():
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=0)


def reduce(data: Any, reduction: str = "sum") -> Any:
    """Sum or average ``data`` (tensors, or any container of them :mod:`mixprec.nested` walks) over every process."""
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    return tree_map(lambda t: _reduce_tensor(t, reduction), data)


def _reduce_tensor(data: Any, reduction: str) -> torch.Tensor:
    _check_tensor("reduce", data)
    out = data.clone()
    if _active():
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        if reduction == "mean":
            out = out / dist.get_world_size()
    return out


def _check_tensor(name: str, data: Any) -> None:
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{name}() takes tensors (or dicts/lists/tuples of them), got {type(data).__name__}")


def broadcast_module_state(module: torch.nn.Module, src: int = 0) -> None:
    """Overwrite ``module``'s parameters and buffers with process ``src``'s, in place."""
    if _active():
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t.data, src=src)


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """``obj`` as process ``src`` has it, on every process (pickled: only for small, trusted values)."""
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every process's ``obj``, in rank order, on every process (one collective; pickled: only for
    small, trusted values). ``[obj]`` in one process."""
    if not _active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
