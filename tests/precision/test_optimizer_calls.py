"""torch's optimizer calls less what nothing observes (precision/optimizer_calls.py): alike parameter
groups stepped as one and the step function called directly give the same weights and optimizer
state as torch's step, bit for bit, with the optimizer's own groups afterwards; zero_grad clears as
torch does; and wherever a hook, a profiler, an override or a schedule would see the difference,
torch's own call is made."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from mixprec.precision import optimizer_calls


def two_groups(model: torch.nn.Module, decay: float = 0.0, no_decay: float = 0.0) -> list[dict]:
    """transformers' Trainer's groups: weights with decay, biases without."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if "bias" not in n], "weight_decay": decay},
            {"params": [p for n, p in named if "bias" in n], "weight_decay": no_decay}]


def train(step, opt_cls=torch.optim.AdamW, steps=12, **opt_kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    opt = opt_cls(two_groups(model, **opt_kwargs.pop("groups", {})), lr=1e-2, **opt_kwargs)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(4, 8, generator=g)).square().mean().backward()
        step(opt)
        opt.zero_grad(set_to_none=True)
    return model, opt


@pytest.mark.parametrize("kwargs", [{"fused": True}, {"foreach": True}, {"foreach": False}, {"amsgrad": True}])
@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.Adam])
def test_alike_groups_stepped_as_one_give_torchs_weights_and_state_bit_for_bit(opt_cls, kwargs):
    ref_model, ref_opt = train(lambda o: o.step(), opt_cls, **copy.deepcopy(kwargs))
    model, opt = train(optimizer_calls.step, opt_cls, **copy.deepcopy(kwargs))
    for p, q in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(p, q)
    assert len(opt.param_groups) == 2 and [len(g["params"]) for g in opt.param_groups] == [2, 2]
    ref_state, state = ref_opt.state_dict(), opt.state_dict()
    assert ref_state["param_groups"] == state["param_groups"]
    for i, s in ref_state["state"].items():
        assert all(torch.equal(v, state["state"][i][k]) for k, v in s.items())


def test_the_optimizer_holds_its_own_groups_during_a_step_that_raises_and_after():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(two_groups(model), lr=0.1)
    groups = opt.param_groups
    model(torch.ones(1, 2)).sum().backward()

    def closure():
        assert len(opt.param_groups) == 1  # the one group, for the step
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        optimizer_calls.step(opt, closure)
    assert opt.param_groups is groups and len(groups) == 2


def test_groups_that_differ_hooked_optimizers_and_subclasses_are_stepped_by_torch_group_by_group():
    seen = []

    def closure_counting_groups(opt):
        return lambda: seen.append(len(opt.param_groups))

    model = torch.nn.Linear(2, 2)
    decayed = torch.optim.AdamW(two_groups(model, decay=0.01), lr=0.1)  # weight decay on one group only
    optimizer_calls.step(decayed, closure_counting_groups(decayed))
    hooked = torch.optim.AdamW(two_groups(model), lr=0.1)
    hooked.register_step_pre_hook(lambda opt, args, kwargs: seen.append(("hook", len(opt.param_groups))))
    optimizer_calls.step(hooked, closure_counting_groups(hooked))

    class MyAdamW(torch.optim.AdamW):
        pass

    subclass = MyAdamW(two_groups(model), lr=0.1)
    optimizer_calls.step(subclass, closure_counting_groups(subclass))
    sgd = torch.optim.SGD(two_groups(model), lr=0.1)
    optimizer_calls.step(sgd, closure_counting_groups(sgd))
    assert seen == [2, ("hook", 2), 2, 2, 2]


def test_a_scheduled_step_called_directly_gives_torchs_weights_and_the_schedule_no_warning():
    def run(step):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
        for i in range(5):
            model(torch.full((3, 4), float(i))).square().mean().backward()
            step(opt)
            optimizer_calls.zero_grad(opt)
            sched.step()  # warns if it thinks the optimizer never stepped
        return model, opt

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, opt = run(optimizer_calls.step)
    ref_model, _ = run(lambda o: o.step())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))
    assert all(p.grad is None for p in model.parameters())


def test_under_a_profiler_torchs_own_calls_are_made_and_recorded():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(two_groups(model), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        optimizer_calls.step(opt)
        optimizer_calls.zero_grad(opt)
    names = {e.name for e in prof.events()}
    assert {"Optimizer.step#AdamW.step", "Optimizer.zero_grad#AdamW.zero_grad"} <= names


def test_overridden_or_replaced_methods_and_clearing_to_zeros_are_torchs_calls():
    calls = []

    class Counting(torch.optim.SGD):
        def zero_grad(self, set_to_none=True):
            calls.append("class zero_grad")
            super().zero_grad(set_to_none)

    model = torch.nn.Linear(2, 2)
    opt = Counting(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    optimizer_calls.zero_grad(opt)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    plain.step = lambda closure=None: calls.append("instance step")
    plain.zero_grad = lambda set_to_none=True: calls.append("instance zero_grad")
    optimizer_calls.step(plain)
    optimizer_calls.zero_grad(plain)
    assert calls == ["class zero_grad", "instance step", "instance zero_grad"]
    model(torch.ones(1, 2)).sum().backward()
    optimizer_calls.zero_grad(torch.optim.SGD(model.parameters(), lr=0.1), set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
