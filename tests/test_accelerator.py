"""Accelerator: the seed's loop, accumulation, clipping, device placement, no global state."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from mixprec import Accelerator, LossScaler, resolve_precision
from mixprec.data import send_to_device

from toys import LMData, Regression, TinyLM

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.PrecisionPerformanceWarning")


def seed_setup(precision, **kwargs):
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.01 * s))
    train_dataloader = torch.utils.data.DataLoader(LMData(n=512), batch_size=16, shuffle=True)
    return model, optimizer, train_dataloader, lr_scheduler


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_seed_accelerator_snippet_trains_and_loss_falls(precision):
    model, optimizer, train_dataloader, lr_scheduler = seed_setup(precision)
    losses = []
    # The seed's Accelerator snippet, verbatim apart from the import.
    accelerator = Accelerator(mixed_precision=precision)
    model, optimizer, train_dataloader, lr_scheduler = \
        accelerator.prepare(model, optimizer, train_dataloader, lr_scheduler)
    for batch in train_dataloader:
        inputs, targets = batch["input_ids"], batch["labels"]
        outputs = model(inputs, labels=targets)
        loss = outputs.loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    expected = torch.float16 if precision == "fp16" else torch.bfloat16
    assert set(model.seen_dtypes) == {expected}
    assert sum(losses[-4:]) / 4 < 0.6 * sum(losses[:4]) / 4
    if precision == "fp16":
        assert accelerator.scaler is not None and accelerator.scaler.total_steps == len(losses)
    else:
        assert accelerator.scaler is None


def test_fp16_on_cpu_is_real_autocast_and_a_moving_scale():
    model, optimizer, dl, _ = seed_setup("fp16")
    acc = Accelerator(mixed_precision="fp16", cpu=True, loss_scaler={"init_scale": 2.0**8, "growth_interval": 4})
    model, optimizer, dl = acc.prepare(model, optimizer, dl)
    scales = []
    for i, batch in enumerate(dl):
        acc.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
        scales.append(acc.scaler.get_scale())
        if i == 11:
            break
    assert model.seen_dtypes[0] == torch.float16
    assert scales[3] == 2.0**9 and scales[-1] == 2.0**11  # grew every 4 good steps: it is live


def test_injected_inf_skips_step_leaves_params_and_does_not_advance_scheduler():
    model, optimizer, dl, sched = seed_setup("fp16")
    acc = Accelerator(mixed_precision="fp16", cpu=True)
    model, optimizer, dl, sched = acc.prepare(model, optimizer, dl, sched)
    it = iter(dl)
    for _ in range(2):
        acc.backward(model(**next(it)).loss)
        optimizer.step()
        sched.step()
        optimizer.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    lr_before, epoch_before, scale_before = sched.get_last_lr(), sched.last_epoch, acc.scaler.get_scale()
    acc.backward(model(**next(it)).loss)
    model.emb.weight.grad[0, 0] = float("inf")
    optimizer.step()
    sched.step()
    optimizer.zero_grad()
    assert acc.optimizer_step_was_skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert sched.last_epoch == epoch_before and sched.get_last_lr() == lr_before
    assert acc.scaler.get_scale() == scale_before / 2
    acc.backward(model(**next(it)).loss)
    optimizer.step()
    sched.step()
    assert not acc.optimizer_step_was_skipped and sched.last_epoch == epoch_before + 1


def regression_run(accum, batch_size, steps, optimizer="sgd"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if optimizer == "sgd" else torch.optim.AdamW(model.parameters())
    acc = Accelerator(mixed_precision="fp32", gradient_accumulation_steps=accum, cpu=True)
    dl = torch.utils.data.DataLoader(Regression(n=batch_size * steps), batch_size=batch_size)
    model, opt, dl = acc.prepare(model, opt, dl)
    syncs = []
    for x, y in dl:
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            syncs.append(acc.sync_gradients)
            opt.step()
            opt.zero_grad()
    return [p.detach() for p in model.parameters()], syncs


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_accumulating_four_micro_batches_equals_one_batch_four_times_larger(optimizer):
    big, _ = regression_run(accum=1, batch_size=32, steps=3, optimizer=optimizer)
    small, syncs = regression_run(accum=4, batch_size=8, steps=12, optimizer=optimizer)
    assert syncs == [False, False, False, True] * 3
    for a, b in zip(big, small):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_accumulation_syncs_at_the_end_of_the_dataloader():
    _, syncs = regression_run(accum=4, batch_size=8, steps=6)
    assert syncs == [False, False, False, True, False, True]


@pytest.mark.parametrize("fused", [False, True])
def test_clip_grad_norm_unscales_exactly_once_and_matches_unscaled_fp32(fused):
    def run(scaled):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        # fp32 compute with a power-of-two loss scale: scaling is exact, so the runs must match.
        bf16_without_autocast = dataclasses.replace(resolve_precision("bf16"), autocast_enabled=False)
        acc = Accelerator(mixed_precision=bf16_without_autocast, cpu=True,
                          loss_scaler=LossScaler("cpu", init_scale=2.0**12) if scaled else None)
        model, opt = acc.prepare(model, opt)
        norms = []
        for step in range(5):
            x, y = Regression(n=16, seed=step)[:]
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            norms.append(acc.clip_grad_norm_(model.parameters(), 0.5))
            acc.clip_grad_norm_(model.parameters(), 0.5)  # a second call must not unscale again
            opt.step()
            opt.zero_grad()
        return [p.detach() for p in model.parameters()], norms

    scaled, norms_scaled = run(True)
    plain, norms_plain = run(False)
    assert [float(n) for n in norms_scaled] == [float(n) for n in norms_plain]
    for a, b in zip(scaled, plain):
        assert torch.equal(a, b)


def test_clip_grad_value_unscales_first():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accelerator(mixed_precision="fp16", cpu=True, loss_scaler={"init_scale": 2.0**10})
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.ones(2, 4) * 100).float().mean())
    acc.clip_grad_value_(model.parameters(), 1.0)
    assert model.weight.grad.abs().max() <= 1.0 and model.weight.grad.abs().max() > 0.5


def test_prepare_returns_objects_in_order_and_passes_others_through():
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = torch.utils.data.DataLoader(Regression(dim=2), batch_size=4)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    out = acc.prepare(sched, dl, opt, model)
    assert out[3] is model and out[2].optimizer is opt and out[1].dataset is dl.dataset
    assert out[0].scheduler is sched
    other = {"not": "preparable"}
    again = acc.prepare(other, None, out[3], out[2])  # as Accelerate: others unchanged, no double wrap
    assert again[0] is other and again[1] is None and again[2] is out[3] and again[3] is out[2]
    assert len(acc.prepared.models) == 1 and len(acc.prepared.optimizers) == 1
    assert out[3]._is_accelerate_prepared and not hasattr(other, "_is_accelerate_prepared")


def test_bad_arguments_say_the_fix():
    with pytest.raises(ValueError, match="Valid names"):
        Accelerator(mixed_precision="fp12")
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        Accelerator(gradient_accumulation_steps=0)
    with pytest.raises(ValueError, match="ddp_comm_hook"):
        Accelerator(ddp_comm_hook="fp8")
    with pytest.raises(ValueError, match="does nothing for fp32"):
        Accelerator(mixed_precision="no", loss_scaler={"init_scale": 2.0})
    with pytest.raises(TypeError, match="loss_scaler must be"):
        Accelerator(mixed_precision="fp16", loss_scaler=3)


def test_several_accelerators_with_different_precisions_live_in_one_process():
    a = Accelerator(mixed_precision="fp16", cpu=True)
    b = Accelerator(mixed_precision="bf16", cpu=True)
    c = Accelerator(mixed_precision="no", cpu=True)
    ma, mb, mc = (a.prepare(TinyLM()), b.prepare(TinyLM()), c.prepare(TinyLM()))
    x = torch.randint(0, 32, (2, 5))
    # Each computes in its own precision (what autocast was inside each forward), and each returns
    # fp32 outputs, as Accelerate's prepared models do.
    assert {ma(x).logits.dtype, mb(x).logits.dtype, mc(x).logits.dtype} == {torch.float32}
    assert [acc.precision_report().observed["activations"] for acc in (a, b, c)] == ["float16", "bfloat16", "float32"]
    assert a.scaler is not None and b.scaler is None and a.mixed_precision == "fp16" and b.mixed_precision == "bf16"


def test_bf16_true_holds_bf16_params_and_casts_float_inputs():
    acc = Accelerator(mixed_precision="bf16-true", cpu=True)
    torch.manual_seed(0)
    model = acc.prepare(torch.nn.Linear(8, 1))
    assert model.weight.dtype == torch.bfloat16
    out = model(torch.randn(4, 8))  # fp32 input, cast for the bf16 weights
    assert out.dtype == torch.bfloat16


def test_unwrap_model_and_signature_are_the_users():
    import inspect

    acc = Accelerator(mixed_precision="bf16", cpu=True)
    model = TinyLM()
    prepared = acc.prepare(model)
    assert acc.unwrap_model(prepared) is model
    assert list(inspect.signature(prepared.forward).parameters) == ["input_ids", "labels"]
    acc.unwrap_model(prepared, keep_fp32_wrapper=False)
    assert model(torch.zeros(1, 3, dtype=torch.long)).logits.dtype == torch.float32


def test_deepcopy_of_a_prepared_model_runs_its_own_weights():
    import copy

    acc = Accelerator(mixed_precision="bf16", cpu=True)
    model = acc.prepare(torch.nn.Linear(2, 1))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.weight.zero_()
        twin.bias.zero_()
    assert twin(torch.ones(1, 2)).abs().sum() == 0 and model(torch.ones(1, 2)).abs().sum() > 0


@dataclasses.dataclass
class Pair:
    a: torch.Tensor
    b: list


class Encoding(collections.UserDict):
    """Like transformers' BatchEncoding: a UserDict."""


