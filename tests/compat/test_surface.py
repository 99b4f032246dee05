"""The anchors' public surface, read from the installed accelerate, transformers and torch: every
public name of their classes and every field of their configs, against mixprec's.

The names mixprec lacks today are listed in ``surface_missing.txt`` (issues 23 and 24 fill them
in). A name mixprec has never goes missing again: a test fails on any missing name not in that
list, and on a listed name that is now present (the list is then stale: delete its line).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from pathlib import Path

import pytest
import torch

import mixprec

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

LISTED = Path(__file__).with_name("surface_missing.txt")


def _public(obj: object) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _accelerate_instances() -> tuple[object, object]:
    from accelerate.state import AcceleratorState

    try:
        theirs = accelerate.Accelerator(cpu=True)
        names = (_public(theirs), _public(theirs.state), _public(theirs.gradient_state))
    finally:
        AcceleratorState._reset_state(True)  # Accelerate's process-wide singletons
    ours = mixprec.Accelerator(cpu=True)
    return names, (_public(ours), _public(ours.state), _public(ours.gradient_state))


def _prepared_instances(lib: object) -> tuple[set[str], set[str], set[str]]:
    """The public names of what ``prepare`` hands back: the optimizer, scheduler and dataloader."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 2)), batch_size=2)
    _, opt, sched, dl = lib.Accelerator(cpu=True).prepare(model, optimizer, scheduler, loader)
    return _public(opt), _public(sched), _public(dl)


def _trainer_instances(lib: object, out: Path) -> dict[str, object]:
    """Every object a Trainer user's code holds, live, after one training step: the arguments,
    the trainer, its state, control, optimizer, scheduler and callbacks, and an EvalPrediction;
    and the Seq2Seq pair."""
    from toys import SineRegressor, SineRows

    args = lib.TrainingArguments(output_dir=str(out / lib.__name__), report_to="none", use_cpu=True, max_steps=1,
                                 save_strategy="no", disable_tqdm=True)
    trainer = lib.Trainer(model=SineRegressor(), args=args, train_dataset=SineRows())
    trainer.train()
    held = {"TrainingArguments()": args, "Trainer()": trainer, "trainer.state": trainer.state,
            "trainer.control": trainer.control, "trainer.optimizer": trainer.optimizer,
            "trainer.lr_scheduler": trainer.lr_scheduler, "trainer.callback_handler": trainer.callback_handler,
            "EvalPrediction()": lib.EvalPrediction(predictions=torch.zeros(2), label_ids=torch.zeros(2)),
            "EarlyStoppingCallback()": lib.EarlyStoppingCallback(), "ProgressCallback()": lib.ProgressCallback()}
    for callback in trainer.callback_handler.callbacks:
        held[f"{type(callback).__name__}()"] = callback
    s2s_args = lib.Seq2SeqTrainingArguments(output_dir=str(out / lib.__name__), report_to="none", use_cpu=True)
    held["Seq2SeqTrainingArguments()"] = s2s_args
    held["Seq2SeqTrainer()"] = lib.Seq2SeqTrainer(model=SineRegressor(), args=s2s_args)
    return held


def _transformers_instances(tmp: Path) -> dict[str, tuple[set[str], set[str]]]:
    from accelerate.state import AcceleratorState

    try:
        theirs = _trainer_instances(transformers, tmp)
        prepared = _prepared_instances(accelerate)
    finally:
        AcceleratorState._reset_state(True)  # the Trainer's Accelerator set Accelerate's singletons
    ours = _trainer_instances(mixprec, tmp)
    mine = _prepared_instances(mixprec)
    found = {f"accelerator.prepare {what}": (prepared[i], mine[i])
             for i, what in enumerate(("optimizer", "scheduler", "dataloader"))}
    for where, obj in theirs.items():
        found[f"transformers.{where}"] = (_public(obj), _public(ours[where]) if where in ours else set())
    return found


