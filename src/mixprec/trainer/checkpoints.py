"""The Trainer's checkpoint folders: ``output_dir/checkpoint-{step}``, found, rotated, resumed."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from ..checkpoint import is_complete_checkpoint

__all__ = ["list_checkpoints", "rotate_checkpoints", "checkpoint_to_resume"]

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


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
    """``True``: the newest complete checkpoint in ``out``; a path: that one."""
    if resume is True:
        ckpts = list_checkpoints(out)
        if not ckpts:
            raise ValueError(f"resume_from_checkpoint=True but {out} has no complete checkpoint")
        return ckpts[-1]
    return Path(resume)
