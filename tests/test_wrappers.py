"""mixprec.accelerator.wrappers on their own: the precision around forward, and the wrappers' way back out."""

from __future__ import annotations

import pytest
import torch

from mixprec.accelerator.wrappers import patch_forward, unpatch_forward, unwrap
from mixprec.models import original_forward
from mixprec.precision import make_plugin


class Recording(torch.nn.Linear):
    """A Linear that records the dtype its own forward computed (before any output conversion)."""

    def forward(self, x):
        y = super().forward(x)
        self.inside = y.dtype
        return y


def test_a_patched_forward_runs_in_the_plugin_read_at_call_time_and_unpatches_cleanly():
    model = Recording(4, 2)
    own = model.forward
    current = {"plugin": make_plugin("bf16", "cpu")}
    patch_forward(model, lambda: current["plugin"])
    assert original_forward(model) == own
    out = model(torch.randn(3, 4))
    # autocast around the user's forward, and the output returned in fp32 (as Accelerate's prepared model does)
    assert model.inside == torch.bfloat16 and out.dtype == torch.float32
    current["plugin"] = make_plugin("fp32", "cpu")  # a fallback is one assignment
    assert model(torch.randn(3, 4)).dtype == torch.float32 and model.inside == torch.float32
    assert unpatch_forward(model) is model and model(torch.randn(3, 4)).dtype == torch.float32
    assert original_forward(model) == own


def test_unwrap_goes_through_data_parallel_and_compile_wrappers():
    inner = torch.nn.Linear(4, 2)
    assert unwrap(inner) is inner
    assert unwrap(torch.nn.DataParallel(inner)) is inner
    assert unwrap(torch.compile(torch.nn.DataParallel(inner))) is inner


def _same_state(a: dict, b: dict) -> None:
    """Two optimizer state dicts hold the same values (tensors compared bit for bit)."""
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys() and a["state"]
    for k, state in a["state"].items():
        assert state.keys() == b["state"][k].keys()
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][k][name])), (k, name)


def _train_step(acc, opt, sched, x: torch.Tensor) -> tuple[list[torch.Tensor], list[float]]:
    """One step of a linear layer held by ``opt`` alone (its weight and bias, applied by hand: the
    optimizer is what is tested, not a prepared model), its loss through ``acc.backward``."""
    weight, bias = opt.param_groups[0]["params"]
    acc.backward((x @ weight.T + bias).pow(2).mean())
    opt.step()
    sched.step()
    opt.zero_grad()
    return [weight.detach().clone(), bias.detach().clone()], sched.get_last_lr()


@pytest.mark.parametrize("precision", ["no", "fp16"])
@pytest.mark.filterwarnings("ignore::mixprec.PrecisionPerformanceWarning")
def test_a_prepared_optimizer_and_scheduler_pickle_whole_keep_their_state_and_still_step(precision):
    """The wrappers themselves pickle (not only their state dicts; Accelerate's do, and multiprocessing
    hands them over so): the copy is the wrapper, with the optimizer's state, the loss scaler's scale
    and the schedule's position; pickled with its Accelerator, it steps through the copied one (scaled
    and unscaled in fp16), and takes the same step as the original from the same batch."""
    import pickle

    import mixprec
    from mixprec.accelerator.wrappers import AcceleratedOptimizer, AcceleratedScheduler

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    acc = mixprec.Accelerator(cpu=True, mixed_precision=precision)
    opt, sched = acc.prepare(optimizer, scheduler)
    _train_step(acc, opt, sched, torch.randn(8, 4))

    alone = pickle.loads(pickle.dumps(opt))
    assert type(alone) is AcceleratedOptimizer and isinstance(alone, torch.optim.AdamW)
    _same_state(alone.state_dict(), opt.state_dict())
    copy_acc, copy_opt, copy_sched = pickle.loads(pickle.dumps((acc, opt, sched)))
    assert type(copy_opt) is AcceleratedOptimizer and type(copy_sched) is AcceleratedScheduler
    assert isinstance(copy_sched, torch.optim.lr_scheduler.StepLR) and copy_sched.optimizers == [copy_opt]
    assert copy_sched.scheduler.optimizer is copy_opt.optimizer and copy_opt.hooks.step.__self__ is copy_acc.steps
    _same_state(copy_opt.state_dict(), opt.state_dict())
    assert copy_sched.state_dict() == sched.state_dict() and copy_sched.get_last_lr() == [0.05]
    if precision == "fp16":
        assert copy_opt.scaler is copy_acc.scaler and copy_acc.scaler.get_scale() == acc.scaler.get_scale()

    x = torch.randn(8, 4)
    before = [p.detach().clone() for p in copy_opt.param_groups[0]["params"]]
    copied, copied_lr = _train_step(copy_acc, copy_opt, copy_sched, x)
    original, original_lr = _train_step(acc, opt, sched, x)
    assert not any(torch.equal(a, b) for a, b in zip(copied, before))  # the copy stepped
    assert all(torch.equal(a, b) for a, b in zip(copied, original)) and copied_lr == original_lr == [0.025]
    _same_state(copy_opt.state_dict(), opt.state_dict())


def test_a_prepared_model_pickled_with_its_accelerator_computes_in_its_precision():
    import pickle

    import mixprec

    acc = mixprec.Accelerator(cpu=True, mixed_precision="bf16")
    model = acc.prepare(torch.nn.Linear(4, 2))
    _, copy = pickle.loads(pickle.dumps((acc, model)))
    x = torch.randn(8, 4)
    assert torch.equal(copy(x), model(x))  # bf16 autocast: an fp32 forward would differ
    assert not torch.equal(copy(x), torch.nn.functional.linear(x, copy.weight, copy.bias))
