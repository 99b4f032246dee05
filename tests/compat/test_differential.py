"""The same script under the installed anchor and under mixprec, compared step for step.

An Accelerate loop (gradient accumulation, clipping, a scheduler, ``gather_for_metrics``) under
``accelerate.Accelerator`` and ``mixprec.Accelerator``; a Trainer run under ``transformers.Trainer``
and ``mixprec.Trainer``. Where they differ on purpose (fp16 on the CPU) the test says which is right.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import mixprec

from toys import SineRegressor as _Regressor
from toys import SineRows as _Rows
from toys import sine_data as _data
from toys import sine_net as _net

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")


def accelerate_loop(accelerator_cls: type, mixed_precision: str) -> dict:
    """Accelerate's documented loop, two epochs; what it logs and the weights it ends with."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / 20))
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data(72)), batch_size=8)
    acc = accelerator_cls(mixed_precision=mixed_precision, gradient_accumulation_steps=2, cpu=True)
    try:
        model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
        seen: dict = {"loss": [], "lr": [], "grad_norm": []}
        for _ in range(2):
            model.train()
            for x, y in dl:
                with acc.accumulate(model):
                    loss = F.mse_loss(model(x), y)
                    acc.backward(loss)
                    if acc.sync_gradients:
                        seen["grad_norm"].append(float(acc.clip_grad_norm_(model.parameters(), 1.0)))
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                seen["loss"].append(loss.item())
                seen["lr"].append(sched.get_last_lr()[0])
        model.eval()
        with torch.no_grad():
            seen["predictions"] = torch.cat([acc.gather_for_metrics(model(x)) for x, _ in dl])
        seen["weights"] = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
        return seen
    finally:
        if accelerator_cls is accelerate.Accelerator:
            accelerate.state.AcceleratorState._reset_state(True)  # its process-wide singletons


def _same(a: dict, b: dict) -> None:
    assert a["loss"] == b["loss"] and a["lr"] == b["lr"] and a["grad_norm"] == b["grad_norm"]
    assert torch.equal(a["predictions"], b["predictions"])
    assert a["weights"].keys() == b["weights"].keys()
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_an_accelerate_loop_gives_accelerates_numbers_bit_for_bit(mixed_precision, one_thread):
    _same(accelerate_loop(accelerate.Accelerator, mixed_precision), accelerate_loop(mixprec.Accelerator, mixed_precision))


def test_fp16_on_the_cpu_is_real_where_accelerate_silently_trains_in_fp32(one_thread):
    theirs = accelerate_loop(accelerate.Accelerator, "fp16")
    _same(theirs, accelerate_loop(accelerate.Accelerator, "no"))  # Accelerate's fp16 on the CPU is fp32
    ours = accelerate_loop(mixprec.Accelerator, "fp16")
    assert ours["loss"] != theirs["loss"] and all(math.isfinite(v) for v in ours["loss"])
    assert abs(ours["loss"][-1] - theirs["loss"][-1]) < 0.05 * theirs["loss"][-1]  # close to fp32's, not equal


def trainer_run(trainer_cls: type, args_cls: type, out: str, **more) -> tuple[list[dict], dict, object]:
    model = _Regressor()
    settings = dict(output_dir=out, num_train_epochs=2, per_device_train_batch_size=4, learning_rate=1e-2,
                    gradient_accumulation_steps=2, max_grad_norm=1.0, warmup_steps=2, weight_decay=0.01,
                    logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True, seed=3,
                    eval_strategy="epoch", per_device_eval_batch_size=8, train_sampling_strategy="sequential")
    args = args_cls(**{**settings, **more})
    trainer = trainer_cls(model=model, args=args, train_dataset=_Rows(), eval_dataset=_Rows())
    result = trainer.train()
    return trainer.state.log_history, {k: v.clone() for k, v in model.state_dict().items()}, result


