"""GradientStats: its classes are what a cast would do, and observing changes nothing."""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import torch

from mixprec.diagnostics import FORMAT_LIMITS, GradientStats
from mixprec.precision.scaler import LossScaler

LOSS_FACTOR = 1e-7  # makes most gradient values smaller than fp16's flush threshold (2**-25)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
    )


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)


def _backward(model, *, autocast: bool, factor: float) -> None:
    x, y = _batch()
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        out = model(x)
    ((out.float() - y).pow(2).mean() * factor).backward()


def _all_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _overall(record: dict, which: str, key: str, fmt: str = "fp16") -> float:
    """A fraction over the whole model, from the per-module entries (numel-weighted)."""
    mods = record["modules"].values()
    total = sum(m["numel"] for m in mods)
    if key == "zero":
        return sum(m[which]["zero"] * m["numel"] for m in mods) / total
    return sum(m[which][fmt][key] * m["numel"] for m in mods) / total


def _true_fp16_flush(g: torch.Tensor) -> float:
    return ((g.half() == 0) & (g != 0)).double().mean().item()


def test_fp16_flush_fraction_is_what_casting_the_fp32_gradients_would_flush():
    model = _mlp()
    _backward(model, autocast=False, factor=LOSS_FACTOR)
    expected = _true_fp16_flush(_all_grads(model))
    stats = GradientStats(model, scale_source=2.0**16)
    stats.observe(0)
    rec = stats.report()[0]
    assert _overall(rec, "unscaled", "flush") == pytest.approx(expected, abs=1e-9)
    assert expected > 0.5  # most of the gradient would be lost in fp16
    assert _overall(rec, "at_scale", "flush") < 0.01  # a 2**16 loss scale would save nearly all of it


def test_unscaled_fp16_autocast_backward_zeroes_what_the_prediction_said_would_flush():
    # In an fp16 autocast backward the weight gradients are computed in fp16 and only then cast to
    # the fp32 parameters' dtype, so the predicted flushes arrive as exact zeros.
    reference = _mlp()
    _backward(reference, autocast=False, factor=LOSS_FACTOR)
    g32 = _all_grads(reference)
    predicted_zero = (g32 == 0).double().mean().item() + _true_fp16_flush(g32)
    model = _mlp()
    _backward(model, autocast=True, factor=LOSS_FACTOR)
    stats = GradientStats(model)
    stats.observe(0)
    zero = _overall(stats.report()[0], "unscaled", "zero")
    assert zero == pytest.approx(predicted_zero, abs=0.02)
    assert zero > 0.5


def test_scaled_fp16_backward_shows_the_flush_the_loss_scale_prevented():
    reference = _mlp()
    _backward(reference, autocast=False, factor=LOSS_FACTOR)
    g32 = _all_grads(reference)
    model = _mlp()
    scaler = LossScaler("cpu", init_scale=2.0**16)
    x, y = _batch()
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    scaler.scale((out.float() - y).pow(2).mean() * LOSS_FACTOR).backward()
    stats = GradientStats(model, scale_source=scaler)
    stats.observe(0, grads_are_scaled_by=scaler)
    rec = stats.report()[0]
    assert rec["scale"] == rec["grads_scaled_by"] == 2.0**16
    assert _overall(rec, "unscaled", "flush") == pytest.approx(_true_fp16_flush(g32), abs=0.02)
    assert _overall(rec, "at_scale", "flush") < 0.01
    assert _overall(rec, "at_scale", "zero") == pytest.approx((g32 == 0).double().mean().item(), abs=0.02)


