"""Tests for mixprec.precision.optim (compensated bf16 optimizers) and mixprec.precision.bf16_true (fp32 norms).

The regression problem: 64 weights drawn in [1.5, 3.5) (bf16's spacing there is 2**-7 and
2**-6, so an update must exceed 2**-9 to move a weight at all), a least-squares target a few
tenths away, and a learning rate that makes every update ~1e-4: plain bf16 updates are all lost
to rounding, while an fp32 run steadily lowers the loss.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import warnings
import weakref

import pytest
import torch
from torch import nn

from mixprec.precision.bf16_true import cast_for_bf16_true, fp32_modules_rule
from mixprec.precision.optim import SGD, AdamW, bf16_stochastic_round, fused_adamw, make_bf16_optimizer

# These runs are hundreds of steps on 64 weights: a second intra-op thread only adds waiting,
# and on a shared 2-core machine that waiting made this file 20x slower.
pytestmark = pytest.mark.usefixtures("one_thread")


# (name, hyperparameters, steps, distance of the target from the start)
_SETUPS = {
    "adamw": (dict(lr=2e-4, weight_decay=0.0), 500, 0.2),
    "sgd": (dict(lr=1e-4, momentum=0.9), 300, 0.3),
}


def _regression(delta: float, d: int = 64, n: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g)
    w0 = (1.5 + 2 * torch.rand(d, generator=g)).bfloat16().float()  # representable: both runs start equal
    y = x @ (w0 + delta * torch.randn(d, generator=g))
    return x, y, w0


def _train(dtype: torch.dtype, name: str, make=None, **opt_kwargs) -> tuple[float, float, torch.Tensor, torch.Tensor]:
    """(initial loss, final loss, initial weights, final weights) of one run."""
    hp, steps, delta = _SETUPS[name]
    x, y, w0 = _regression(delta)
    w = nn.Parameter(w0.to(dtype))
    opt = make([w], **hp) if make is not None else make_bf16_optimizer([w], name=name, **hp, **opt_kwargs)

    def loss() -> torch.Tensor:
        return ((x @ w.float() - y) ** 2).mean()

    first = loss().item()
    for _ in range(steps):
        opt.zero_grad()
        loss().backward()
        opt.step()
    with torch.no_grad():
        return first, loss().item(), w0.to(dtype), w.detach().clone()


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_plain_bf16_updates_below_half_an_ulp_are_lost_entirely(name):
    _, fp32_loss, _, _ = _train(torch.float32, name)
    torch_cls = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[name]
    for make in (None, functools.partial(torch_cls, foreach=True)):  # ours with "none", and torch's own
        first, last, w0, w = _train(torch.bfloat16, name, make=make, compensation="none")
        assert torch.equal(w, w0), "every update should have rounded away"
        assert last == first
    assert fp32_loss < 0.75 * first  # while fp32 learns: the problem is not trivial


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_kahan_compensated_run_tracks_the_fp32_run(name):
    first, fp32_loss, _, _ = _train(torch.float32, name, compensation="none")
    _, loss, w0, w = _train(torch.bfloat16, name, compensation="kahan")
    assert (w != w0).float().mean() > 0.8
    assert abs(loss / fp32_loss - 1) < 0.05, (loss, fp32_loss)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_stochastic_rounding_run_tracks_the_fp32_run(name):
    first, fp32_loss, _, _ = _train(torch.float32, name, compensation="none")
    _, loss, w0, w = _train(torch.bfloat16, name, compensation="stochastic",
                            generator=torch.Generator().manual_seed(0))
    assert (w != w0).float().mean() > 0.8
    # Unbiased but noisy: each rounding moves a weight by up to an ulp, a random walk that the
    # gradient pulls back; it costs a little of the decrease, never the trend (plain loses all).
    assert (first - loss) / (first - fp32_loss) > 0.85, (first, loss, fp32_loss)
    assert abs(loss / fp32_loss - 1) < 0.25, (loss, fp32_loss)


def test_kahan_also_rescues_float16_parameters():
    _, fp32_loss, _, _ = _train(torch.float32, "adamw", compensation="none")
    _, loss, _, _ = _train(torch.float16, "adamw", compensation="kahan")
    assert abs(loss / fp32_loss - 1) < 0.05


def test_stochastic_rounding_of_float16_parameters_is_refused_with_the_fix():
    w = nn.Parameter(torch.ones(4, dtype=torch.float16))
    w.grad = torch.ones_like(w)
    with pytest.raises(ValueError, match="use compensation='kahan' for float16"):
        AdamW([w], compensation="stochastic").step()


def _small_params(dtype: torch.dtype = torch.bfloat16) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(1)
    return [nn.Parameter((1 + torch.rand(16, 8, generator=g)).to(dtype)),
            nn.Parameter(torch.randn(16, generator=g).to(dtype))]


def _step(params: list[nn.Parameter], opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    w, b = params
    ((x @ w.float().T + b.float()) ** 2).mean().backward()
    opt.step()


@pytest.mark.parametrize("name,compensation,state_dtype", [
    ("adamw", "kahan", torch.float32), ("adamw", "stochastic", torch.float32), ("adamw", "kahan", torch.bfloat16),
    ("sgd", "kahan", torch.float32), ("sgd", "stochastic", torch.bfloat16),
])
def test_state_dict_round_trip_continues_bit_for_bit(name, compensation, state_dtype):
    hp = dict(lr=1e-3, weight_decay=0.01) if name == "adamw" else dict(lr=1e-3, momentum=0.9, weight_decay=0.01)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(2))
    params = _small_params()
    opt = make_bf16_optimizer(params, name=name, compensation=compensation, state_dtype=state_dtype,
                              generator=torch.Generator().manual_seed(0), **hp)
    for _ in range(4):
        _step(params, opt, x)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    resumed = [nn.Parameter(p.detach().clone()) for p in params]
    # A different seed: only the generator state saved in the state dict can make this match.
    opt2 = make_bf16_optimizer(resumed, name=name, compensation=compensation, state_dtype=state_dtype,
                               generator=torch.Generator().manual_seed(99), **hp)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    for p, q in zip(params, resumed):
        for key, value in opt.state[p].items():
            assert opt2.state[q][key].dtype == value.dtype, key  # fp32 moments are not cast to bf16
        if compensation == "kahan":
            assert opt2.state[q]["kahan_comp"].dtype == torch.bfloat16
            assert torch.equal(opt2.state[q]["kahan_comp"], opt.state[p]["kahan_comp"])
    for _ in range(4):
        _step(params, opt, x)
        _step(resumed, opt2, x)
    for p, q in zip(params, resumed):
        assert torch.equal(p, q)
        for key, value in opt.state[p].items():
            assert torch.equal(opt2.state[q][key], value), key


def _step_both(ours, theirs, params, ref, steps, seed):
    """Give both optimizers the same random gradients, ``steps`` times."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p, q in zip(params, ref):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        ours.step()
        theirs.step()


