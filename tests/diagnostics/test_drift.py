"""precision_drift: a small, finite drift for bf16, and a training run it leaves untouched."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec.diagnostics import precision_drift


class Noise(torch.nn.Module):
    """Draws from the global RNG in every mode, eval included (as some augmenting models do)."""

    def forward(self, x):
        return x + 1e-3 * torch.randn_like(x)


def _model(dropout: float = 0.2) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.GELU(), torch.nn.Dropout(dropout),
        Noise(), torch.nn.Linear(32, 1),
    )


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).float(), y)


def _bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_bf16_drift_is_small_and_the_rng_state_is_unchanged():
    model = _model()
    rng = torch.get_rng_state()
    out = precision_drift(model, _batch(), _loss, _bf16())
    assert torch.equal(torch.get_rng_state(), rng)
    assert set(out) == {"loss_fp32", "loss_mixed", "rel_diff"}
    assert all(isinstance(v, float) and math.isfinite(v) for v in out.values())
    assert 0.0 < out["rel_diff"] < 0.1
    assert out["rel_diff"] == pytest.approx(abs(out["loss_mixed"] - out["loss_fp32"]) / abs(out["loss_fp32"]))


def test_fp32_loss_is_the_loss_without_autocast_in_eval_mode():
    model = _model()
    out = precision_drift(model, _batch(), _loss, _bf16)  # a callable returning the context works too
    model.eval()
    with torch.no_grad():
        assert out["loss_fp32"] == _loss(model, _batch()).item()


def test_a_training_run_with_drift_checks_is_bit_for_bit_the_run_without():
    def train(check_drift: bool) -> list[torch.Tensor]:
        model = _model(dropout=0.5)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(123)  # the dropout stream
        for step in range(3):
            if check_drift:
                precision_drift(model, _batch(step), _loss, _bf16())
            opt.zero_grad()
            _loss(model, _batch(step)).backward()
            opt.step()
        return [t.detach().clone() for t in model.state_dict().values()]

    with_checks, without = train(True), train(False)
    assert all(torch.equal(a, b) for a, b in zip(with_checks, without))


def test_modes_and_batch_norm_statistics_are_restored():
    model = _model()
    model.train()
    model[3].eval()  # a submodule in another mode than its parent keeps its own mode
    before = {k: v.clone() for k, v in model.state_dict().items()}
    precision_drift(model, _batch(), _loss, _bf16())
    assert model.training and model[1].training and not model[3].training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_bf16_parameters_are_compared_against_a_float32_copy():
    model = _model().to(torch.bfloat16)
    params = [p.detach().clone() for p in model.parameters()]

    def loss(m, batch):
        x, y = batch
        dtype = next(m.parameters()).dtype
        return torch.nn.functional.mse_loss(m(x.to(dtype)).float(), y)

    out = precision_drift(model, _batch(), loss, _bf16())
    assert math.isfinite(out["rel_diff"]) and out["rel_diff"] < 0.1
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, q) for p, q in zip(model.parameters(), params))


def test_calling_it_inside_an_autocast_region_raises_an_error_that_states_the_fix():
    model = _model()
    with _bf16(), pytest.raises(RuntimeError, match="call it outside"):
        precision_drift(model, _batch(), _loss, _bf16())


def test_a_loss_that_is_not_a_scalar_raises_an_error_that_says_what_to_return():
    with pytest.raises(TypeError, match="must return a scalar loss"):
        precision_drift(_model(), _batch(), lambda m, b: m(b[0]), _bf16())


def test_both_passes_see_the_same_random_draws_so_no_autocast_means_no_drift():
    out = precision_drift(_model(), _batch(), _loss, torch.autocast("cpu", enabled=False))
    assert out["rel_diff"] == 0.0 and out["loss_fp32"] == out["loss_mixed"]


def test_the_fp32_copy_gets_float32_inputs_from_named_tuples_and_mappings_too():
    import collections

    Batch = collections.namedtuple("Batch", "x y")
    seen = []

    def loss(m, batch):
        seen.append(batch.x.dtype)
        return {"loss": torch.nn.functional.mse_loss(m(batch.x.to(next(m.parameters()).dtype)).float(), batch.y)}

    x, y = _batch()
    model = _model().to(torch.bfloat16)
    precision_drift(model, Batch(x.bfloat16(), y), loss, _bf16())  # the loss comes back as {"loss": ...}
    assert seen[0] == torch.float32  # the fp32 pass: a namedtuple used to keep its bf16 tensor
