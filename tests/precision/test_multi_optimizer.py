"""Several prepared optimizers under one loss scaler, against torch's own recipe.

The invariant: every optimizer's gradients are unscaled exactly once, by the scale they were
produced with, and the scale is updated once per iteration, after the last prepared optimizer
has stepped (or been skipped), as torch's "multiple models, losses and optimizers" recipe does
with ``torch.amp.GradScaler``: scale, backward, step each, update once.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mixprec import Accelerator, LossScaler, resolve_precision
from mixprec.precision import ScaledSteps

INIT, STEPS = 1024.0, 4


def _models(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)


def _x(step: int) -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(100 + step))


def _accelerator(**scaler: float) -> Accelerator:
    return Accelerator(mixed_precision="fp16", cpu=True, loss_scaler={"init_scale": INIT, "growth_interval": 1, **scaler})


def _torch_scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=INIT, growth_interval=1)


def _autocast() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.float16)


def _assert_same(ours: list[torch.nn.Module], ref: list[torch.nn.Module]) -> None:
    for m, r in zip(ours, ref):
        for p, q in zip(m.parameters(), r.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def _inject_inf(model: torch.nn.Module) -> None:
    model.weight.grad[0, 0] = float("inf")


@pytest.mark.parametrize("clip", [False, True])
def test_one_loss_feeding_two_optimizers_matches_torchs_recipe(clip):
    a, b = _models()
    ra, rb = _models()
    acc = _accelerator()
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    a, b, oa, ob = acc.prepare(a, b, oa, ob)
    roa, rob = torch.optim.SGD(ra.parameters(), lr=0.1), torch.optim.SGD(rb.parameters(), lr=0.1)
    scaler = _torch_scaler()
    params, ref_params = [*a.parameters(), *b.parameters()], [*ra.parameters(), *rb.parameters()]
    for step in range(STEPS):
        acc.backward(b(a(_x(step))).float().pow(2).mean())
        if clip:
            acc.clip_grad_norm_(params, 0.05)
        oa.step(); ob.step(); oa.zero_grad(); ob.zero_grad()  # noqa: E702

        with _autocast():
            loss = rb(ra(_x(step))).float().pow(2).mean()
        scaler.scale(loss).backward()
        if clip:
            scaler.unscale_(roa); scaler.unscale_(rob)  # noqa: E702
            torch.nn.utils.clip_grad_norm_(ref_params, 0.05)
        scaler.step(roa); scaler.step(rob); scaler.update()  # noqa: E702
        roa.zero_grad(); rob.zero_grad()  # noqa: E702
    _assert_same([a, b], [ra, rb])
    assert acc.scaler.get_scale() == scaler.get_scale() == INIT * 2**STEPS  # one update per iteration
    assert acc.scaler.total_steps == STEPS


def _in_autocast(model: torch.nn.Module):
    # The prepared model's forward is one autocast region per call; a reference whose loss calls
    # D twice inside one region would share autocast's fp16 copy of D's weights between the calls
    # and sum their gradients in fp16 (differing from ours in the last bits).
    def forward(x: torch.Tensor) -> torch.Tensor:
        with _autocast():
            return model(x)
    return forward


def _gan_losses(g, d, step: int) -> tuple:
    z, real = _x(step), _x(step + 50)[:, :1].repeat(1, 4)
    return (lambda: (d(g(z).detach()) - d(real)).float().mean()), (lambda: -d(g(z)).float().mean())


def _gan_pair():
    """A generator and a critic prepared by the Accelerator, and their twins with torch's GradScaler."""
    torch.manual_seed(0)
    g, d = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    rg, rd = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    rg.load_state_dict(g.state_dict()); rd.load_state_dict(d.state_dict())  # noqa: E702
    acc = _accelerator()
    og, od = torch.optim.SGD(g.parameters(), lr=0.05), torch.optim.SGD(d.parameters(), lr=0.05)
    g, d, og, od = acc.prepare(g, d, og, od)
    rog, rod = torch.optim.SGD(rg.parameters(), lr=0.05), torch.optim.SGD(rd.parameters(), lr=0.05)
    return acc, (g, d, og, od), (rg, rd, rog, rod), _torch_scaler()


