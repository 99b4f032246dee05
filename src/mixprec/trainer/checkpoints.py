"""The Trainer's checkpoint folders: ``output_dir/checkpoint-{step}``, written, found, rotated, resumed.

A folder holds the Accelerator's state (what a bit-for-bit resume needs, verified by its
manifest) and, beside it, the files Hugging Face's Trainer writes and reads: the weights
(``model.safetensors``, or with ``save_safetensors=False`` ``pytorch_model.bin``; a Hugging Face
model's through its ``save_pretrained``, so ``config.json`` is there and weights above its
``max_shard_size`` are split into ``model-0000i-of-0000n.safetensors`` with an index),
``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``, ``rng_state.pth``, ``trainer_state.json``,
``training_args.bin``: transformers' Trainer resumes it. Where one is the same bytes as a file the
Accelerator wrote it is a hard link to it (no second copy on disk). The Accelerator's one atomic
commit writes the whole folder: the Hugging Face names are added in its staging folder, before the
commit. Folders transformers' Trainer wrote resume too (:mod:`mixprec.trainer.transformers_checkpoints`),
and so does a folder whose weights the user saved again in another of Hugging Face's layouts: those
are read unverified, with a warning, and every other file is verified (:func:`replaced_weights`).
"""

from __future__ import annotations

import filecmp
import os
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import safetensors.torch
import torch

from mixprec.checkpoint.folder import (
    MANIFEST,
    CheckpointError,
    CheckpointReader,
    checkpoint_problem,
    numbered_checkpoints,
    read_manifest,
    rotate_checkpoints,
    verify_checkpoint,
)
from mixprec.checkpoint.weights import (
    WEIGHTS_NAMES,
    find_weights,
    is_weights_file,
    load_model_weights,
    replacing_weights,
    save_model_weights,
)
from mixprec.trainer.adapters import adapter_weight_files, is_peft_model, load_adapter_weights
from mixprec.trainer.callbacks import log
from mixprec.trainer.transformers_checkpoints import is_transformers_checkpoint, report_weights_load

__all__ = ["ReplacedWeights", "checkpoints_to_resume", "list_checkpoints", "load_checkpoint_weights",
           "load_replaced_weights", "newest_damaged_error", "replaced_weights", "resume_problem",
           "rotate_checkpoints_of", "verify_trainer_files", "write_trainer_checkpoint"]

STEM = "checkpoint-"
# Hugging Face's name for the first file the Accelerator wrote in each role (the weights: see _save_weights).
_HF_NAMES = {"optimizer": "optimizer.pt", "scheduler": "scheduler.pt", "scaler": "scaler.pt"}
#: Where a single weights file is split, for weights mixprec writes itself (``pytorch_model.bin``):
#: transformers' ``save_pretrained`` default.
MAX_SHARD_SIZE = "50GB"


def list_checkpoints(out: Path) -> list[Path]:
    """The complete checkpoints in ``out``, oldest step first (half-written ones are not listed)."""
    return numbered_checkpoints(out, STEM)


def rotate_checkpoints_of(out: Path, limit: int | None, best: str | None) -> None:
    """Keep ``limit`` checkpoints, the best counted among them as Hugging Face counts it (see
    :func:`~mixprec.checkpoint.folder.rotate_checkpoints`); remove staging folders of crashed saves.
    A ``limit`` of 0 or less keeps every checkpoint, as transformers' ``save_total_limit`` does."""
    limit = limit if limit is not None and limit > 0 else None
    rotate_checkpoints(out, STEM, limit, keep=(Path(best),) if best is not None else ())