def _special_values() -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    n = 4000
    mags = torch.exp2(torch.rand(n, generator=g, dtype=torch.float64) * 285 - 155).float()
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    fp16 = torch.randint(-2**15, 2**15, (500,), generator=g, dtype=torch.int32).to(torch.int16).view(torch.float16)
    bf16 = torch.randint(-2**15, 2**15, (500,), generator=g, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    lim16, limbf = FORMAT_LIMITS["fp16"], FORMAT_LIMITS["bf16"]
    fixed = [0.0, -0.0, math.inf, -math.inf, math.nan, 65504.0, 65519.0, 65521.0, 1e6, lim16.flush_threshold,
             lim16.smallest_subnormal, lim16.smallest_normal, limbf.flush_threshold, limbf.smallest_subnormal,
             limbf.smallest_normal, limbf.max, 2.0**-149, 2.0**-40, 2.0**20]
    return torch.cat([mags * signs, fp16.float(), bf16.float(), torch.tensor(fixed)])


def test_classes_match_the_cast_to_each_format_value_by_value():
    values = _special_values()
    param = torch.nn.Parameter(torch.zeros_like(values))
    param.grad = values.clone()
    model = torch.nn.Module()
    model.register_parameter("w", param)
    stats = GradientStats(model, bins=(-40, 20))
    stats.observe(0)
    entry = stats.report()[0]["parameters"]["w"]["unscaled"]
    n = values.numel()
    nan = torch.isnan(values)
    assert entry["nan"] == int(nan.sum())
    assert entry["zero"] == pytest.approx((values == 0).double().mean().item(), abs=1e-12)
    for fmt, lim in FORMAT_LIMITS.items():
        cast = values.to(lim.dtype).float()
        expected = {
            "flush": ((cast == 0) & (values != 0)).sum(),
            "subnormal": ((cast != 0) & (cast.abs() < lim.smallest_normal)).sum(),
            "overflow": (torch.isinf(cast) & ~nan).sum(),
        }
        for key, count in expected.items():
            assert entry[fmt][key] * n == pytest.approx(float(count), abs=1e-6), (fmt, key)
    # Histogram: bin 0 is (0, 2**-40], then (2**e, 2**(e+1)], the last > 2**20 (inf included).
    mags = values.double().abs()
    counted = mags[(mags > 0) & ~torch.isnan(mags)]
    finite = counted[torch.isfinite(counted)]
    ceil_log2 = torch.ceil(torch.log2(finite)).long()
    expected_hist = torch.bincount((ceil_log2 + 40).clamp(0, 61), minlength=62)
    expected_hist[61] += int(torch.isinf(counted).sum())
    assert entry["log2_hist"] == expected_hist.tolist()
    assert len(stats.hist_edges) == 61


def test_observe_leaves_gradients_bit_for_bit_unchanged():
    model = torch.nn.Module()
    grads = {
        "a": torch.tensor([1e-9, -3.0, math.nan, math.inf, 0.0, 7e4]),
        "b": torch.tensor([1e-9, 6e4, -2.0, math.inf], dtype=torch.float16),
        "c": torch.tensor([1e-30, 3e38, -1.0], dtype=torch.bfloat16),
    }
    for name, g in grads.items():
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        model.register_parameter(name, p)
    stats = GradientStats(model, scale_source=torch.tensor(2.0**16))
    stats.observe(0, grads_are_scaled_by=torch.tensor(4.0))
    stats.observe(1, grads_are_scaled_by=0.5)
    stats.report()
    for name, g in grads.items():
        got = getattr(model, name)
        assert torch.equal(got.grad.view(torch.int8), g.view(torch.int8)), name  # bits, NaN included
        assert got.grad.dtype == g.dtype
        assert torch.equal(got.detach(), torch.zeros_like(g))


def test_sampling_observes_only_every_nth_step():
    model = _mlp()
    _backward(model, autocast=False, factor=1.0)
    stats = GradientStats(model, every_n_steps=3)
    for step in range(10):
        stats.observe(step)
    assert [r["step"] for r in stats.report()] == [0, 3, 6, 9]


@pytest.mark.parametrize("every", [None, 0])
def test_disabled_stats_observe_nothing(every):
    model = _mlp()
    _backward(model, autocast=False, factor=1.0)
    stats = GradientStats(model, every_n_steps=every)
    for step in range(3):
        stats.observe(step, grads_are_scaled_by=2.0)
    assert not stats.enabled
    assert stats.report() == [] and stats.summary() == {}
    assert not stats._tables  # nothing was even built


def test_history_keeps_only_the_last_steps():
    model = _mlp()
    _backward(model, autocast=False, factor=1.0)
    stats = GradientStats(model, history=2)
    for step in range(5):
        stats.observe(step)
    assert [r["step"] for r in stats.report()] == [3, 4]


def test_module_entries_roll_up_the_parameters_of_the_parent_module():
    model = torch.nn.Sequential(OrderedDict(encoder=torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))))
    enc0 = model.encoder[0]
    enc0.weight.grad = torch.tensor([[0.0, 1.0, 1e-9, 1.0]] * 3)  # 3 zeros, 3 fp16 flushes of 12
    enc0.bias.grad = torch.tensor([0.0, 0.0, 1e5])  # 2 zeros, 1 fp16 overflow of 3
    rec_stats = GradientStats(model)
    rec_stats.observe(0)
    rec = rec_stats.report()[0]
    assert set(rec["modules"]) == {"encoder.0"}  # encoder.1 has no gradient this step
    assert set(rec["parameters"]) == {"encoder.0.weight", "encoder.0.bias"}
    mod = rec["modules"]["encoder.0"]
    assert mod["numel"] == 15
    assert mod["unscaled"]["zero"] == pytest.approx(5 / 15)
    assert mod["unscaled"]["fp16"]["flush"] == pytest.approx(3 / 15)
    assert mod["unscaled"]["fp16"]["overflow"] == pytest.approx(1 / 15)
    assert mod["unscaled"]["bf16"]["overflow"] == 0.0
    assert rec["parameters"]["encoder.0.bias"]["unscaled"]["zero"] == pytest.approx(2 / 3)