@functools.cache
def surfaces() -> dict[str, tuple[set[str], set[str]]]:
    """What each anchor offers and what mixprec offers, by surface (measured once per session)."""
    import tempfile

    (acc, state, grad), (m_acc, m_state, m_grad) = _accelerate_instances()
    with tempfile.TemporaryDirectory() as tmp:
        held = _transformers_instances(Path(tmp))
    init = lambda cls: set(inspect.signature(cls.__init__).parameters) - {"self"}  # noqa: E731
    return {
        "accelerate.Accelerator": (acc, m_acc),
        "accelerate.Accelerator()": (init(accelerate.Accelerator), init(mixprec.Accelerator)),
        "accelerator.state": (state, m_state),
        "accelerator.gradient_state": (grad, m_grad),
        "accelerate.DistributedType": (set(accelerate.utils.DistributedType.__members__),
                                       set(mixprec.DistributedType.__members__)),
        **{f"accelerate.{c}": (_fields(getattr(accelerate.utils, c)), _fields(getattr(mixprec, c)))
           for c in ("ProjectConfiguration", "DataLoaderConfiguration", "GradientAccumulationPlugin",
                     "FullyShardedDataParallelPlugin")},
        "transformers.Trainer": (_public(transformers.Trainer), _public(mixprec.Trainer)),
        "transformers.TrainingArguments": (_fields(transformers.TrainingArguments), _fields(mixprec.TrainingArguments)),
        "transformers.TrainerCallback": (_public(transformers.TrainerCallback), _public(mixprec.TrainerCallback)),
        "transformers.TrainerState": (_fields(transformers.TrainerState), _fields(mixprec.TrainerState)),
        "torch.amp.GradScaler": (_public(torch.amp.GradScaler), _public(mixprec.LossScaler)),
        **held,
    }


def listed() -> set[str]:
    lines = (line.split("#")[0].strip() for line in LISTED.read_text().splitlines())
    return {line for line in lines if line}


def test_no_public_name_of_the_anchors_goes_missing_beyond_the_listed_ones():
    missing = {f"{where} {name}" for where, (theirs, ours) in surfaces().items() for name in theirs - ours}
    counts = {where: f"{len(theirs & ours)}/{len(theirs)}" for where, (theirs, ours) in surfaces().items()}
    print("\n".join(f"{where}: {c}" for where, c in counts.items()))
    assert not missing - listed(), f"names mixprec lost (or the anchor added): {sorted(missing - listed())}"
    assert not listed() - missing, f"present now, delete from {LISTED.name}: {sorted(listed() - missing)}"


#: The compatibility tables of the docs' migration pages, one file per anchor, included by the pages.
GENERATED = Path(__file__).resolve().parents[2] / "docs" / "_generated"
ANCHORS = {"accelerate": ("accelerate.", "accelerator."), "transformers": ("transformers.",), "torch": ("torch.",)}
REGENERATE = "`.venv/bin/python tests/compat/test_surface.py`"


def surface_tables() -> dict[Path, str]:
    """The docs' compatibility tables (``docs/_generated/surface-<anchor>.md``), from the same
    comparison (so they cannot drift)."""
    measured = surfaces()
    tables = {}
    for anchor, prefixes in ANCHORS.items():
        rows = [f"<!-- generated by tests/compat/test_surface.py from the installed {anchor}: regenerate with "
                f"{REGENERATE} -->", "", "| surface | mixprec has | missing |", "|---|---|---|"]
        for where, (theirs, ours) in measured.items():
            if not where.startswith(prefixes):
                continue
            missing = sorted(theirs - ours)
            shown = ", ".join(f"`{n}`" for n in missing[:12]) + (f" and {len(missing) - 12} more"
                                                                   if len(missing) > 12 else "")
            rows.append(f"| `{where}` | {len(theirs & ours)} of {len(theirs)} | {shown or 'none'} |")
        tables[GENERATED / f"surface-{anchor}.md"] = "\n".join(rows) + "\n"
    return tables


def test_the_docs_compatibility_tables_are_the_surface_as_measured():
    for path, table in surface_tables().items():
        assert path.exists() and path.read_text() == table, (
            f"{path.relative_to(GENERATED.parents[1])} is stale; regenerate it with {REGENERATE}")


if __name__ == "__main__":  # rewrite the docs' tables
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # toys.py, as pytest's pythonpath gives it
    GENERATED.mkdir(parents=True, exist_ok=True)
    for path, table in surface_tables().items():
        path.write_text(table)
