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
    CheckpointError,
    CheckpointReader,
    checkpoint_problem,
    numbered_checkpoints,
    rotate_checkpoints,
    verify_checkpoint,
)

__all__ = ["checkpoints_to_resume", "list_checkpoints", "newest_damaged_error", "rotate_checkpoints_of",
           "verify_trainer_files", "weights_file", "write_trainer_checkpoint"]

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


def checkpoints_to_resume(out: Path, resume: str | bool) -> list[Path]:
    """The checkpoints to try, in order, for ``resume_from_checkpoint``.

    - ``True``: the newest ``checkpoint-N`` folder in ``out``, whatever its state: one that is
      damaged is an error (:func:`newest_damaged_error`), never skipped in silence.
    - ``"auto"``: every ``checkpoint-N`` folder, newest first (the caller takes the first that
      loads and warns about each it skips); ``[]`` if there is none.
    - a path: that folder and no other.

    Raises:
        ValueError: with Hugging Face's wording ("No valid checkpoint found in output directory",
            "Can't find a valid checkpoint at") where there is no checkpoint at all.
        CheckpointError: ``True`` and the newest checkpoint's manifest or files are damaged; or the
            named folder is.
    """
    found = numbered_checkpoints(out, STEM, complete=False)
    if resume == "auto":
        return found[::-1]
    if resume is True:
        if not found:
            raise ValueError(f"No valid checkpoint found in output directory ({out}): resume_from_checkpoint=True "
                             "needs a complete checkpoint-N folder there")
        newest = found[-1]
        problem = checkpoint_problem(newest)
        if problem is not None:
            raise newest_damaged_error(out, newest, problem)
        return [newest]
    path = Path(resume).expanduser()
    if not path.is_dir():
        raise ValueError(f"Can't find a valid checkpoint at {path}: the folder does not exist")
    if not (path / MANIFEST).is_file():
        raise ValueError(f"Can't find a valid checkpoint at {path}: it has no mixprec {MANIFEST} (a checkpoint "
                         "written by another trainer, or half-written); mixprec resumes its own checkpoints; load the "
                         "weights with from_pretrained and start a new run")
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointError(problem)
    return [path]


def newest_damaged_error(out: Path, newest: Path, problem: str) -> CheckpointError:
    """The error of ``resume_from_checkpoint=True`` when the newest checkpoint is damaged: what is
    wrong, and the newest older one that verifies (hashed in full) as the fix."""
    fix = "no older checkpoint there verifies either: start a new run (resume_from_checkpoint=None)"
    for older in numbered_checkpoints(out, STEM, complete=False)[::-1]:
        if older == newest:
            continue
        try:
            verify_checkpoint(older)
        except CheckpointError:
            continue
        fix = (f"the newest checkpoint that verifies is {older}: resume from it with "
               f"resume_from_checkpoint={str(older)!r} (or resume_from_checkpoint='auto', which skips damaged "
               "checkpoints with a warning)")
        break
    return CheckpointError(f"the newest checkpoint, {newest}, is damaged: {problem}. Not resuming from an older one "
                           f"without being told: {fix}")


def verify_trainer_files(checkpoint: Path) -> None:
    """Check the Trainer's own files of ``checkpoint`` (``trainer_state.json`` and mixprec's beside it)
    against the manifest before they are read.

    Raises:
        CheckpointError: one is missing from the manifest, truncated or altered.
    """
    reader = CheckpointReader(checkpoint)
    reader.check([name for name in ("trainer_state.json", "mixprec_trainer_state.json") if name in reader.files]
                 or ["trainer_state.json"])
    reader.verify()


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
