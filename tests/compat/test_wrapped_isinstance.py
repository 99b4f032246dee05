"""What the Trainer and the Accelerator hand back answers ``isinstance`` for the user's own
classes, as transformers' Trainer (which keeps the scheduler unwrapped) does: code and tests
check ``isinstance(trainer.lr_scheduler, ReduceLROnPlateau)`` or ``GreedyLR``."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import mixprec
from mixprec.accelerator.wrappers import AcceleratedOptimizer, AcceleratedScheduler

from toys import SineRegressor, SineRows

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("schedule, cls", [
    ("reduce_lr_on_plateau", torch.optim.lr_scheduler.ReduceLROnPlateau),
    ("greedy", "transformers.optimization.GreedyLR"),
    ("linear", torch.optim.lr_scheduler.LambdaLR),
])
def test_the_trainers_scheduler_is_an_instance_of_the_class_transformers_gives(schedule, cls, tmp_path):
    if isinstance(cls, str):
        cls = transformers.optimization.GreedyLR
    classes = {}
    for lib in (transformers, mixprec):
        args = lib.TrainingArguments(output_dir=str(tmp_path / lib.__name__), report_to="none", use_cpu=True,
                                     max_steps=2, eval_strategy="steps", eval_steps=1, save_strategy="no",
                                     lr_scheduler_type=schedule, disable_tqdm=True)
        trainer = lib.Trainer(model=SineRegressor(), args=args, train_dataset=SineRows(), eval_dataset=SineRows())
        trainer.train()
        classes[lib.__name__] = isinstance(trainer.lr_scheduler, cls)
        if lib is mixprec:  # and it is still mixprec's, which steps only when the optimizer step was applied
            assert isinstance(trainer.lr_scheduler, AcceleratedScheduler)
            assert type(trainer.lr_scheduler) is AcceleratedScheduler
    assert classes == {"transformers": True, "mixprec": True}


def test_a_prepared_optimizer_and_scheduler_are_instances_of_the_users_classes_and_of_the_wrappers():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    _, opt, sched = mixprec.Accelerator(cpu=True).prepare(model, optimizer, scheduler)
    assert isinstance(opt, torch.optim.SGD) and isinstance(opt, AcceleratedOptimizer)
    assert isinstance(opt, torch.optim.Optimizer) and not isinstance(opt, torch.optim.AdamW)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR) and isinstance(sched, AcceleratedScheduler)
    assert not isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau)
    # dir() lists the wrapper's names and the wrapped object's; a copy is still the wrapper.
    assert {"step_was_skipped", "param_groups", "train", "eval"} <= set(dir(opt))
    assert {"base_lrs", "last_epoch", "get_last_lr", "step_with_optimizer"} <= set(dir(sched))
    assert type(pickle.loads(pickle.dumps(opt.state_dict()))) is dict
    assert type(copy.copy(opt)) is AcceleratedOptimizer and type(copy.copy(sched)) is AcceleratedScheduler
    assert copy.copy(sched).scheduler is scheduler
    sched.step()
    assert sched.get_last_lr() == scheduler.get_last_lr()