def _reference_generator_step_closes_the_iteration(acc, scaler, rog, ref_g) -> None:
    """torch's recipe for the generator's step, which ends the iteration: the scales then agree."""
    rog.zero_grad()
    scaler.scale(ref_g()).backward()
    scaler.step(rog)
    scaler.update()
    assert acc.scaler.get_scale() == scaler.get_scale()


def test_gan_loop_two_losses_two_backwards_two_optimizers_matches_torchs_recipe():
    acc, (g, d, og, od), (rg, rd, rog, rod), scaler = _gan_pair()
    for step in range(STEPS):
        loss_d, loss_g = _gan_losses(g, d, step)
        od.zero_grad(); acc.backward(loss_d())  # noqa: E702
        if step == 2:
            _inject_inf(d)
        od.step()
        og.zero_grad(); acc.backward(loss_g()); og.step()  # noqa: E702
        assert od.step_was_skipped is (step == 2) and og.step_was_skipped is False

        ref_d, ref_g = _gan_losses(_in_autocast(rg), _in_autocast(rd), step)
        rod.zero_grad()
        scaler.scale(ref_d()).backward()
        if step == 2:
            _inject_inf(rd)
        scaler.step(rod)
        _reference_generator_step_closes_the_iteration(acc, scaler, rog, ref_g)
    _assert_same([g, d], [rg, rd])
    assert (od.skipped_steps, og.skipped_steps, acc.scaler.skipped_steps) == (1, 0, 1)


def test_critic_stepped_several_times_per_generator_step_matches_torchs_recipe():
    # torch allows one step per optimizer between updates, so a critic stepped k times per
    # generator step closes an iteration before each of its further steps; its k-th step and the
    # generator's share one update, the grouping the reference loop below writes out.
    k = 3
    acc, (g, d, og, od), (rg, rd, rog, rod), scaler = _gan_pair()
    inf_at, ref_skips = (1, 1), []  # cycle 1, the critic's second step
    for cycle in range(3):
        for i in range(k):
            loss_d, _ = _gan_losses(g, d, 10 * cycle + i)
            od.zero_grad(); acc.backward(loss_d())  # noqa: E702
            if (cycle, i) == inf_at:
                _inject_inf(d)
            od.step()

            ref_d, _ = _gan_losses(_in_autocast(rg), _in_autocast(rd), 10 * cycle + i)
            rod.zero_grad()
            scaler.scale(ref_d()).backward()
            if (cycle, i) == inf_at:
                _inject_inf(rd)
            before = rd.weight.detach().clone()
            scaler.step(rod)
            ref_skips.append(torch.equal(before, rd.weight))  # an overflow of its own comes at scale 2**16
            assert od.step_was_skipped is ref_skips[-1]
            if i < k - 1:
                scaler.update()
        _, loss_g = _gan_losses(g, d, 10 * cycle)
        og.zero_grad(); acc.backward(loss_g()); og.step()  # noqa: E702
        _, ref_g = _gan_losses(_in_autocast(rg), _in_autocast(rd), 10 * cycle)
        _reference_generator_step_closes_the_iteration(acc, scaler, rog, ref_g)
    _assert_same([g, d], [rg, rd])
    assert ref_skips[k + 1] and acc.scaler.total_steps == 3 * k
    assert (od.skipped_steps, og.skipped_steps) == (sum(ref_skips), 0)


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    # A fused optimizer skips on the device: which one skipped is known on the host only by a read.
    if kind == "adamw-fused":
        return torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    return torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("kind", ["sgd", "adamw-fused"])
