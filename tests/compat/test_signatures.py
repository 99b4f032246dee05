"""The anchors' methods take the same arguments on mixprec's objects: every method of the installed
accelerate's, transformers' and torch's classes that mixprec's twin defines too (public ones, and the
private ones a subclass overrides or calls through ``super()``, as trl's and users' Trainers do) binds
the same call on both.

A subclass written for transformers' Trainer calls ``super().training_step(model, inputs,
num_items_in_batch)`` or ``super()._save_checkpoint(model, trial)``; a loop written for Accelerate
calls ``accelerator.prepare_data_loader(data_loader=dl, device_placement=False)``. Names alone (the
surface test) do not say these run: here, for each method, the anchor's positional parameters are a
prefix of mixprec's, in order and by name, and each of its keyword parameters is one of mixprec's
(or goes into mixprec's ``**kwargs``).
"""

from __future__ import annotations

import inspect

import pytest
import torch

import mixprec

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)

#: Where mixprec's method binds differently, on purpose: "<anchor class>.<method>" -> why.
DIFFERENT = {
    "accelerate.state.AcceleratorState._reset_state": "Accelerate's resets its process-wide singleton from the class "
    "(a staticmethod); mixprec's state is each Accelerator's own: accelerator.state._reset_state()",
    "accelerate.state.GradientState._reset_state": "the same, for the gradient state",
    "transformers.trainer.Trainer.metrics_format": "transformers 5 puts a plain function (metrics) in the class, so "
    "trainer.metrics_format(metrics) raises there; mixprec's is the method it is called as",
    "transformers.trainer_seq2seq.Seq2SeqTrainer.metrics_format": "inherited, the same",
}


def _pairs() -> list[tuple[str, type, type]]:
    import accelerate.data_loader
    import accelerate.local_sgd
    import accelerate.optimizer
    import accelerate.scheduler
    import accelerate.state
    import accelerate.utils
    import transformers.trainer_callback as tc

    from mixprec.accelerator.state import AcceleratorState, GradientState
    from mixprec.accelerator.wrappers import AcceleratedOptimizer, AcceleratedScheduler
    from mixprec.data import PreparedDataLoader

    pairs = [
        (accelerate.Accelerator, mixprec.Accelerator),
        (accelerate.optimizer.AcceleratedOptimizer, AcceleratedOptimizer),
        (accelerate.scheduler.AcceleratedScheduler, AcceleratedScheduler),
        (accelerate.data_loader.DataLoaderShard, PreparedDataLoader),
        (accelerate.state.GradientState, GradientState),
        (accelerate.state.AcceleratorState, AcceleratorState),
        (accelerate.local_sgd.LocalSGD, mixprec.LocalSGD),
        (accelerate.utils.ProjectConfiguration, mixprec.ProjectConfiguration),
        (accelerate.utils.DataLoaderConfiguration, mixprec.DataLoaderConfiguration),
        (accelerate.utils.GradientAccumulationPlugin, mixprec.GradientAccumulationPlugin),
        (accelerate.utils.FullyShardedDataParallelPlugin, mixprec.FullyShardedDataParallelPlugin),
        (torch.amp.GradScaler, mixprec.LossScaler),
        (transformers.Trainer, mixprec.Trainer),
        (transformers.Seq2SeqTrainer, mixprec.Seq2SeqTrainer),
        (transformers.TrainingArguments, mixprec.TrainingArguments),
        (transformers.Seq2SeqTrainingArguments, mixprec.Seq2SeqTrainingArguments),
        (transformers.TrainerState, mixprec.TrainerState),
        (transformers.TrainerControl, mixprec.TrainerControl),
        (tc.TrainerCallback, mixprec.TrainerCallback),
        (tc.DefaultFlowCallback, mixprec.DefaultFlowCallback),
        (tc.ProgressCallback, mixprec.ProgressCallback),
        (tc.PrinterCallback, mixprec.PrinterCallback),
        (tc.EarlyStoppingCallback, mixprec.EarlyStoppingCallback),
    ]
    return [(f"{a.__module__}.{a.__qualname__}", a, m) for a, m in pairs]


def _methods(theirs: type, ours: type) -> list[tuple[str, object, object]]:
    out = []
    for name in sorted(dir(theirs)):
        if name.startswith("__"):
            continue
        raw, mine = inspect.getattr_static(theirs, name, None), inspect.getattr_static(ours, name, None)
        if mine is None or not (inspect.isfunction(raw) or isinstance(raw, (staticmethod, classmethod))):
            continue
        if isinstance(mine, property) or not callable(getattr(ours, name, None)):
            continue
        out.append((name, getattr(theirs, name), getattr(ours, name)))
    return out


def _binding_problem(theirs: object, ours: object) -> str | None:
    """Why a call that binds to ``theirs`` may not bind to ``ours`` (``None``: it does)."""
    try:
        a, m = inspect.signature(theirs).parameters, inspect.signature(ours).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return None
    kinds = {p.kind for p in m.values()}
    if inspect.Parameter.VAR_POSITIONAL in kinds and inspect.Parameter.VAR_KEYWORD in kinds:
        return None  # (*args, **kwargs): takes any call
    pos_a = [n for n, p in a.items() if p.kind in _POSITIONAL]
    pos_m = [n for n, p in m.items() if p.kind in _POSITIONAL]
    if pos_m[:len(pos_a)] != pos_a and inspect.Parameter.VAR_POSITIONAL not in kinds:
        return f"positional parameters {pos_a}, mixprec's {pos_m}"
    keywords = [n for n, p in a.items() if p.kind in (*_POSITIONAL, inspect.Parameter.KEYWORD_ONLY)]
    missing = [n for n in keywords if n not in m]
    if missing and inspect.Parameter.VAR_KEYWORD not in kinds:
        return f"no parameter {missing}"
    required = [n for n, p in m.items() if p.default is inspect.Parameter.empty
                and p.kind in (*_POSITIONAL, inspect.Parameter.KEYWORD_ONLY) and n not in a]
    if required and not any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in a.values()):
        return f"mixprec requires {required}, which the anchor's callers do not pass"
    return None


def test_every_anchor_method_mixprec_has_binds_the_same_calls():
    problems = [f"{label}.{name}: {why}"
                for label, theirs, ours in _pairs()
                for name, a, m in _methods(theirs, ours)
                if f"{label}.{name}" not in DIFFERENT and (why := _binding_problem(a, m)) is not None]
    assert not problems, "\n".join(problems)
    for key in DIFFERENT:  # a listed difference that is gone: the list is stale
        label, name = key.rsplit(".", 1)
        theirs, ours = next((a, m) for lab, a, m in _pairs() if lab == label)
        assert _binding_problem(getattr(theirs, name), getattr(ours, name)) is not None, f"{key} binds alike now"


@pytest.mark.parametrize("name", ["set_seed", "gather_object", "find_executable_batch_size"])
def test_accelerates_utilities_take_the_same_arguments(name):
    import accelerate.utils

    assert _binding_problem(getattr(accelerate.utils, name), getattr(mixprec, name)) is None


def test_the_check_finds_a_method_that_lost_an_argument():
    """The check itself: transformers' training_step signature against one without
    ``num_items_in_batch`` (what mixprec's was), and a renamed first parameter."""
    def old(self, model, inputs):
        return None

    def renamed(self, dataloader, device_placement=None):
        return None

    assert "num_items_in_batch" in _binding_problem(transformers.Trainer.training_step, old)
    assert "positional" in _binding_problem(accelerate.Accelerator.prepare_data_loader, renamed)
    assert _binding_problem(transformers.Trainer.training_step, mixprec.Trainer.training_step) is None
