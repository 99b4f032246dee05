"""The built-in GPT: configuration checks, the Hugging Face loss convention, precision, sampling."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from mixprec.tasks.gpt import GPT, GPTConfig

TINY = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)


def _model(config: GPTConfig = TINY, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


def _ids(batch: int = 4, time: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, time), generator=torch.Generator().manual_seed(seed))


def test_config_rejects_n_embd_not_divisible_by_n_head_and_says_the_fix():
    with pytest.raises(ValueError, match=r"n_embd \(30\) must be divisible by n_head \(4\); choose n_head from"):
        GPTConfig(block_size=8, n_layer=1, n_head=4, n_embd=30)


@pytest.mark.parametrize("field, value", [("n_layer", 0), ("block_size", -1), ("n_head", 2.0), ("vocab_size", True)])
def test_config_rejects_sizes_that_are_not_positive_integers(field, value):
    kwargs = dict(block_size=8, n_layer=1, n_head=1, n_embd=8) | {field: value}
    with pytest.raises(ValueError, match=f"GPTConfig.{field} must be a positive integer"):
        GPTConfig(**kwargs)


def test_config_rejects_dropout_outside_unit_interval():
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        GPTConfig(block_size=8, n_layer=1, n_head=1, n_embd=8, dropout=1.0)


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        TINY.n_layer = 3


def test_loss_at_init_is_about_ln_256():
    ids = _ids()
    loss = _model()(ids, labels=ids).loss
    assert loss.dtype == torch.float32
    assert abs(loss.item() - math.log(256)) < 0.1


def test_labels_are_shifted_inside_and_minus_100_is_ignored():
    model, ids = _model(), _ids()
    labels = ids.clone()
    labels[:, 10:20] = -100
    out = model(ids, labels=labels)
    logits = out.logits[:, :-1].reshape(-1, 256)
    targets = labels[:, 1:].reshape(-1)
    keep = targets != -100
    expected = F.cross_entropy(logits[keep], targets[keep])
    torch.testing.assert_close(out.loss, expected)


def test_labels_of_another_shape_are_rejected_with_the_fix():
    ids = _ids()
    with pytest.raises(ValueError, match="pass labels=input_ids"):
        _model()(ids, labels=ids[:, 1:])


def test_sequence_longer_than_block_size_is_rejected_with_the_fix():
    with pytest.raises(ValueError, match="exceeds block_size 32; crop the input"):
        _model()(_ids(time=33))


def test_output_reads_as_attributes_keys_and_indices():
    ids = _ids()
    model = _model()
    out = model(ids, labels=ids)
    assert out["loss"] is out.loss and out[0] is out.loss and out[1] is out.logits
    assert "loss" in out and list(out.keys()) == ["loss", "logits"]
    no_labels = model(ids)
    assert "loss" not in no_labels and no_labels[0] is no_labels.logits
    with pytest.raises(KeyError, match="'loss' is not set"):
        no_labels["loss"]


def test_lm_head_and_token_embedding_are_one_tensor_even_after_a_dtype_cast():
    model = _model()
    assert model.lm_head.weight is model.wte.weight
    model.to(torch.bfloat16)
    assert model.lm_head.weight is model.wte.weight
    assert model.lm_head.weight.data_ptr() == model.wte.weight.data_ptr()


def test_num_parameters_counts_the_tied_matrix_once():
    model = _model()
    unique = {id(p): p.numel() for p in model.parameters()}
    assert model.num_parameters() == sum(unique.values())
    assert model.num_parameters() < sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    embeddings = model.wte.weight.numel() + model.wpe.weight.numel()
    assert model.num_parameters(exclude_embeddings=True) == model.num_parameters() - embeddings


def test_residual_projections_start_smaller_than_other_weights():
    model = _model(GPTConfig(block_size=32, n_layer=8, n_head=4, n_embd=128))
    proj_std = model.h[0].mlp.c_proj.weight.std().item()
    fc_std = model.h[0].mlp.c_fc.weight.std().item()
    assert proj_std == pytest.approx(0.02 / math.sqrt(16), rel=0.1)
    assert fc_std == pytest.approx(0.02, rel=0.1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_gives_low_precision_logits_and_a_finite_float32_loss_close_to_fp32(dtype):
    model, ids = _model(), _ids()
    reference = model(ids, labels=ids).loss
    with torch.autocast("cpu", dtype=dtype):
        out = model(ids, labels=ids)
    assert out.logits.dtype == dtype and out.loss.dtype == torch.float32
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert abs(out.loss.item() - reference.item()) < 0.05


def test_bf16_parameters_give_a_finite_float32_loss_and_gradients():
    model, ids = _model(), _ids()
    model.to(torch.bfloat16)
    out = model(ids, labels=ids)
    assert out.logits.dtype == torch.bfloat16 and out.loss.dtype == torch.float32
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert torch.isfinite(model.wte.weight.grad).all()


def test_padding_mask_leaves_real_positions_unchanged_and_padded_rows_finite():
    model, ids = _model(), _ids()
    mask = torch.ones_like(ids)
    mask[:, 20:] = 0
    mask[0] = 0  # a row that is all padding must not produce NaN
    masked = model(ids, attention_mask=mask).logits
    plain = model(ids).logits
    torch.testing.assert_close(masked[1:, :20], plain[1:, :20])
    assert torch.isfinite(masked).all()


def test_generate_appends_exactly_the_requested_tokens_past_the_block_size():
    model = _model()
    prompt = _ids(batch=2, time=5)
    out = model.generate(prompt, max_new_tokens=40)
    assert out.shape == (2, 45) and out.dtype == torch.long
    assert torch.equal(out[:, :5], prompt)
    assert int(out.min()) >= 0 and int(out.max()) < 256


def test_generate_with_a_seeded_generator_is_reproducible_and_greedy_is_deterministic():
    model, prompt = _model(), _ids(batch=1, time=3)
    first = model.generate(prompt, 10, top_k=5, generator=torch.Generator().manual_seed(7))
    second = model.generate(prompt, 10, top_k=5, generator=torch.Generator().manual_seed(7))
    assert torch.equal(first, second)
    assert torch.equal(model.generate(prompt, 10, temperature=0), model.generate(prompt, 10, temperature=0))


def test_generate_greedy_picks_the_most_likely_token():
    model, prompt = _model(), _ids(batch=2, time=4)
    expected = model(prompt).logits[:, -1].argmax(-1)
    assert torch.equal(model.generate(prompt, 1, temperature=0)[:, -1], expected)


def test_generate_top_1_is_greedy():
    model, prompt = _model(), _ids(batch=2, time=4)
    assert torch.equal(model.generate(prompt, 6, top_k=1), model.generate(prompt, 6, temperature=0))


def test_generate_rejects_a_negative_temperature():
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        _model().generate(_ids(batch=1, time=2), 1, temperature=-1.0)