def test_an_inf_in_one_models_gradients_skips_only_its_optimizer_and_its_scheduler(kind):
    a, b = _models()
    ra, rb = _models()
    acc = _accelerator()
    oa, ob = _optimizer(kind, a), _optimizer(kind, b)
    sa = torch.optim.lr_scheduler.StepLR(oa, step_size=1, gamma=0.5)
    sb = torch.optim.lr_scheduler.StepLR(ob, step_size=1, gamma=0.5)
    a, b, oa, ob, sa, sb = acc.prepare(a, b, oa, ob, sa, sb)
    roa, rob = _optimizer(kind, ra), _optimizer(kind, rb)
    rsa = torch.optim.lr_scheduler.StepLR(roa, step_size=1, gamma=0.5)
    rsb = torch.optim.lr_scheduler.StepLR(rob, step_size=1, gamma=0.5)
    scaler = _torch_scaler()
    for step in range(STEPS):
        acc.backward(b(a(_x(step))).float().pow(2).mean())
        with _autocast():
            loss = rb(ra(_x(step))).float().pow(2).mean()
        scaler.scale(loss).backward()
        if step == 1:
            _inject_inf(b); _inject_inf(rb)  # noqa: E702
        oa.step(); ob.step()  # noqa: E702
        assert (bool(oa.skip_flag), bool(ob.skip_flag)) == (False, step == 1)  # (no sync: a device flag if fused)
        sa.step(); sb.step()  # noqa: E702
        assert (oa.step_was_skipped, ob.step_was_skipped, acc.optimizer_step_was_skipped) == (
            False, step == 1, step == 1)
        scaler.step(roa); scaler.step(rob); scaler.update()  # noqa: E702
        rsa.step()
        if step != 1:  # by hand in torch: b's step was skipped, so its schedule waits
            rsb.step()
        for o in (oa, ob, roa, rob):
            o.zero_grad()
    _assert_same([a, b], [ra, rb])
    assert acc.scaler.get_scale() == scaler.get_scale() == INIT * 2**(STEPS - 1) / 2
    assert (oa.skipped_steps, ob.skipped_steps, acc.scaler.skipped_steps) == (0, 1, 1)
    assert (sa.last_epoch, sb.last_epoch) == (STEPS, STEPS - 1)


@pytest.mark.parametrize("n_models, every, clip", [(2, 2, False), (2, 3, False), (3, 2, False), (2, 2, True)],
                         ids=["every-2nd", "every-3rd", "three-optimizers", "clipped"])