def test_fp32_parameters_get_torch_adamw():
    params, ref = _small_params(torch.float32), _small_params(torch.float32)
    ours = AdamW(params, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, compensation="kahan")
    theirs = torch.optim.AdamW(ref, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, foreach=True)
    _step_both(ours, theirs, params, ref, steps=6, seed=3)
    for p, q in zip(params, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
        assert "kahan_comp" not in ours.state[p]  # no compensation where fp32 loses nothing


@pytest.mark.parametrize("kw", [dict(momentum=0.9, weight_decay=0.05), dict(momentum=0.9, nesterov=True),
                                dict(momentum=0.5, dampening=0.3), dict()])
def test_fp32_parameters_get_torch_sgd(kw):
    params, ref = _small_params(torch.float32), _small_params(torch.float32)
    ours, theirs = SGD(params, lr=1e-2, **kw), torch.optim.SGD(ref, lr=1e-2, foreach=True, **kw)
    _step_both(ours, theirs, params, ref, steps=5, seed=4)
    for p, q in zip(params, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def test_step_leaves_the_gradients_untouched():
    params = _small_params()
    opt = AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    before = [p.grad.clone() for p in params]
    opt.step()
    assert all(torch.equal(p.grad, g) for p, g in zip(params, before))


def test_stochastic_rounding_is_unbiased_exact_on_representable_values_and_reproducible():
    x = torch.full((20000,), 1.0 + 2**-10)  # an eighth of the way from 1 to the next bf16 (1 + 2**-7)
    r = bf16_stochastic_round(x, torch.Generator().manual_seed(0))
    assert set(r.float().unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(r.float().mean().item() - x[0].item()) < 2e-4  # ~8 standard errors
    assert torch.equal(r, bf16_stochastic_round(x, torch.Generator().manual_seed(0)))
    exact = torch.tensor([1.0, -2.5, 0.0, float("inf"), 3.0 * 2**-20])
    assert torch.equal(bf16_stochastic_round(exact).float(), exact)
    assert bf16_stochastic_round(torch.tensor([float("nan")])).isnan().all()


@pytest.mark.parametrize("call,match", [
    (lambda p: make_bf16_optimizer(p, name="adam"), "use one of 'adamw', 'sgd'"),
    (lambda p: make_bf16_optimizer(p, compensation="kahn"), "use one of 'kahan', 'stochastic', 'none'"),
    (lambda p: make_bf16_optimizer(p, lr=-1e-3), "pass a learning rate >= 0"),
    (lambda p: make_bf16_optimizer(p, betas=(0.9, 1.0)), r"betas must be two numbers in \[0, 1\)"),
    (lambda p: make_bf16_optimizer(p, betas=(-0.1, 0.99)), r"betas must be two numbers in \[0, 1\)"),
    (lambda p: make_bf16_optimizer(p, state_dtype=torch.float16), "use torch.float32"),
    (lambda p: make_bf16_optimizer(p, name="sgd", betas=(0.9, 0.99)), "SGD has no hyperparameter.*it takes lr"),
    (lambda p: make_bf16_optimizer(p, name="sgd", momentum=1.5), r"momentum must be in \[0, 1\)"),
    (lambda p: make_bf16_optimizer(p, name="sgd", nesterov=True), "nesterov=True needs momentum > 0"),
    (lambda p: make_bf16_optimizer(p, weight_decay=-1), "use 0 to turn weight decay off"),
    (lambda p: AdamW([{"params": p, "lr": -1.0}]), "pass a learning rate >= 0"),
    (lambda p: AdamW(p, generator=0), "pass torch.Generator"),
])
def test_bad_arguments_raise_value_error_stating_the_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call(_small_params())


def _block() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 16),
                         nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)), nn.Linear(16, 4))


