"""What ``Accelerator.save_state`` writes and ``load_state`` reads back.

One folder per checkpoint, written atomically by :mod:`mixprec.checkpoint`: model weights as
safetensors, every other state with ``torch.save`` (read back with ``weights_only=True``), one
RNG file per process, and the accelerator's own counters and precision (a precision fallback
survives a resume).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import safetensors.torch
import torch

from . import checkpoint as ckpt
from . import distributed as D
from .fallback import switch_precision

if TYPE_CHECKING:  # pragma: no cover
    from .accelerator import Accelerator

__all__ = ["save_accelerator_state", "load_accelerator_state"]


def _groups(acc: Accelerator) -> dict[str, list]:
    return {"optimizer": acc._optimizers, "scheduler": acc._schedulers, "dataloader": acc._dataloaders,
            "custom": acc._custom_objects}


def save_accelerator_state(acc: Accelerator, output_dir: Path, extra_files: dict[str, str | bytes]) -> Path:
    """See :meth:`Accelerator.save_state`."""
    final = output_dir
    # The main process makes the staging folder; every process writes its own RNG state into it.
    tmp = Path(D.broadcast_object(str(ckpt.staging_dir(final)) if acc.is_main_process else None))
    torch.save(ckpt.rng_state(), tmp / f"random_states_{acc.process_index}.bin")
    acc.wait_for_everyone()
    if acc.is_main_process:
        for i, m in enumerate(acc._models):
            safetensors.torch.save_model(acc.unwrap_model(m), str(tmp / f"model_{i}.safetensors"))
        for name, objs in _groups(acc).items():
            for i, obj in enumerate(objs):
                torch.save(obj.state_dict(), tmp / f"{name}_{i}.bin")
        if acc.scaler is not None:
            torch.save(acc.scaler.state_dict(), tmp / "scaler.bin")
        torch.save({"step": acc.step, "precision": acc.policy.name, "optimizer_steps": acc.optimizer_steps,
                    "precision_fallback": bool(acc.precision_fallbacks)}, tmp / "accelerator.bin")
        for name, content in extra_files.items():
            (tmp / name).write_bytes(content.encode() if isinstance(content, str) else content)
        ckpt.commit_checkpoint(tmp, final, meta={"num_processes": acc.num_processes,
                                                 "precision": acc.policy.name})
    acc.wait_for_everyone()
    return final


def load_accelerator_state(acc: Accelerator, input_dir: Path) -> None:
    """See :meth:`Accelerator.load_state`."""
    path = input_dir
    ckpt.verify_checkpoint(path)  # before anything is read
    load = ckpt.load_tensor_file
    for i, m in enumerate(acc._models):
        safetensors.torch.load_model(acc.unwrap_model(m), str(path / f"model_{i}.safetensors"),
                                     strict=True, device=str(acc.device))
    for name, objs in _groups(acc).items():
        for i, obj in enumerate(objs):
            f = path / f"{name}_{i}.bin"
            if not f.exists():
                raise ckpt.CheckpointError(f"{f} is missing: the checkpoint holds fewer {name}s than were prepared")
            obj.load_state_dict(load(f, map_location=acc.device if name == "optimizer" else "cpu"))
    meta = load(path / "accelerator.bin")
    if meta.get("precision_fallback") and meta["precision"] != acc.policy.name:
        switch_precision(acc, meta["precision"])  # the run had fallen back: keep it so
        acc.precision_fallbacks.append({"step": meta.get("optimizer_steps", 0), "to": meta["precision"]})
    if acc.scaler is not None and (path / "scaler.bin").exists():
        acc.scaler.load_state_dict(load(path / "scaler.bin"))
    acc.step = int(meta["step"])
    acc.optimizer_steps = int(meta.get("optimizer_steps", 0))
    rng = path / f"random_states_{acc.process_index}.bin"
    if not rng.exists():
        raise ckpt.CheckpointError(f"{rng} is missing: the checkpoint was written by fewer processes")
    ckpt.set_rng_state(load(rng))