def test_gradients_held_across_an_update_are_unscaled_by_the_scale_they_carry(n_models, every, clip):
    # The first optimizers step every iteration, the last every ``every``-th one from the same loss:
    # its gradients add up over iterations whose scales differ (it grows each update). fp32 compute
    # with a power-of-two scale is exact, so the scaled run must match the unscaled one; a scaler
    # updated between its backwards without carrying its gradients would unscale some of them by
    # the wrong scale. Every third: a backward adds to gradients carried across an update; three
    # optimizers: the third prepared is watched as the first two; clipped: each optimizer's
    # gradients are unscaled and clipped before its step (a second unscale of the first since the
    # update starts a new iteration: clipping the scaled gradients would clip them far more).
    def run(scaled: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        models = [torch.nn.Linear(4, 4) for _ in range(n_models - 1)] + [torch.nn.Linear(4, 1)]
        policy = dataclasses.replace(resolve_precision("bf16"), autocast_enabled=False)
        acc = Accelerator(mixed_precision=policy, cpu=True,
                          loss_scaler=LossScaler("cpu", init_scale=2.0**10, growth_interval=1) if scaled else None)
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
        prepared = acc.prepare(*models, *optimizers)
        models, optimizers = prepared[:n_models], prepared[n_models:]
        for step in range(6):
            out = _x(step)
            for m in models:
                out = m(out)
            acc.backward(out.pow(2).mean())
            for i, o in enumerate(optimizers):
                if i < n_models - 1 or step % every == every - 1:
                    if clip:
                        acc.clip_grad_norm_(models[i].parameters(), 0.05)
                    o.step(); o.zero_grad()  # noqa: E702
        if scaled:
            assert acc.scaler.get_scale() > 2.0**10
        return [p.detach().clone() for m in models for p in m.parameters()]

    for p, q in zip(run(True), run(False)):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_diagnostics_watch_every_prepared_model():
    a, b = _models()
    acc = Accelerator(mixed_precision="fp16", cpu=True, diagnostics={"gradient_stats_every": 1})
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    a, b, oa, ob = acc.prepare(a, b, oa, ob)
    acc.backward(b(a(_x(0))).float().pow(2).mean())
    oa.step(); ob.step()  # noqa: E702
    assert len(acc.monitor.models) == 2 and acc.monitor.models[0] is a and acc.monitor.models[1] is b
    modules = set(acc.monitor.summary())
    assert "" in modules and "model1." in modules, modules  # a's root parameters, and b's


def test_gradients_unscaled_and_held_across_an_update_are_unscaled_once():
    # Both models are clipped (unscaled) after the first loss; a second loss reaches A alone, whose
    # second step starts a new iteration while B holds its true gradients: B steps on them, not
    # on them divided by the new scale.
    def run(scaled: bool) -> list[torch.Tensor]:
        a, b = _models()
        policy = dataclasses.replace(resolve_precision("bf16"), autocast_enabled=False)
        acc = Accelerator(mixed_precision=policy, cpu=True,
                          loss_scaler=LossScaler("cpu", init_scale=2.0**10, growth_interval=1) if scaled else None)
        oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
        a, b, oa, ob = acc.prepare(a, b, oa, ob)
        for step in range(3):
            acc.backward(b(a(_x(step))).pow(2).mean())
            acc.clip_grad_norm_([*a.parameters(), *b.parameters()], 0.05)
            oa.step(); oa.zero_grad()  # noqa: E702
            acc.backward(a(_x(step + 10)).pow(2).mean())
            oa.step(); oa.zero_grad()  # noqa: E702
            ob.step(); ob.zero_grad()  # noqa: E702
        if scaled:
            assert acc.scaler.get_scale() > 2.0**10
        return [p.detach().clone() for p in [*a.parameters(), *b.parameters()]]

    for p, q in zip(run(True), run(False)):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("masked", [False, True])
def test_a_generator_loss_waits_for_the_generators_step_and_its_overflow_backs_off_at_the_end_of_the_iteration(
        masked):
    # The generator's loss reaches the critic (stepped) and the generator (not yet): no update
    # before the generator's step, wherever the graph walk meets an input without a gradient (a
    # mask) before the generator's parameters. Its overflow (step 1) backs the scale off at once.
    acc, (g, d, og, od), (rg, rd, rog, rod), scaler = _gan_pair()
    mask = torch.ones(8, 4) if masked else None

    def generator_loss(g, d, step):
        z = _x(step)
        out = g(z) * mask if masked else g(z)
        return -d(out).float().mean()

    for step in range(3):
        loss_d, _ = _gan_losses(g, d, step)
        od.zero_grad(); acc.backward(loss_d()); od.step()  # noqa: E702
        og.zero_grad(); acc.backward(generator_loss(g, d, step))  # noqa: E702
        if step == 1:
            _inject_inf(g)
        og.step()
        assert og.step_was_skipped is (step == 1)

        ref_d, _ = _gan_losses(_in_autocast(rg), _in_autocast(rd), step)
        rod.zero_grad()
        scaler.scale(ref_d()).backward()
        scaler.step(rod)
        rog.zero_grad()
        scaler.scale(generator_loss(_in_autocast(rg), _in_autocast(rd), step)).backward()
        if step == 1:
            _inject_inf(rg)
        scaler.step(rog)
        scaler.update()
        assert acc.scaler.get_scale() == scaler.get_scale(), step
    _assert_same([g, d], [rg, rd])
    assert acc.scaler.total_steps == 3


def test_a_loss_reaching_no_prepared_optimizer_leaves_a_half_stepped_iteration_open():
    a, b = _models()
    aux = torch.nn.Linear(4, 1)  # a model no prepared optimizer steps
    acc = _accelerator()
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    a, b, oa, ob = acc.prepare(a, b, oa, ob)
    acc.backward(b(a(_x(0))).float().pow(2).mean())
    oa.step()
    acc.backward(aux(_x(1)).pow(2).mean())
    assert acc.scaler.total_steps == 0 and acc.scaler.get_scale() == INIT
    ob.step()  # the iteration closes here, once
    assert acc.scaler.total_steps == 1 and acc.scaler.get_scale() == 2 * INIT


def test_the_graph_walk_of_a_half_stepped_iteration_visits_each_node_once():
    # Residual connections make paths through a graph double at each block: a walk that revisited
    # nodes would take 2**40 steps here.
    class CountingDict(dict):
        calls = 0

        def get(self, *args):
            CountingDict.calls += 1
            assert CountingDict.calls < 10_000, "the walk revisits nodes"
            return super().get(*args)

    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    steps = ScaledSteps(LossScaler("cpu", init_scale=INIT))
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    steps.track_optimizer(oa)
    steps.track_optimizer(ob)
    steps.backward(b(a(_x(0))).pow(2).mean())
    steps.optimizer_step(oa)  # b has not stepped: the iteration is half stepped
    steps._owner = CountingDict(steps._owner)
    h = a(_x(1))
    for _ in range(40):
        h = h + h * 0.5
    steps.backward(h.pow(2).mean())  # reaches a (stepped) alone: the walk goes through the whole graph
    assert CountingDict.calls < 200 and steps.scaler.total_steps == 1  # (and it closed the iteration)


def test_before_their_first_step_prepared_optimizers_have_skipped_nothing():
    for n in (1, 2):
        a, b = _models()
        acc = _accelerator()
        prepared = acc.prepare(*[torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b)[:n]])
        for o in prepared if n > 1 else [prepared]:
            assert (o.step_was_skipped, o.skip_flag, o.skipped_steps) == (False, False, 0)


