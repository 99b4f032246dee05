"""The prepared objects of one run, and what ``Accelerator.save_state`` writes of them.

One folder per checkpoint, written atomically by :mod:`mixprec.checkpoint`: model weights as
safetensors, every other state with ``torch.save`` (read back with ``weights_only=True``), one
RNG file per process, the precision plugin's state (the loss scaler's) and the run's counters
and precision (a precision fallback survives a resume).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from . import checkpoint as ckpt
from . import distributed as D
from .wrappers import unwrap

__all__ = ["PreparedObjects", "save_accelerator_state", "load_accelerator_state"]


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


def save_accelerator_state(output_dir: Path, prepared: PreparedObjects, process: D.ProcessInfo,
                           precision_state: dict[str, Any], meta: dict[str, Any],
                           extra_files: dict[str, str | bytes]) -> Path:
    """See :meth:`Accelerator.save_state`. ``meta`` (the run's counters and precision name) is
    written as ``accelerator.bin``; the main process writes all but the RNG files."""
    final = output_dir
    main = process.rank == 0
    # The main process makes the staging folder; every process writes its own RNG state into it.
    tmp = Path(D.broadcast_object(str(ckpt.staging_dir(final)) if main else None))
    torch.save(ckpt.rng_state(), tmp / f"random_states_{process.rank}.bin")
    D.barrier()
    if main:
        for i, m in enumerate(prepared.models):
            safetensors.torch.save_model(unwrap(m), str(tmp / f"model_{i}.safetensors"))
        for name, objs in prepared.stateful().items():
            for i, obj in enumerate(objs):
                torch.save(obj.state_dict(), tmp / f"{name}_{i}.bin")
        if precision_state:
            torch.save(precision_state, tmp / "scaler.bin")
        torch.save(meta, tmp / "accelerator.bin")
        for name, content in extra_files.items():
            (tmp / name).write_bytes(content.encode() if isinstance(content, str) else content)
        ckpt.commit_checkpoint(tmp, final, meta={"num_processes": process.world_size, "precision": meta["precision"]})
    D.barrier()
    return final


def load_accelerator_state(input_dir: Path, prepared: PreparedObjects, process: D.ProcessInfo,
                           device: torch.device) -> tuple[dict[str, Any], dict[str, Any]]:
    """See :meth:`Accelerator.load_state`: verifies, restores the prepared objects and this
    process's RNG; returns the run's ``meta`` and the precision plugin's state (``{}`` if none)."""
    path = input_dir
    ckpt.verify_checkpoint(path)  # before anything is read
    load = ckpt.load_tensor_file
    for i, m in enumerate(prepared.models):
        safetensors.torch.load_model(unwrap(m), str(path / f"model_{i}.safetensors"), strict=True, device=str(device))
    for name, objs in prepared.stateful().items():
        for i, obj in enumerate(objs):
            f = path / f"{name}_{i}.bin"
            if not f.exists():
                raise ckpt.CheckpointError(f"{f} is missing: the checkpoint holds fewer {name}s than were prepared")
            obj.load_state_dict(load(f, map_location=device if name == "optimizer" else "cpu"))
    rng = path / f"random_states_{process.rank}.bin"
    if not rng.exists():
        raise ckpt.CheckpointError(f"{rng} is missing: the checkpoint was written by fewer processes")
    ckpt.set_rng_state(load(rng))
    precision_state = load(path / "scaler.bin") if (path / "scaler.bin").exists() else {}
    return load(path / "accelerator.bin"), precision_state
