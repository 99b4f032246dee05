"""save_total_limit keeps the checkpoints transformers' own rotation keeps, under mixprec's Trainer
and under the switch (transformers' Trainer, mixprec's commit): every limit from 1 to 5, 1 to 7
saves, with no best checkpoint and with the best inside and outside the window."""

from __future__ import annotations

from pathlib import Path

import pytest

from mixprec.checkpoint.folder import write_checkpoint
from mixprec.integrations.engine_checkpoints import _rotate
from mixprec.trainer.checkpoints import rotate_checkpoints_of

trainer_utils = pytest.importorskip("transformers.trainer_utils")

# The eval metric at each save (lower is better): the best is then the newest (falling), the
# first, soon outside the window (rising), one in the middle (a valley), or none at all.
METRICS = {
    "none": None,
    "falling": [7, 6, 5, 4, 3, 2, 1],
    "rising": [1, 2, 3, 4, 5, 6, 7],
    "valley": [5, 4, 1, 3, 6, 7, 8],
    "late-valley": [5, 6, 7, 8, 1, 9, 9],
}


def _kept(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.iterdir() if p.name.startswith("checkpoint-"))


@pytest.mark.parametrize("limit", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("metrics", list(METRICS))
def test_save_total_limit_keeps_what_transformers_keeps(limit, metrics, tmp_path):
    theirs, ours, engine = tmp_path / "transformers", tmp_path / "mixprec", tmp_path / "engine"
    theirs.mkdir()
    values = METRICS[metrics]
    for saves in range(1, 8):
        step = 10 * saves
        (theirs / f"checkpoint-{step}").mkdir()
        for root in (ours, engine):
            write_checkpoint(root / f"checkpoint-{step}", {"w.bin": lambda p: p.write_bytes(b"w")})
        best = None
        if values is not None:
            best_step = 10 * (min(range(saves), key=lambda i: values[i]) + 1)
            best = f"checkpoint-{best_step}"
        trainer_utils.rotate_checkpoints(str(theirs), limit, str(theirs / best) if best else None)
        rotate_checkpoints_of(ours, limit, str(ours / best) if best else None)
        _rotate(str(engine), limit, str(engine / best) if best else None)
        assert _kept(ours) == _kept(theirs) == _kept(engine), (limit, metrics, saves)
        assert not [p for p in engine.iterdir() if p.name.startswith(".")]  # each retired folder removed
        # Nothing is deleted while fewer checkpoints than the limit exist (the bug: a limit of 3
        # kept only the newest from the second save on).
        assert len(_kept(ours)) >= min(saves, limit)
        if best:
            assert (ours / best).is_dir()


def test_a_limit_of_zero_or_none_keeps_every_checkpoint(tmp_path):
    for n in range(1, 4):
        write_checkpoint(tmp_path / f"checkpoint-{n}", {"w.bin": lambda p: p.write_bytes(b"w")})
        rotate_checkpoints_of(tmp_path, 0, None)
        rotate_checkpoints_of(tmp_path, None, None)
    assert _kept(tmp_path) == [1, 2, 3]