def test_send_to_device_keeps_nested_container_types():
    Point = collections.namedtuple("Point", "x y")
    t = torch.ones(2)
    batch = {"d": Encoding({"ids": t}), "l": [t, (t, Point(t, 3))], "dc": Pair(t, [t])}
    out = send_to_device(batch, torch.device("cpu"), float_dtype=torch.bfloat16)
    assert isinstance(out["d"], Encoding) and out["d"]["ids"].dtype == torch.bfloat16
    assert isinstance(out["l"][1][1], tuple) and type(out["l"][1][1]).__name__ == "Point" and out["l"][1][1].y == 3
    assert isinstance(out["dc"], Pair) and out["dc"].b[0].dtype == torch.bfloat16


def test_dataloader_batches_have_len_and_skip_first_batches_resumes_mid_epoch():
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    dl = acc.prepare(torch.utils.data.DataLoader(Regression(n=40), batch_size=4, shuffle=True))
    assert len(dl) == 10
    torch.manual_seed(1)
    state, rng = dl.state_dict(), torch.get_rng_state()  # one process: the order is drawn from torch's RNG
    first = [x for x, _ in dl]
    dl.load_state_dict(state)
    torch.set_rng_state(rng)  # as load_state restores it
    skipped = [x for x, _ in acc.skip_first_batches(dl, 3)]
    assert len(skipped) == 7 and all(torch.equal(a, b) for a, b in zip(first[3:], skipped))
    again = [x for x, _ in dl]  # the skip applies to one epoch only, and a new order is drawn
    assert len(again) == 10 and not torch.equal(torch.cat(again), torch.cat(first))