def test_a_trainer_run_ends_with_transformers_weights_and_logs_its_gradient_norms(tmp_path, one_thread):
    theirs, their_weights, their_result = trainer_run(transformers.Trainer, transformers.TrainingArguments,
                                                      str(tmp_path / "hf"))
    ours, our_weights, our_result = trainer_run(mixprec.Trainer, mixprec.TrainingArguments, str(tmp_path / "mp"))

    def column(history: list[dict], key: str) -> list[tuple[int, float]]:
        return [(row["step"], row[key]) for row in history if key in row]

    assert all(torch.equal(their_weights[k], our_weights[k]) for k in their_weights)
    assert (our_result.global_step, our_result.training_loss) == (their_result.global_step, their_result.training_loss)
    assert column(ours, "grad_norm") == column(theirs, "grad_norm") and column(ours, "epoch") == column(theirs, "epoch")
    assert column(ours, "learning_rate") == column(theirs, "learning_rate")  # the rate each step used
    # mixprec logs the loss to 6 significant digits; the evaluation loss is averaged in another order.
    for key, tolerance in (("loss", 1e-5), ("eval_loss", 1e-6)):
        assert [s for s, _ in column(ours, key)] == [s for s, _ in column(theirs, key)]
        assert all(math.isclose(a, b, rel_tol=tolerance) for (_, a), (_, b) in zip(column(ours, key), column(theirs, key)))



SCHEDULES = [("linear", None), ("cosine", None), ("cosine_with_restarts", {"num_cycles": 2}),
             ("polynomial", {"power": 2.0, "lr_end": 1e-4}), ("constant", None), ("constant_with_warmup", None),
             ("inverse_sqrt", None), ("reduce_lr_on_plateau", {"mode": "max", "patience": 0, "factor": 0.5}),
             ("cosine_with_min_lr", {"min_lr_rate": 0.1}), ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.1}),
             ("warmup_stable_decay", {"num_decay_steps": 3}), ("greedy", None)]


@pytest.mark.parametrize("schedule,kwargs", SCHEDULES, ids=[s for s, _ in SCHEDULES])
def test_every_schedule_gives_transformers_learning_rate_and_weights_step_for_step(schedule, kwargs, tmp_path,
                                                                                     one_thread):
    """Every ``lr_scheduler_type`` with its ``lr_scheduler_kwargs``: the logged learning rate (the
    one each step used), the loss and the weights are transformers', step for step (the
    metric-driven ones step with the evaluation loss, evaluated every 2 steps)."""
    more = dict(lr_scheduler_type=schedule, lr_scheduler_kwargs=kwargs or {}, num_train_epochs=3,
                eval_strategy="steps", eval_steps=2, gradient_accumulation_steps=1)
    theirs, their_weights, _ = trainer_run(transformers.Trainer, transformers.TrainingArguments,
                                           str(tmp_path / "hf"), **more)
    ours, our_weights, _ = trainer_run(mixprec.Trainer, mixprec.TrainingArguments, str(tmp_path / "mp"), **more)

    def column(history: list[dict], key: str) -> list[tuple[int, float]]:
        return [(row["step"], row[key]) for row in history if key in row]

    rates = column(ours, "learning_rate")
    assert len(rates) == 30 and rates == column(theirs, "learning_rate")
    assert len({lr for _, lr in rates}) >= {"constant": 1, "constant_with_warmup": 2, "greedy": 2}.get(schedule, 3)
    for k in their_weights:
        torch.testing.assert_close(our_weights[k], their_weights[k], rtol=1e-5, atol=1e-6)



OPTIMIZERS = ["adamw_torch", "adamw_torch_fused", "adafactor", "adamw_torch_4bit", "adamw_torch_8bit", "sgd", "adagrad",
              "rmsprop", "schedule_free_adamw", "schedule_free_radam", "schedule_free_sgd"]


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_every_installed_optimizer_gives_transformers_weights_and_logs(optim, tmp_path, one_thread):
    """Every ``optim`` name whose optimizer is installed here, in transformers' parameter groups
    (weight decay on all but biases and norms): the same weights and logs as transformers'
    Trainer (schedule-free ones switched to eval mode for each evaluation, as transformers does)."""
    if optim.startswith("schedule_free"):
        pytest.importorskip("schedulefree")
    if optim.endswith("bit"):
        pytest.importorskip("torchao.optim")
    more = dict(optim=optim, num_train_epochs=1)
    theirs, their_weights, _ = trainer_run(transformers.Trainer, transformers.TrainingArguments,
                                           str(tmp_path / "hf"), **more)
    ours, our_weights, _ = trainer_run(mixprec.Trainer, mixprec.TrainingArguments, str(tmp_path / "mp"), **more)
    for key in ("learning_rate", "grad_norm", "eval_loss"):
        assert [r.get(key) for r in ours if key in r] == pytest.approx([r.get(key) for r in theirs if key in r],
                                                                        rel=1e-5), key
    for k in their_weights:
        torch.testing.assert_close(our_weights[k], their_weights[k], rtol=1e-5, atol=1e-6)