def test_summary_gives_each_modules_worst_flush_over_the_steps():
    model = torch.nn.Linear(4, 1)
    stats = GradientStats(model, scale_source=2.0**10)
    model.weight.grad = torch.full((1, 4), 1e-9)  # flushes unscaled, not at 2**10 (1e-6 > 2**-25)
    model.bias.grad = torch.ones(1)
    stats.observe(0)
    model.weight.grad = torch.ones(1, 4)
    stats.observe(1)
    summary = stats.summary()
    assert summary[""]["fp16_flush_unscaled"] == pytest.approx(4 / 5)
    assert summary[""]["fp16_flush_at_scale"] == 0.0
    assert summary[""]["steps"] == 2


def test_the_scale_is_the_one_at_observe_time():
    model = torch.nn.Linear(2, 1)
    model.weight.grad, model.bias.grad = torch.ones(1, 2), torch.ones(1)
    scale = torch.tensor(4.0)
    stats = GradientStats(model, scale_source=lambda: scale)
    stats.observe(0)
    scale.fill_(8.0)  # a scaler updates its scale tensor in place
    assert stats.report()[0]["scale"] == 4.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"every_n_steps": -1}, "every_n_steps must be"),
        ({"bins": (5, 1)}, "bins must be"),
        ({"scale_source": "2**16"}, "scale_source must be"),
        ({"history": 0}, "history must be"),
    ],
)
def test_invalid_arguments_raise_errors_that_state_the_fix(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        GradientStats(torch.nn.Linear(2, 1), **kwargs)


def test_a_parameter_without_a_gradient_is_left_out_of_that_step_only():
    model = torch.nn.Linear(3, 2)
    stats = GradientStats(model, scale_source=torch.amp.GradScaler("cpu", enabled=False))
    model.weight.grad, model.bias.grad = torch.zeros(2, 3), torch.ones(2)
    stats.observe(0)
    model.bias.grad = None
    stats.observe(1)
    model.bias.grad = torch.zeros(2)
    stats.observe(2)
    first, second, third = stats.report()
    assert first["scale"] == 1.0  # a disabled scaler scales by 1
    assert set(second["parameters"]) == {"weight"} and second["modules"][""]["numel"] == 6
    assert first["modules"][""]["unscaled"]["zero"] == pytest.approx(6 / 8)
    assert third["modules"][""]["unscaled"]["zero"] == 1.0