def test_gather_and_reduce_in_one_process_are_identities():
    acc = Accelerator(cpu=True)
    t = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(acc.gather(t), t) and torch.equal(acc.gather_for_metrics({"x": t})["x"], t)
    assert torch.equal(acc.reduce(t, "mean"), t)
    assert acc.num_processes == 1 and acc.is_main_process and acc.process_index == 0


def test_works_with_a_real_hugging_face_model_from_a_config():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = [{"input_ids": torch.arange(16).repeat(4, 1) % 64} for _ in range(30)]
    dl = torch.utils.data.DataLoader(data, batch_size=None)
    acc = Accelerator(mixed_precision="fp16", cpu=True)
    model, opt, dl = acc.prepare(model, opt, dl)
    losses = []
    for batch in dl:
        out = model(input_ids=batch["input_ids"], labels=batch["input_ids"])
        acc.backward(out.loss)
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    assert acc.precision_report().observed["activations"] == "float16" and out.logits.dtype == torch.float32
    assert losses[-1] < 0.5 * losses[0]


def stalled_regression(compensation, steps=150, precision="bf16-true"):
    """Weights of magnitude ~2 and Adam updates of ~1e-4: below bf16's resolution there (2**-6)."""
    g = torch.Generator().manual_seed(0)
    w_true = 2.0 + torch.rand(1, 16, generator=g)
    x = torch.randn(256, 16, generator=g)
    y = x @ w_true.T
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(w_true + 0.05 * torch.randn(1, 16, generator=g))
    acc = Accelerator(mixed_precision=precision, cpu=True, bf16_true_compensation=compensation)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0))
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_bf16_true_compensated_update_keeps_learning_where_plain_bf16_stalls():
    plain = stalled_regression("none")
    kahan = stalled_regression("kahan")
    fp32 = stalled_regression("none", precision="fp32")
    assert plain[-1] == pytest.approx(plain[0], rel=1e-3)  # every update rounded away
    assert fp32[-1] < 0.7 * fp32[0]
    assert kahan[-1] == pytest.approx(fp32[-1], rel=0.1)  # the compensated run tracks fp32


def test_bf16_true_keeps_norms_in_fp32_and_the_scheduler_drives_the_compensated_optimizer():
    acc = Accelerator(mixed_precision="bf16-true", cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    model, popt, psched = acc.prepare(model, opt, sched)
    assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float32
    acc.backward(model(torch.randn(3, 4)).float().pow(2).mean())
    popt.step()
    psched.step()
    assert type(popt.optimizer).__module__ == "mixprec.precision.optim.compensated" and popt.optimizer.param_groups[0]["lr"] == 5e-4


@pytest.mark.parametrize("given,expected", [("bf16", torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                            ("fp32", torch.float32)])
def test_bf16_true_state_dtype_sets_the_compensated_optimizers_moments(given, expected):
    acc = Accelerator(mixed_precision="bf16-true", cpu=True, bf16_true_state_dtype=given)
    model = torch.nn.Linear(4, 2)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    acc.backward(model(torch.randn(3, 4)).float().pow(2).mean())
    opt.step()
    state = opt.optimizer.state[model.weight]
    assert state["exp_avg"].dtype == expected and state["exp_avg_sq"].dtype == expected


def test_bf16_true_state_dtype_refuses_other_dtypes_naming_the_valid_ones():
    with pytest.raises(ValueError, match="torch.float32 or torch.bfloat16"):
        Accelerator(mixed_precision="bf16-true", cpu=True, bf16_true_state_dtype="fp16")