def test_a_checkpoint_of_a_half_stepped_iteration_holds_the_scale_after_its_update(tmp_path):
    a, b = _models()
    acc = _accelerator()
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    a, b, oa, ob = acc.prepare(a, b, oa, ob)
    acc.backward(b(a(_x(0))).float().pow(2).mean())
    oa.step()  # b has not stepped: the iteration is open
    acc.save_state(tmp_path / "ckpt")
    loaded, (la, lb) = _accelerator(), _models()
    loaded.prepare(la, lb, torch.optim.SGD(la.parameters(), lr=0.1), torch.optim.SGD(lb.parameters(), lr=0.1))
    loaded.load_state(tmp_path / "ckpt")
    assert (loaded.scaler.get_scale(), loaded.scaler.total_steps) == (2 * INIT, 1) == (
        acc.scaler.get_scale(), acc.scaler.total_steps)


def test_after_free_memory_the_next_runs_optimizer_closes_each_iteration():
    acc = _accelerator()
    for run in range(2):
        a, _ = _models()
        model, opt = acc.prepare(a, torch.optim.SGD(a.parameters(), lr=0.1))
        for step in range(2):
            acc.backward(model(_x(step)).float().pow(2).mean())
            opt.step()
            opt.zero_grad()
        assert acc.scaler.total_steps == 2 * (run + 1)  # one update per step, in the second run too
        acc.free_memory()


def test_free_memory_takes_the_gradient_hooks_of_several_optimizers_off_their_parameters():
    # With several optimizers each parameter gets a hook that marks its optimizer's gradients
    # fresh; the next run's objects are new, and the old ones must not keep calling into the scaler.
    acc = _accelerator()
    a, b = _models()
    model_a, opt_a, model_b, opt_b = acc.prepare(a, torch.optim.SGD(a.parameters(), lr=0.1),
                                                 b, torch.optim.SGD(b.parameters(), lr=0.1))
    params = [*a.parameters(), *b.parameters()]
    assert all(p._post_accumulate_grad_hooks for p in params)
    acc.free_memory()
    assert not any(p._post_accumulate_grad_hooks for p in params)