def test_cast_for_bf16_true_keeps_norms_fp32_and_runs_forward_and_backward_on_bf16():
    model = cast_for_bf16_true(_block())
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert all(p.dtype == torch.float32 for m in norms for p in m.parameters())
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert all(p.dtype == torch.bfloat16 for m in linears for p in m.parameters())
    seen = []
    norms[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    out = model(x)
    assert seen == [torch.float32] and out.dtype == torch.bfloat16
    out.float().pow(2).mean().backward()
    assert all(p.grad is not None and p.grad.dtype == p.dtype for p in model.parameters())
    opt = make_bf16_optimizer(model.parameters(), lr=1e-3)  # mixed dtypes: bf16 compensated, fp32 plain
    opt.step()
    assert "kahan_comp" not in opt.state[norms[0].weight] and "kahan_comp" in opt.state[linears[0].weight]


def test_cast_for_bf16_true_twice_adds_no_second_hooks_and_can_keep_embeddings():
    model = nn.Sequential(nn.Embedding(10, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    keep = functools.partial(fp32_modules_rule, embeddings=True)
    cast_for_bf16_true(copy.deepcopy(model))
    cast_for_bf16_true(model, keep_fp32=keep)
    cast_for_bf16_true(model, keep_fp32=keep)
    assert len(model[1]._forward_pre_hooks) == 1 and len(model[1]._forward_hooks) == 1
    assert model[0].weight.dtype == torch.float32 and model[2].weight.dtype == torch.bfloat16
    assert model(torch.tensor([[1, 2, 3]])).dtype == torch.bfloat16
    assert not fp32_modules_rule(nn.Embedding(10, 8))
    assert fp32_modules_rule(nn.BatchNorm1d(4)) and fp32_modules_rule(nn.GroupNorm(2, 4))
    with pytest.raises(ValueError, match="pass dtype=torch.bfloat16"):
        cast_for_bf16_true(model, dtype=torch.float32)


def _grads_after_one_step(model, x, outer_hooks=False, before_backward=lambda: None):
    ctx = (torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t) if outer_hooks
           else contextlib.nullcontext())
    model.zero_grad(set_to_none=True)
    with ctx:
        loss = model(x).float().pow(2).mean()
    before_backward()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_a_kept_norm_saves_its_input_for_backward_as_bf16_with_the_same_gradients():
    model = cast_for_bf16_true(_block())
    copies = []
    # Runs after the cast's pre-hook: sees the fp32 copy the LayerNorm gets (and would save).
    model[1].register_forward_pre_hook(lambda m, args: copies.append(weakref.ref(args[0])))
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    alive = []

    def look():
        alive.append(copies.pop()() is not None)

    grads = _grads_after_one_step(model, x, before_backward=look)
    # Another saved-tensor hook outside (checkpointing, offloading): the cast stands aside, the
    # fp32 copy is saved as it is, and the gradients are bit for bit the same.
    kept = _grads_after_one_step(model, x, outer_hooks=True, before_backward=look)
    assert alive == [False, True]  # the fp32 copy was kept until backward only when standing aside
    assert all(torch.equal(a, b) for a, b in zip(grads, kept))


def test_a_kept_norm_works_under_activation_checkpointing_and_after_a_failed_forward():
    model = cast_for_bf16_true(_block())
    x = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
    plain = _grads_after_one_step(model, x)
    model.zero_grad(set_to_none=True)
    torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False).float().pow(2).mean().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain))
    with pytest.raises(RuntimeError):
        model[1](torch.randn(8, 5, dtype=torch.bfloat16))  # wrong width: the forward raises
    assert not model[1].__dict__.get("_mixprec_bf16_true_saving")  # its hooks were taken down
    assert all(torch.equal(a, b) for a, b in zip(plain, _grads_after_one_step(model, x)))


