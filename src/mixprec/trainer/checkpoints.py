"""The Trainer's checkpoint folders: ``output_dir/checkpoint-{step}``, written, found, rotated, resumed.

A folder holds the Accelerator's state (what a bit-for-bit resume needs, verified by its
manifest) and, beside it, the files Hugging Face's tools expect: ``model.safetensors`` (and
``config.json`` for a Hugging Face model, so ``from_pretrained("out/checkpoint-N")`` loads it),
``optimizer.pt``, ``scheduler.pt``, ``trainer_state.json``, ``training_args.bin``. Where one is
the same bytes as the Accelerator's file it is a hard link to it (no second copy on disk). The
whole folder appears at once: it is built in a staging folder and renamed into place.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from mixprec.checkpoint.folder import MANIFEST, commit_checkpoint, is_complete_checkpoint

__all__ = ["list_checkpoints", "rotate_checkpoints", "checkpoint_to_resume", "write_trainer_checkpoint",
           "weights_file"]

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# Hugging Face's name -> the Accelerator's file with the same content.
_SAME_BYTES = {"model.safetensors": "model_0.safetensors", "optimizer.pt": "optimizer_0.bin",
               "scheduler.pt": "scheduler_0.bin", "scaler.pt": "scaler.bin"}


def list_checkpoints(out: Path) -> list[Path]:
    """The complete checkpoints in ``out``, oldest step first (half-written ones are not listed)."""
    found = [(int(m.group(1)), p) for p in out.glob("checkpoint-*") if (m := _CHECKPOINT.match(p.name))]
    return [p for _, p in sorted(found) if is_complete_checkpoint(p)]


def rotate_checkpoints(out: Path, limit: int | None, best: str | None) -> None:
    """Keep the newest ``limit`` checkpoints and, always, the best one (with ``limit=1`` that keeps
    the best and the newest, as Hugging Face does); remove staging folders of crashed saves."""
    for stale in out.glob(".checkpoint-*.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if limit is None:
        return
    ckpts = list_checkpoints(out)
    keep = set(ckpts[-limit:])
    if best is not None and Path(best) in ckpts:
        keep.add(Path(best))
    for p in ckpts:
        if p not in keep:
            shutil.rmtree(p, ignore_errors=True)


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
    """Write ``final`` (``output_dir/checkpoint-N``) atomically: the Accelerator's state, ``extra_files``
    (name -> text or bytes), and Hugging Face's file names; every process calls it."""
    main = accelerator.is_main_process
    stage = final.parent / f".{final.name}.tmp-trainer"
    if main:
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        inner = stage / "state"
        accelerator.save_state(inner, extra_files=extra_files)  # synchronous: complete on return
        if main:
            meta = json.loads((inner / MANIFEST).read_text()).get("meta")
            (inner / MANIFEST).unlink()
            for p in inner.iterdir():
                os.replace(p, stage / p.name)
            inner.rmdir()
            for hf_name, ours in _SAME_BYTES.items():
                if (stage / ours).is_file() and not (stage / hf_name).exists():
                    _link_or_copy(stage / ours, stage / hf_name)
            config = getattr(model, "config", None)
            if config is not None and hasattr(config, "save_pretrained"):
                config.save_pretrained(str(stage))  # config.json: from_pretrained(checkpoint) loads the model
            commit_checkpoint(stage, final, meta=meta)
    except OSError as e:  # name the checkpoint, not its staging folder
        if main:
            shutil.rmtree(stage, ignore_errors=True)
        raise OSError(e.errno, (e.strerror or str(e)).replace(str(stage / "state"), str(final))) from e
    except BaseException:
        if main:
            shutil.rmtree(stage, ignore_errors=True)
        raise
    accelerator.wait_for_everyone()
    return final