def checkpoints_to_resume(out: Path, resume: str | bool) -> list[Path]:
    """The checkpoints to try, in order, for ``resume_from_checkpoint``.

    - ``True``: the newest ``checkpoint-N`` folder in ``out``, whatever its state: one that is
      damaged is an error (:func:`newest_damaged_error`), never skipped in silence.
    - ``"auto"``: every ``checkpoint-N`` folder, newest first (the caller takes the first that
      loads and warns about each it skips); ``[]`` if there is none.
    - a path: that folder and no other.

    A folder transformers' Trainer wrote (no mixprec manifest, its ``trainer_state.json`` and
    weights: :func:`~mixprec.trainer.transformers_checkpoints.is_transformers_checkpoint`) is a
    checkpoint too; it has no manifest to verify. Weights re-saved in another Hugging Face layout
    (:func:`replaced_weights`) do not make a checkpoint damaged (:func:`resume_problem`).

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
        if is_transformers_checkpoint(newest):
            return [newest]
        problem = resume_problem(newest)
        if problem is not None:
            raise newest_damaged_error(out, newest, problem)
        return [newest]
    path = Path(resume).expanduser()
    if not path.is_dir():
        raise ValueError(f"Can't find a valid checkpoint at {path}: the folder does not exist")
    if is_transformers_checkpoint(path):
        return [path]
    if not (path / MANIFEST).is_file():
        raise ValueError(f"Can't find a valid checkpoint at {path}: it has no mixprec {MANIFEST}, nor the "
                         "trainer_state.json and model weights (model.safetensors, its shards and index, or "
                         "pytorch_model.bin) of a checkpoint transformers' Trainer wrote (half-written, or not a "
                         "checkpoint); resume from another checkpoint, or start a new run")
    problem = resume_problem(path)
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
            replaced = replaced_weights(older)
            verify_checkpoint(older, skip=replaced.listed if replaced is not None else ())
        except CheckpointError:
            continue
        fix = (f"the newest checkpoint that verifies is {older}: resume from it with "
               f"resume_from_checkpoint={str(older)!r} (or resume_from_checkpoint='auto', which skips damaged "
               "checkpoints with a warning)")
        break
    return CheckpointError(f"the newest checkpoint, {newest}, is damaged: {problem}. Not resuming from an older one "
                           f"without being told: {fix}")


class ReplacedWeights(NamedTuple):
    """The model's weights of a checkpoint, re-saved in another Hugging Face layout (:func:`replaced_weights`)."""

    #: The weights files the manifest lists (some gone): not verified, not read.
    listed: list[str]
    #: The weights files there now, read in their place (tensors only, unverified).
    files: list[Path]
    #: What names them: the whole file, or the index of the shards.
    source: str


def replaced_weights(checkpoint: Path) -> ReplacedWeights | None:
    """The weights that replaced those the manifest of the mixprec checkpoint ``checkpoint`` lists
    under Hugging Face's names, as transformers' Trainer would load them: the user re-saved them
    (``model.save_pretrained(checkpoint, max_shard_size=...)`` writes shards and an index; the whole
    ``model.safetensors`` then deleted), or the other way round, or as ``pytorch_model.bin``.
    ``None`` where the listed weights are all there (a changed byte in them is damage, as in any
    other file), or none are (the missing file is the damage).

    Raises:
        CheckpointError: the manifest is damaged, or a listed weights file is gone and the set
            there is incomplete (a shard missing), with the fix.
    """
    listed = [rel for rel in read_manifest(checkpoint)["files"] if is_weights_file(rel)]
    files = replacing_weights(checkpoint, listed)
    if files is None:
        return None
    return ReplacedWeights(listed, files, next(n for n in WEIGHTS_NAMES if (checkpoint / n).is_file()))


def resume_problem(checkpoint: Path) -> str | None:
    """What makes the mixprec checkpoint ``checkpoint`` unfit to resume from, without reading its
    files (:func:`~mixprec.checkpoint.folder.checkpoint_problem`), or ``None``; weights re-saved in
    another Hugging Face layout (:func:`replaced_weights`) are not held against it, every other
    file is checked."""
    try:
        replaced = replaced_weights(checkpoint)
    except CheckpointError as e:
        return str(e)
    return checkpoint_problem(checkpoint, skip=replaced.listed if replaced is not None else ())


def load_replaced_weights(model: torch.nn.Module, checkpoint: Path, device: torch.device | str) -> bool:
    """Load into ``model`` the weights re-saved in ``checkpoint`` in place of those its manifest
    lists (:func:`replaced_weights`), as transformers' Trainer would read them: unverified, as
    tensors only, with a warning naming them. ``False`` (nothing read) where they were not replaced.

    Raises:
        CheckpointError: the re-saved set is incomplete, or a ``.bin`` holds more than tensors.
    """
    replaced = replaced_weights(checkpoint)
    if replaced is None:
        return False
    shards = [p.name for p in replaced.files if p.name != replaced.source]
    log.warning("mixprec: the model's weights in %s were saved again: %s%s in place of %s, which its %s lists, so "
                "they cannot be verified; reading them as tensors only (safetensors, torch.load(weights_only=True)). "
                "Every other file of the checkpoint is verified", checkpoint, replaced.source,
                f" (shards {', '.join(shards)})" if shards else "", ", ".join(replaced.listed), MANIFEST)
    report_weights_load(checkpoint, *load_model_weights(model, checkpoint, device=device))
    return True


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


