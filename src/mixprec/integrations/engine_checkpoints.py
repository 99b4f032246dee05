"""Under the switch, transformers' Trainer keeps mixprec's checkpoint promises: a checkpoint folder
appears whole or not at all, a resume never takes a broken one, and SIGTERM loses no step.

transformers' Trainer still writes every file it writes, with its own code, under its own names;
only where they go first, and what happens after, is mixprec's (:mod:`mixprec.checkpoint`). The
switch attaches :class:`EngineCheckpoints` to each Trainer it builds an Accelerator for (the
``self`` of the ``create_accelerator_and_postprocess`` that builds it), as three instance
attributes that call the Trainer's own methods:

- ``_save_checkpoint``, the outermost one (a subclass's, which wraps ``super()``'s: trl's model
  card, GRPO's extra state go with it). While it runs, ``_get_output_dir`` names a staging
  folder, ``<output_dir>/.checkpoint-N.tmp-<id>``, so everything lands in
  ``.checkpoint-N.tmp-<id>/checkpoint-N``, which neither ``get_last_checkpoint`` nor
  ``sort_checkpoints`` matches (and transformers' rotation inside the save sees no older
  checkpoint there, so it deletes nothing). Every rank's verdict is then gathered; on each
  filesystem one rank (the lowest that sees the staging folder) fsyncs and hashes the files,
  writes mixprec's manifest and renames the folder to ``checkpoint-N``; a second gather tells
  every rank it is committed; only then does transformers' rotation rule run, each old folder
  renamed out of its name before it is deleted.
- ``_load_from_checkpoint``: the folder's manifest is verified (sizes and sha256) on every rank
  first; a changed, truncated or missing file is a :class:`~mixprec.CheckpointError` naming it.
  A folder without a manifest (stock transformers wrote it) loads as transformers loads it,
  with a warning.
- ``train``: SIGTERM sets a flag; after each optimizer step every rank agrees on it in one small
  collective on the host, and the run saves one checkpoint at that step and exits with status 75.

And one name of ``transformers.trainer``: ``get_last_checkpoint``, which ``train(resume_from_
checkpoint=True)`` calls, becomes :func:`newest_good_checkpoint`.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from mixprec.checkpoint.folder import (
    MANIFEST,
    CheckpointError,
    commit_checkpoint,
    numbered_checkpoints,
    raise_first_problem,
    remove_stale,
    retire_checkpoint,
    verify_checkpoint,
)
from mixprec.checkpoint.integrity import sync_and_hash
from mixprec.checkpoint.writing import explain_write_error, is_write_failure
from mixprec.distributed import groups as D
from mixprec.distributed.preemption import PREEMPTED_EXIT_CODE, Preemption
from mixprec.trainer.transformers_checkpoints import is_transformers_checkpoint

__all__ = ["EngineCheckpoints", "newest_good_checkpoint", "verify_before_loading"]

log = logging.getLogger("mixprec.trainer")

#: transformers' ``PREFIX_CHECKPOINT_DIR`` and its separator: ``checkpoint-N``.
STEM = "checkpoint-"
#: The checkpoints verified in this process (folder, manifest's mtime): each is hashed once, by
#: :func:`newest_good_checkpoint` or by the load that follows it, not by both.
_VERIFIED: set[tuple[str, int]] = set()


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _key(path: Path) -> tuple[str, int]:
    try:
        return str(path.resolve()), (path / MANIFEST).stat().st_mtime_ns
    except OSError:
        return str(path.resolve()), -1


def _problem(path: Path) -> str | None:
    """What makes ``path`` unfit to resume from (``None``: it verifies, or stock transformers wrote
    it whole). Hashes every file of a folder with a manifest."""
    if (path / MANIFEST).exists():
        if _key(path) in _VERIFIED:
            return None
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            return str(e)
        return None
    if is_transformers_checkpoint(path):
        return None
    return (f"{path} is not a complete checkpoint: no mixprec {MANIFEST} and no trainer_state.json beside the "
            "weights (a save that did not finish)")


def _agreed(problem: str | None) -> str | None:
    """The first rank's problem with the same folder, on every rank."""
    return next((p for p in D.all_gather_object(problem) if p is not None), None)


def _warn_unverified(path: Path) -> None:
    if not (path / MANIFEST).exists() and is_transformers_checkpoint(path) and _rank() == 0:
        log.warning("mixprec: %s has no mixprec %s (transformers wrote it without the switch): its files cannot be "
                    "verified; loading them as transformers does", path, MANIFEST)


def verify_before_loading(path: str | os.PathLike) -> None:
    """Verify the checkpoint ``path`` on every rank before transformers reads it (collective).

    Raises:
        CheckpointError: a file the manifest lists is missing, truncated or changed (named).
    """
    path = Path(path)
    if not (path / MANIFEST).exists():
        _warn_unverified(path)
        return
    problem = None if _key(path) in _VERIFIED else _problem(path)
    raise_first_problem(D.all_gather_object(problem))
    _VERIFIED.add(_key(path))


