"""Alike parameter groups stepped as one (precision/grouped_step.py): the same weights and optimizer
state as torch's group-by-group step, bit for bit, and the optimizer's own groups afterwards."""

from __future__ import annotations

import copy

import pytest
import torch

from mixprec.precision import grouped_step


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
    model, opt = train(grouped_step.step, opt_cls, **copy.deepcopy(kwargs))
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
        grouped_step.step(opt, closure)
    assert opt.param_groups is groups and len(groups) == 2


def test_groups_that_differ_hooked_optimizers_and_subclasses_are_stepped_by_torch_group_by_group():
    seen = []

    def closure_counting_groups(opt):
        return lambda: seen.append(len(opt.param_groups))

    model = torch.nn.Linear(2, 2)
    decayed = torch.optim.AdamW(two_groups(model, decay=0.01), lr=0.1)  # weight decay on one group only
    grouped_step.step(decayed, closure_counting_groups(decayed))
    hooked = torch.optim.AdamW(two_groups(model), lr=0.1)
    hooked.register_step_pre_hook(lambda opt, args, kwargs: seen.append(("hook", len(opt.param_groups))))
    grouped_step.step(hooked, closure_counting_groups(hooked))

    class MyAdamW(torch.optim.AdamW):
        pass

    subclass = MyAdamW(two_groups(model), lr=0.1)
    grouped_step.step(subclass, closure_counting_groups(subclass))
    sgd = torch.optim.SGD(two_groups(model), lr=0.1)
    grouped_step.step(sgd, closure_counting_groups(sgd))
    assert seen == [2, ("hook", 2), 2, 2, 2]