def test_optim_args_reach_the_optimizer_as_transformers_parses_them(tmp_path, one_thread):
    more = dict(optim="sgd", optim_args="momentum=0.9,nesterov=True", num_train_epochs=1)
    _, their_weights, _ = trainer_run(transformers.Trainer, transformers.TrainingArguments, str(tmp_path / "hf"), **more)
    _, our_weights, _ = trainer_run(mixprec.Trainer, mixprec.TrainingArguments, str(tmp_path / "mp"), **more)
    _, plain, _ = trainer_run(mixprec.Trainer, mixprec.TrainingArguments, str(tmp_path / "plain"), optim="sgd",
                              num_train_epochs=1)
    for k in their_weights:
        torch.testing.assert_close(our_weights[k], their_weights[k], rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(plain[k], our_weights[k]) for k in plain)  # the arguments changed the run


class _Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 3))
        self.config = transformers.PretrainedConfig()  # transformers' Trainer reads it with label smoothing

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.body(x)
        return {"logits": logits} if labels is None else {"loss": F.cross_entropy(logits, labels), "logits": logits}


class _Classes(_Rows):
    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": (self.y[i, 0] > 0).long() + (self.y[i, 0] > 0.5).long()}


def _smoothed_run(lib, out: str, model: torch.nn.Module, data) -> tuple[list[dict], dict]:
    args = lib.TrainingArguments(output_dir=out, num_train_epochs=1, per_device_train_batch_size=4, learning_rate=1e-2,
                                 label_smoothing_factor=0.1, logging_steps=1, save_strategy="no", report_to="none",
                                 disable_tqdm=True, use_cpu=True, seed=3, train_sampling_strategy="sequential")
    trainer = lib.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return [r["loss"] for r in trainer.state.log_history if "loss" in r], model.state_dict()


def test_label_smoothing_gives_transformers_losses_and_weights_on_a_classifier(tmp_path, one_thread):
    theirs = _smoothed_run(transformers, str(tmp_path / "hf"), _Classifier(), _Classes())
    ours = _smoothed_run(mixprec, str(tmp_path / "mp"), _Classifier(), _Classes())
    assert ours[0] == pytest.approx(theirs[0], rel=1e-5) and len(ours[0]) >= 4
    for k in theirs[1]:
        torch.testing.assert_close(ours[1][k], theirs[1][k], rtol=1e-5, atol=1e-6)


def _multi_label_bert() -> torch.nn.Module:
    """A 1-layer BERT classifier for 3 labels at once (random weights, from a config: no download)."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=16, max_position_embeddings=16, num_labels=3,
                                     problem_type="multi_label_classification", hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config)


def test_label_smoothing_on_a_multi_label_classifier_is_turned_off_with_transformers_warning(tmp_path, one_thread):
    """``label_smoothing_factor`` meets a multi-label classifier (its labels are not one class to
    smooth): both Trainers warn alike, turn smoothing off, and train to the same losses."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 32, (16, 6), generator=g), torch.randint(0, 2, (16, 3), generator=g).float()
    data = [{"input_ids": x[i], "labels": y[i]} for i in range(16)]
    runs = {}
    for lib in (transformers, mixprec):
        with pytest.warns(UserWarning, match=r"^Label smoothing is not compatible with multi-label classification\. "
                                             r"Disabling label smoothing for this training run\.$"):
            runs[lib.__name__] = _smoothed_run(lib, str(tmp_path / lib.__name__), _multi_label_bert(), data)
    (their_losses, their_weights), (our_losses, our_weights) = runs.values()
    assert len(our_losses) == 4 and our_losses == pytest.approx(their_losses, rel=1e-5)
    for k in their_weights:
        torch.testing.assert_close(our_weights[k], their_weights[k], rtol=1e-5, atol=1e-6)