def newest_good_checkpoint(folder: str | os.PathLike) -> str | None:
    """The newest ``checkpoint-N`` of ``folder`` that verifies (or that stock transformers wrote
    whole), as transformers' ``get_last_checkpoint`` names it; ``None`` where there is none.
    Newer ones that fail are skipped, and the log says which and why (collective: every rank
    verifies, and they agree on each folder)."""
    names = D.broadcast_object([p.name for p in numbered_checkpoints(folder, STEM, complete=False)])
    skipped = []
    for name in reversed(names):
        path = Path(folder) / name
        problem = _agreed(_problem(path))
        if problem is None:
            if (path / MANIFEST).exists():
                _VERIFIED.add(_key(path))
            if skipped and _rank() == 0:
                log.warning("mixprec: resuming from %s, the newest good checkpoint; skipped %s", path, "; ".join(skipped))
            return os.path.join(folder, name)
        skipped.append(f"{name} ({problem})")
    if skipped and _rank() == 0:
        log.warning("mixprec: no checkpoint in %s can be resumed: %s", folder, "; ".join(skipped))
    return None


def _why(error: BaseException) -> tuple[str, int | None]:
    return f"{type(error).__name__}: {error}", getattr(error, "errno", None)


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


class EngineCheckpoints:
    """The checkpoint seam of one transformers Trainer under the switch (the module says what it
    hooks). :meth:`attach` installs it; the Trainer's own methods do the writing and reading."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self._save, self._load, self._train = trainer._save_checkpoint, trainer._load_from_checkpoint, trainer.train
        #: The step a SIGTERM stopped the run at (its checkpoint committed), or ``None``.
        self.preempted_at: int | None = None

    @classmethod
    def attach(cls, trainer: Any) -> EngineCheckpoints:
        """Hook ``trainer``'s saves, loads and ``train`` (once: a second call returns the seam in place)."""
        hooked = getattr(vars(trainer).get("_save_checkpoint"), "__self__", None)
        if isinstance(hooked, cls):
            return hooked
        seam = cls(trainer)
        trainer._save_checkpoint = seam.save_checkpoint
        trainer._load_from_checkpoint = seam.load_from_checkpoint
        trainer.train = seam.train
        return seam

    # -- saving ------------------------------------------------------------------------------
    def save_checkpoint(self, model: Any, trial: Any = None) -> None:
        """transformers' ``_save_checkpoint`` into a staging folder, then one atomic commit of
        ``checkpoint-N`` on every filesystem, then transformers' rotation (collective).

        Raises:
            OSError: a write failed (a full disk: ``ENOSPC``), naming the checkpoint; nothing is
                left under its name and the previous checkpoints are untouched.
        """
        trainer = self.trainer
        run_dir = trainer._get_output_dir(trial=trial)
        final = Path(run_dir) / f"{STEM}{trainer.state.global_step}"
        rank = _rank()
        token = D.broadcast_object(uuid.uuid4().hex[:8] if rank == 0 else None)
        stage = os.path.join(run_dir, f".{final.name}.tmp-{token}")
        error: Exception | None = None
        try:
            os.makedirs(stage, exist_ok=True)
            Path(stage, f".rank-{rank}").touch()  # which ranks share this filesystem (read after the gather)
            trainer._get_output_dir = lambda trial=None: stage
            try:
                self._save(model, trial)
            finally:
                del trainer._get_output_dir
            self._best_out_of_staging(stage, run_dir, Path(stage) / final.name)
        except Exception as e:  # noqa: BLE001 - every rank must reach the verdict below
            error = e
        except BaseException:  # an interrupt: nothing to agree on, nothing left behind
            shutil.rmtree(stage, ignore_errors=True)
            raise
        verdicts = D.all_gather_object(None if error is None else _why(error))
        seen = sorted(int(p.name.rsplit("-", 1)[1]) for p in Path(stage).glob(".rank-*"))
        committer = bool(seen) and seen[0] == rank
        failed = [(r, why) for r, why in enumerate(verdicts) if why is not None]
        mine: Exception | None = None
        if committer and not failed and (Path(stage) / final.name).is_dir():
            try:
                folder = Path(stage) / final.name
                commit_checkpoint(folder, final, meta={"writer": "transformers.Trainer under mixprec.patch_transformers",
                                                       "num_processes": len(verdicts)},
                                  written=sync_and_hash(folder))
            except Exception as e:  # noqa: BLE001 - told to every rank below
                mine = e
        commits = D.all_gather_object(None if mine is None else _why(mine))
        if committer:
            shutil.rmtree(stage, ignore_errors=True)
        failed = failed or [(r, why) for r, why in enumerate(commits) if why is not None]
        if failed:
            self._raise(error or mine, failed, final)
        if committer:
            remove_stale(run_dir, STEM)  # what killed saves and deletions left
        if trainer.args.should_save:
            _rotate(run_dir, trainer.args.save_total_limit, trainer.state.best_model_checkpoint)

    def _best_out_of_staging(self, stage: str, run_dir: str, folder: Path) -> None:
        """transformers named the best checkpoint inside the staging folder: name it where it is
        committed, and write ``trainer_state.json`` again with that name (transformers' writer)."""
        state = self.trainer.state
        best = state.best_model_checkpoint
        if best is None or not best.startswith(stage + os.sep):
            return
        state.best_model_checkpoint = os.path.join(run_dir, best[len(stage) + 1:])
        if self.trainer.args.should_save and (folder / "trainer_state.json").is_file():
            state.save_to_json(str(folder / "trainer_state.json"))

    def _raise(self, error: Exception | None, failed: list[tuple[int, Any]], final: Path) -> None:
        if error is not None:
            if is_write_failure(error):
                raise explain_write_error(error, final, self._bytes_needed(final)) from error
            raise error
        rank, (text, code) = failed[0]
        msg = (f"the checkpoint {final} was not written: process {rank} failed ({text}); nothing was left behind "
               "and an earlier checkpoint there is untouched; fix that process's problem and save again")
        raise OSError(code, msg) if code is not None else RuntimeError(msg)

    def _bytes_needed(self, final: Path) -> int:
        """About what ``final`` needs on disk: the newest checkpoint's size, or (for the first) the
        model's and the optimizer's tensors."""
        older = numbered_checkpoints(final.parent, STEM, complete=False)
        if older:
            return _size(older[-1])
        trainer = self.trainer
        tensors = list(trainer.model.state_dict().values())
        if getattr(trainer, "optimizer", None) is not None:
            tensors += [t for s in trainer.optimizer.state_dict()["state"].values() for t in s.values()
                        if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- loading -----------------------------------------------------------------------------
    def load_from_checkpoint(self, resume_from_checkpoint: str, *args: Any, **kwargs: Any) -> Any:
        """Verify the folder (:func:`verify_before_loading`), then transformers' ``_load_from_checkpoint``."""
        verify_before_loading(resume_from_checkpoint)
        return self._load(resume_from_checkpoint, *args, **kwargs)

    # -- preemption --------------------------------------------------------------------------
    def train(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``train`` with SIGTERM turned into a stop at the next optimizer step on
        every rank, a checkpoint at that step, and ``SystemExit(75)``
        (:data:`~mixprec.distributed.PREEMPTED_EXIT_CODE`)."""
        self.preempted_at = None
        with Preemption() as preemption:
            callback = _preemption_callback(self, preemption)
            self.trainer.add_callback(callback)
            try:
                result = self._train(*args, **kwargs)
            finally:
                self.trainer.remove_callback(callback)
        if self.preempted_at is not None:
            if _rank() == 0:
                log.warning("mixprec: SIGTERM received; stopped after step %d with a checkpoint in %s; exiting with "
                            "status %d (continue with resume_from_checkpoint=True)", self.preempted_at,
                            self.trainer.args.output_dir, PREEMPTED_EXIT_CODE)
            raise SystemExit(PREEMPTED_EXIT_CODE)
        return result


def _rotate(run_dir: str, limit: int | None, best: str | None) -> None:
    """transformers' rotation after the commit: its order (``sort_checkpoints`` by mtime, as its
    ``_save_checkpoint`` asks) and its rule (the newest and the best are kept, the oldest of the
    others go until ``limit`` remain), each deletion atomic (:func:`retire_checkpoint`), where
    transformers' ``rmtree`` of a checkpoint killed midway leaves a half-deleted folder under its
    name."""
    if limit is None or limit <= 0:
        return
    from transformers.trainer_utils import sort_checkpoints

    order = sort_checkpoints(run_dir, STEM.rstrip("-"), use_mtime=True)
    if not order:
        return
    protected = {order[-1]} | ({str(Path(best))} if best is not None else set())
    remaining = len(order)
    for old in order:
        if remaining <= max(limit, len(protected)):
            break
        if old not in protected:
            retire_checkpoint(old)
            remaining -= 1


def _preemption_callback(seam: EngineCheckpoints, preemption: Preemption) -> Any:
    """A ``TrainerCallback`` that, after each optimizer step, asks whether any rank got SIGTERM
    and if so makes this step's save and stop."""
    from transformers import TrainerCallback

    class PreemptionCallback(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if preemption.requested():
                control.should_save = control.should_training_stop = True
                seam.preempted_at = state.global_step

    return PreemptionCallback()