def load_checkpoint_weights(model: torch.nn.Module, checkpoint: Path, device: torch.device | str) -> None:
    """Load the model's weights of ``checkpoint`` into ``model`` (``load_best_model_at_end``).

    A mixprec checkpoint: the Accelerator's ``model_0.safetensors`` (else Hugging Face's files
    there), each checked against the manifest before it is read; but weights re-saved there in
    another Hugging Face layout (:func:`load_replaced_weights`). A folder transformers' Trainer
    wrote: ``model.safetensors``, its shards with their index, or ``pytorch_model.bin``
    (``torch.load(weights_only=True)``), unverified (no manifest; said in a log line). A peft
    model's: its adapter (``adapter_model.safetensors``), as transformers reloads the best adapter.

    Raises:
        CheckpointError: a file that is not the one the manifest lists, or a ``.bin`` holding more than tensors.
        FileNotFoundError: no weights in ``checkpoint``.
    """
    checkpoint = Path(checkpoint)
    if is_peft_model(model) and adapter_weight_files(checkpoint):
        load_adapter_weights(model, checkpoint)  # (checked against the manifest where there is one)
        return
    if (checkpoint / MANIFEST).is_file():
        if load_replaced_weights(model, checkpoint, device):
            return
        reader = CheckpointReader(checkpoint)
        if "model_0.safetensors" in reader.files:
            reader.check("model_0.safetensors")
            reader.verify()
            safetensors.torch.load_model(model, str(checkpoint / "model_0.safetensors"), device=str(device))
            return
        reader.check([p.name for p in find_weights(checkpoint)])
        reader.verify()
    else:
        log.warning("mixprec: %s has no mixprec %s (written by another trainer): its weights cannot be verified; "
                    "reading them as tensors only", checkpoint, MANIFEST)
    report_weights_load(checkpoint, *load_model_weights(model, checkpoint, device=device))


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a filesystem without hard links
        shutil.copyfile(src, dst)


def _is_hf_model(model: Any) -> bool:
    return hasattr(model, "save_pretrained") and hasattr(getattr(model, "config", None), "save_pretrained")


def _save_weights(folder: Path, model: Any, written: list[str], save_safetensors: bool) -> None:
    """The weights under Hugging Face's names, as transformers' Trainer writes them: a Hugging Face
    model's through its ``save_pretrained`` (config, ``model.safetensors`` or shards with their
    index); a plain module's ``model.safetensors`` is the Accelerator's file, linked; with
    ``save_safetensors=False``, ``pytorch_model.bin`` (shards above :data:`MAX_SHARD_SIZE`)."""
    own = folder / written[0]
    if not save_safetensors:
        save_model_weights(model, folder, max_shard_size=MAX_SHARD_SIZE, safe_serialization=False)
        if _is_hf_model(model):
            model.config.save_pretrained(str(folder))  # config.json: from_pretrained(checkpoint) loads the model
        return
    if not _is_hf_model(model):
        _link_or_copy(own, folder / "model.safetensors")
        return
    model.save_pretrained(str(folder))
    single = folder / "model.safetensors"
    # Most models' save_pretrained writes the very bytes the Accelerator wrote: one copy on disk, linked.
    if single.is_file() and single.stat().st_size == own.stat().st_size and filecmp.cmp(single, own, shallow=False):
        single.unlink()
        _link_or_copy(own, single)


def write_trainer_checkpoint(accelerator: Any, final: Path, model: Any, extra_files: dict[str, str | bytes], *,
                             save_safetensors: bool, processing_class: Any = None, model_only: bool) -> Path:
    """Write ``final`` (``output_dir/checkpoint-N``) atomically, in one commit: the Accelerator's
    state, ``extra_files`` (name -> text or bytes), and Hugging Face's files (:func:`_save_weights`,
    the tokenizer or processor as transformers saves it; ``optimizer.pt`` and ``scheduler.pt``
    linked to the Accelerator's files); ``model_only``: the weights without the optimizer, schedule, scaler and
    random state (``save_only_model``). Every process calls it."""
    def hugging_face_layout(folder: Path, written: dict[str, list[str]]) -> None:
        for role, hf_name in _HF_NAMES.items():
            if written.get(role) and not (folder / hf_name).exists():
                _link_or_copy(folder / written[role][0], folder / hf_name)
        if written.get("model"):  # (sharded models keep their DCP shards only)
            _save_weights(folder, model, written["model"], save_safetensors)
        if hasattr(processing_class, "save_pretrained"):
            processing_class.save_pretrained(str(folder))

    return accelerator.save_state(final, extra_files=extra_files, finish=hugging_face_layout, model_only=model_only)