def test_label_smoothing_on_a_causal_lm_is_the_mean_over_the_tokens_that_have_a_target(tmp_path, one_thread):
    """The labels shifted, as transformers does; the smoothed loss averaged over the tokens that
    have a target (transformers divides its NLL part by every label, the unshifted count: a loss
    (L-1)/L too small for sequences of L tokens; a deliberate difference, in the README)."""
    from transformers.trainer_pt_utils import LabelSmoother

    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                                 embd_pdrop=0.0, attn_pdrop=0.0)
    data = [{"input_ids": torch.arange(i, i + 8) % 64, "labels": torch.arange(i, i + 8) % 64} for i in range(16)]
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    batch = torch.utils.data.default_collate(data[:4])
    with torch.no_grad():
        expected = float(LabelSmoother(epsilon=0.1)(model(input_ids=batch["input_ids"]), batch["labels"],
                                                    shift_labels=True))
    losses, _ = _smoothed_run(mixprec, str(tmp_path / "mp"), model, data)
    assert losses[0] == pytest.approx(expected, rel=1e-5)


def _lm_run(lib, out: str, **more) -> tuple[list[dict], dict]:
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    data = [{"input_ids": torch.arange(i, i + 8) % 64, "labels": torch.arange(i, i + 8) % 64,
             "attention_mask": (torch.arange(8) < 4 + i % 5).long()} for i in range(16)]
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    args = lib.TrainingArguments(output_dir=out, num_train_epochs=1, per_device_train_batch_size=4, learning_rate=1e-2,
                                 logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                                 use_cpu=True, seed=3, train_sampling_strategy="sequential", **more)
    trainer = lib.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return trainer.state.log_history, model.state_dict()


@pytest.mark.parametrize("mode", ["all", "non_padding", True])
def test_input_tokens_seen_are_counted_as_transformers_counts_them(mode, tmp_path, one_thread):
    theirs, _ = _lm_run(transformers, str(tmp_path / "hf"), include_num_input_tokens_seen=mode)
    ours, _ = _lm_run(mixprec, str(tmp_path / "mp"), include_num_input_tokens_seen=mode)
    counts = [r["num_input_tokens_seen"] for r in ours if "num_input_tokens_seen" in r]
    assert counts == [r["num_input_tokens_seen"] for r in theirs if "num_input_tokens_seen" in r] and counts[-1] > 0


def test_neftune_noise_is_added_while_training_and_gone_after(tmp_path, one_thread):
    """transformers' own NEFTune hook on the input embeddings while training (the noise draws are
    random, so the run is compared with itself: noisier than without, and the hook removed after)."""
    ours, _ = _lm_run(mixprec, str(tmp_path / "mp"), neftune_noise_alpha=5.0)
    plain, _ = _lm_run(mixprec, str(tmp_path / "plain"))
    losses = [[r["loss"] for r in h if "loss" in r] for h in (ours, plain)]
    assert losses[0] != losses[1] and len(losses[0]) == len(losses[1]) == 4
    with pytest.raises(ValueError, match="get_input_embeddings"):
        mixprec.Trainer(model=_Regressor(), args=mixprec.TrainingArguments(
            output_dir=str(tmp_path / "r"), neftune_noise_alpha=5.0, use_cpu=True, report_to="none",
            max_steps=1), train_dataset=_Rows()).train()


def test_neftune_hook_is_removed_after_training(tmp_path):
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg)
    data = [{"input_ids": torch.arange(8), "labels": torch.arange(8)} for _ in range(4)]
    args = mixprec.TrainingArguments(output_dir=str(tmp_path), neftune_noise_alpha=5.0, use_cpu=True, report_to="none",
                                     max_steps=1, per_device_train_batch_size=4, save_strategy="no", disable_tqdm=True)
    mixprec.Trainer(model=model, args=args, train_dataset=data).train()
    assert not model.get_input_embeddings()._forward_hooks