# The fused (compiled, one kernel per parameter) bf16 update of AdamW against its foreach update:
# the same parameters, the same behaviour where plain bf16 stalls, the automatic choice and the
# fallback when compiling fails. Each compiled variant costs a few seconds, once per process.

_SHAPES = [(37, 5), (16,), (1000,), (3, 3, 3)]  # sizes that are not multiples of the vector width


def _params(dtype: torch.dtype = torch.bfloat16) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(1)
    return [nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in _SHAPES]


def _run(fused, compensation="kahan", state_dtype=torch.float32, steps=30, params=None, opt=None, seed=2, **kw):
    params = params if params is not None else _params()
    opt = opt or AdamW(params, lr=1e-3, weight_decay=0.1, compensation=compensation, state_dtype=state_dtype,
                       fused=fused, generator=torch.Generator().manual_seed(0), **kw)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()
    return params, opt


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of bf16's relative spacing at the larger of the two."""
    scale = torch.maximum(a.float().abs(), b.float().abs()).clamp_min(1e-30) * torch.finfo(torch.bfloat16).eps
    return (a.float() - b.float()).abs() / scale


@pytest.mark.parametrize("compensation", ["kahan", "none"])
def test_fused_update_with_fp32_moments_gives_the_foreach_parameters(compensation):
    ref, ref_opt = _run(False, compensation)
    got, got_opt = _run(True, compensation)
    for p, q in zip(ref, got):
        assert torch.equal(p, q)
        for key, value in ref_opt.state[p].items():  # fp32 moments: to fp32 rounding (lerp's formula)
            torch.testing.assert_close(got_opt.state[q][key], value, rtol=1e-5, atol=1e-7, msg=key)


def test_fused_update_with_bf16_moments_stays_within_bf16_rounding_of_the_foreach_one():
    # The foreach update rounds v * beta2 to bf16 before adding g**2 (two ops); the kernel rounds once.
    ref, _ = _run(False, "kahan", torch.bfloat16)
    got, _ = _run(True, "kahan", torch.bfloat16)
    ulps = torch.cat([_ulps(p, q).flatten() for p, q in zip(ref, got)])
    assert ulps.max() <= 4, ulps.max()
    assert (ulps > 0).float().mean() < 0.05


@pytest.mark.parametrize("compensation", ["kahan", "stochastic"])
def test_fused_compensated_run_tracks_fp32_where_plain_bf16_stalls(compensation):
    first, fp32_loss, _, _ = _train(torch.float32, "adamw", compensation="none")
    _, plain, w0, w_plain = _train(torch.bfloat16, "adamw", compensation="none", fused=True)
    assert torch.equal(w_plain, w0) and plain == first  # the fused plain update loses them all too
    _, loss, w0, w = _train(torch.bfloat16, "adamw", compensation=compensation, fused=True,
                            generator=torch.Generator().manual_seed(0))
    assert (w != w0).float().mean() > 0.8
    assert (first - loss) / (first - fp32_loss) > 0.85, (first, loss, fp32_loss)


def test_fused_stochastic_rounding_is_reproducible_under_a_seed_and_differs_across_seeds():
    a, _ = _run(True, "stochastic")
    b, _ = _run(True, "stochastic")
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    params = _params()
    opt = AdamW(params, lr=1e-3, weight_decay=0.1, compensation="stochastic", fused=True,
                generator=torch.Generator().manual_seed(5))
    other, _ = _run(True, params=params, opt=opt)
    assert not all(torch.equal(p, q) for p, q in zip(a, other))
    # and both stay near the foreach run (the same gradients; only the rounding's coin flips differ)
    ref, _ = _run(False, "stochastic")
    ulps = torch.cat([_ulps(p, q).flatten() for p, q in zip(ref, a)])
    assert ulps.median() <= 2, ulps.median()


