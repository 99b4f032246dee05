"""OverflowTracer: names the first overflowing module, observes only, and costs nothing when off."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mixprec.diagnostics import OverflowTracer, TraceEvent

from toys import Scale


class _BoostGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class BoostGrad(torch.nn.Module):
    """Identity in forward; multiplies the gradient flowing through it in backward."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return _BoostGrad.apply(x, self.factor)


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    extra: tuple


class DataclassOut(torch.nn.Module):
    def forward(self, x):
        return Out(logits=x, extra=({"big": x * 1e5},))


def _scale_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), Scale(1e5), torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))


def _run(model, dtype: torch.dtype | None, x: torch.Tensor | None = None, loss_factor: float = 1.0) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)) if x is None else x
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = model(x)
    (out.float().sum() * loss_factor).backward()


def _hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._backward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_fp16_autocast_names_the_scaling_layer_as_the_first_overflow():
    model = _scale_model()
    with OverflowTracer(model) as tracer:
        _run(model, torch.float16)
        event = tracer.end_step(7)
    assert isinstance(event, TraceEvent)
    assert (event.step, event.module_path, event.kind, event.dtype) == (7, "1", "forward", "float16")
    assert event.nonfinite and event.max_abs == float("inf")
    assert tracer.events == [event]


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp32_and_bf16_have_the_range_for_the_scaling_layer(dtype):
    model = _scale_model()
    with OverflowTracer(model) as tracer:
        _run(model, dtype)
        assert tracer.end_step(0) is None
        assert tracer.events == []


def test_a_gradient_overflow_names_the_module_whose_output_gradient_overflowed():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), BoostGrad(1e5), torch.nn.Linear(16, 1))
    with OverflowTracer(model) as tracer:
        _run(model, torch.float16, loss_factor=100.0)
        event = tracer.end_step(0)
    # The gradient into BoostGrad's output is finite; BoostGrad's backward makes the one into
    # Linear "0"'s output overflow fp16.
    assert (event.module_path, event.kind, event.dtype, event.nonfinite) == ("0", "backward", "float16", True)


def test_a_finite_activation_above_the_threshold_is_flagged_as_near_overflow():
    model = torch.nn.Sequential(torch.nn.Identity(), Scale(40000.0))
    x = torch.ones(2, 3, dtype=torch.float16)
    with OverflowTracer(model, threshold=0.5) as tracer:
        model(x)
        event = tracer.end_step(0)
    assert (event.module_path, event.nonfinite, event.max_abs) == ("1", False, 40000.0)
    with OverflowTracer(model, threshold=0.9) as tracer:
        model(x)
        assert tracer.end_step(1) is None


def _first_event_behind_a_linear_in_fp16(out: torch.nn.Module):
    """The tracer's event for one fp16-autocast forward of ``Linear(4, 4)`` then ``out``."""
    torch.manual_seed(0)  # the same Linear whatever ran before: its largest |y|, 1.21, x 1e5 is past 65504
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), out)
    with OverflowTracer(model) as tracer:
        with torch.autocast("cpu", dtype=torch.float16):
            model(torch.ones(2, 4))
        return tracer.end_step(0)


def test_tensors_inside_dataclass_tuple_and_dict_outputs_are_traced():
    event = _first_event_behind_a_linear_in_fp16(DataclassOut())
    assert (event.module_path, event.kind) == ("1", "forward")


def test_disabled_tracer_registers_no_hooks():
    model = _scale_model()
    tracer = OverflowTracer(model, enabled=False)
    assert _hook_count(model) == 0
    _run(model, torch.float16)
    assert tracer.end_step(0) is None
    tracer.remove()
    assert not tracer.enabled


def test_remove_takes_every_hook_off_and_stops_recording():
    model = _scale_model()
    tracer = OverflowTracer(model)
    assert all(len(m._forward_hooks) == 1 for name, m in model.named_modules() if name)
    assert len(model._forward_hooks) == 0  # the root is not traced when it has submodules
    tracer.remove()
    assert _hook_count(model) == 0
    _run(model, torch.float16)
    assert tracer.end_step(0) is None


def test_a_module_without_submodules_is_traced_as_the_root():
    model = Scale(1e5)
    with OverflowTracer(model) as tracer:
        model(torch.ones(2, dtype=torch.float16))
        assert tracer.end_step(0).module_path == ""


def test_hooks_change_no_output_and_no_gradient():
    def run(traced: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(inplace=True), torch.nn.Linear(16, 4))
        with OverflowTracer(model, enabled=traced) as tracer:
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(1)))
            out.float().square().sum().backward()
            assert tracer.end_step(0) is None
        return out.detach(), [p.grad for p in model.parameters()]

    out_on, grads_on = run(True)  # inplace ReLU after a traced output: must not raise either
    out_off, grads_off = run(False)
    assert torch.equal(out_on, out_off)
    assert all(torch.equal(a, b) for a, b in zip(grads_on, grads_off))


def test_invalid_threshold_raises_an_error_that_states_the_range():
    with pytest.raises(ValueError, match=r"threshold must be a number in \(0, 1\]"):
        OverflowTracer(torch.nn.Linear(2, 2), threshold=2.0)


class UserDictOut(torch.nn.Module):
    """Returns a UserDict holding an object whose attribute is the tensor (neither a dict nor a dataclass)."""

    def forward(self, x):
        import collections
        import types
        return collections.UserDict(hidden=types.SimpleNamespace(big=x * 1e5))


def test_tensors_inside_mappings_and_attributes_of_plain_objects_are_traced():
    event = _first_event_behind_a_linear_in_fp16(UserDictOut())
    assert (event.module_path, event.kind, event.nonfinite) == ("1", "forward", True)
