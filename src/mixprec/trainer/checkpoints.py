"""The Trainer's checkpoint folders: ``output_dir/checkpoint-{step}``, written, found, rotated, resumed.

A folder holds the Accelerator's state (what a bit-for-bit resume needs, verified by its
manifest) and, beside it, the files Hugging Face's tools expect: ``model.safetensors`` (and
``config.json`` for a Hugging Face model, so ``from_pretrained("out/checkpoint-N")`` loads it),
``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``, ``trainer_state.json``, ``training_args.bin``.
Where one is the same bytes as a file the Accelerator wrote it is a hard link to it (no second
copy on disk). The Accelerator's one atomic commit writes the whole folder: the Hugging Face
names are added in its staging folder, before the commit.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from mixprec.checkpoint.folder import (
    MANIFEST,
    is_complete_checkpoint,
    numbered_checkpoints,
    rotate_checkpoints,
)

__all__ = ["list_checkpoints", "rotate_checkpoints_of", "checkpoint_to_resume", "write_trainer_checkpoint",
           "weights_file"]

STEM = "checkpoint-"
# Hugging Face's name for the first file the Accelerator wrote in each role.
_HF_NAMES = {"model": "model.safetensors", "optimizer": "optimizer.pt", "scheduler": "scheduler.pt",
             "scaler": "scaler.pt"}


def list_checkpoints(out: Path) -> list[Path]:
    """The complete checkpoints in ``out``, oldest step first (half-written ones are not listed)."""
    return numbered_checkpoints(out, STEM)


def rotate_checkpoints_of(out: Path, limit: int | None, best: str | None) -> None:
    """Keep the newest ``limit`` checkpoints and, always, the best one (with ``limit=1`` that keeps
    the best and the newest, as Hugging Face does); remove staging folders of crashed saves."""
    rotate_checkpoints(out, STEM, limit, keep=(Path(best),) if best is not None else ())


def checkpoint_to_resume(out: Path, resume: str | bool) -> Path:
    """``True``: the newest complete checkpoint in ``out``; a path: that one, if it is complete.

    Raises:
        ValueError: with Hugging Face's wording ("No valid checkpoint found in output directory",
            "Can't find a valid checkpoint at").
    """
    if resume is True:
        ckpts = list_checkpoints(out)
        if not ckpts:
            raise ValueError(f"No valid checkpoint found in output directory ({out}): resume_from_checkpoint=True "
                             "needs a complete checkpoint-N folder there")
        return ckpts[-1]
    path = Path(resume)
    if not is_complete_checkpoint(path):
        why = ("the folder does not exist" if not path.is_dir() else
               f"it has no mixprec {MANIFEST} (a checkpoint written by another trainer, or half-written); mixprec "
               "resumes its own checkpoints; load the weights with from_pretrained and start a new run")
        raise ValueError(f"Can't find a valid checkpoint at {path}: {why}")
    return path


def weights_file(checkpoint: Path) -> Path:
    """The model's safetensors file in a checkpoint folder."""
    for name in ("model_0.safetensors", "model.safetensors"):
        if (checkpoint / name).is_file():
            return checkpoint / name
    raise FileNotFoundError(f"{checkpoint} holds no model weights (model.safetensors)")


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a filesystem without hard links
        shutil.copyfile(src, dst)


def write_trainer_checkpoint(accelerator: Any, final: Path, model: Any, extra_files: dict[str, str | bytes]) -> Path:
    """Write ``final`` (``output_dir/checkpoint-N``) atomically, in one commit: the Accelerator's
    state, ``extra_files`` (name -> text or bytes), and Hugging Face's file names; every process
    calls it."""
    def hugging_face_layout(folder: Path, written: dict[str, list[str]]) -> None:
        for role, hf_name in _HF_NAMES.items():
            if written.get(role) and not (folder / hf_name).exists():
                _link_or_copy(folder / written[role][0], folder / hf_name)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(str(folder))  # config.json: from_pretrained(checkpoint) loads the model

    return accelerator.save_state(final, extra_files=extra_files, finish=hugging_face_layout)