def test_state_moves_between_fused_and_foreach_updates():
    ref, _ = _run(False, "kahan", steps=20)
    params, opt = _run(True, "kahan", steps=10)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    opt2 = AdamW(params, lr=1e-3, weight_decay=0.1, fused=False)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    # the same gradients as steps 11-20 of the reference run
    g = torch.Generator().manual_seed(2)
    for _ in range(10):
        for p in params:
            torch.randn(p.shape, generator=g)
    for _ in range(10):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt2.step()
    assert all(torch.equal(p, q) for p, q in zip(ref, params))


def test_auto_mode_compiles_only_large_cpu_buckets(monkeypatch):
    calls = []
    real = fused_adamw.step
    monkeypatch.setattr(fused_adamw, "step", lambda *a, **k: calls.append(1) or real(*a, **k))
    _run(None, steps=2)  # 1,264 elements: below the threshold, foreach
    assert calls == []
    monkeypatch.setattr(fused_adamw, "AUTO_MIN_NUMEL", 1000)
    ref, _ = _run(False, steps=3)
    got, _ = _run(None, steps=3)
    assert len(calls) == 3 and all(torch.equal(p, q) for p, q in zip(ref, got))
    fp32 = [nn.Parameter(torch.randn(2000)) for _ in range(2)]
    _run(None, steps=1, params=fp32, opt=AdamW(fp32, fused=None))  # fp32 weights: torch's update, never fused
    assert len(calls) == 3


def test_under_a_sync_or_flop_counting_mode_the_fused_update_gives_way_to_foreach_and_stays_available():
    from mixprec.apps.bench import count_host_syncs

    def three_steps(fused):
        params = _params()
        opt = AdamW(params, lr=1e-3, weight_decay=0.1, fused=fused, generator=torch.Generator().manual_seed(0))
        counts = []
        for seed in (2, 3, 4):  # the middle step under the counter
            counter = count_host_syncs("cpu", ignore=[s["step"] for s in opt.state.values()])
            with counter if seed == 3 else contextlib.nullcontext():
                _run(fused, steps=1, params=params, opt=opt, seed=seed)
            counts += [counter.count] if seed == 3 else []
        assert opt.fused_failure is None  # the counter did not switch the fused update off
        return params, counts

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "compiling failed, using the foreach update" warning
        fused, counts = three_steps(True)
    foreach, _ = three_steps(False)
    assert counts == [0]
    assert all(torch.equal(p, q) for p, q in zip(fused, foreach))  # fp32 moments: bit for bit


def test_a_failed_compile_falls_back_for_that_optimizer_only_with_a_warning_or_raises_when_fused_was_asked_for(
        monkeypatch):
    compiles = []

    def broken(key):
        compiles.append(key)

        def kernel(*args):
            raise RuntimeError("no C++ compiler found")
        return kernel

    monkeypatch.setattr(fused_adamw, "_kernels", {})
    monkeypatch.setattr(fused_adamw, "_kernel_for", broken)
    monkeypatch.setattr(fused_adamw, "AUTO_MIN_NUMEL", 1000)
    with pytest.raises(RuntimeError, match="fused=None .*or fused=False"):
        _run(True, steps=1)
    ref, _ = _run(False, steps=3)
    tried = len(compiles)
    with pytest.warns(RuntimeWarning, match="this optimizer uses the foreach update from now on.*other optimizers"):
        got, opt = _run(None, steps=3)
    assert all(torch.equal(p, q) for p, q in zip(ref, got))  # nothing half-applied: the foreach result
    assert "no C++ compiler found" in opt.fused_failure and len(compiles) == tried + 1  # tried once, not per step
    with pytest.warns(RuntimeWarning, match="uses the foreach update"):
        _, other = _run(None, steps=1)  # another optimizer in the same process tries again
    assert len(compiles) == tried + 2 and other.fused_failure is not None


def test_fused_refuses_bad_values_and_non_contiguous_parameters():
    with pytest.raises(ValueError, match="fused must be None, True or False"):
        AdamW([nn.Parameter(torch.ones(2))], fused="yes")
    w = nn.Parameter(torch.ones(4, 6, dtype=torch.bfloat16).t())
    w.grad = torch.ones_like(w)
    with pytest.raises(ValueError, match="contiguous"):
        AdamW([w], fused=True).step()
