"""Trainer: what code written for Hugging Face's Trainer relies on (arguments, events, checkpoints)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import types

import pytest
import safetensors.torch
import torch

from mixprec import EarlyStoppingCallback, Trainer, TrainerCallback, TrainingArguments
from mixprec.trainer.callbacks import DefaultFlowCallback, hf_compatible
from mixprec.trainer.reporters import PrinterCallback, ProgressCallback

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.PrecisionPerformanceWarning")


class Line(torch.nn.Module):
    """y = a*x + b, Hugging Face style: keyword inputs, ``(loss, y)`` with labels."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(()))
        self.b = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_x, labels=None):
        y = input_x * self.a + self.b
        return (y,) if labels is None else (torch.nn.functional.mse_loss(y, labels), y)


def line_data(n: int = 32, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    return [{"input_x": x[i], "labels": 2 * x[i] + 3} for i in range(n)]


def make(tmp_path, model=None, callbacks=None, **kw):
    base = dict(per_device_train_batch_size=8, learning_rate=0.1, report_to="none", disable_tqdm=True,
                save_strategy="no", logging_steps=2)
    base.update(kw)
    return Trainer(model if model is not None else Line(), TrainingArguments(str(tmp_path / "out"), **base),
                   train_dataset=line_data(), eval_dataset=line_data(16, seed=1), callbacks=callbacks)


class Recorder(TrainerCallback):
    def __init__(self):
        self.events = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            return lambda args, state, control, **kw: self.events.append((name, state.global_step, control.should_save))
        return super().__getattribute__(name)


# -- TrainingArguments ----------------------------------------------------------------------
def test_arguments_subclass_with_a_plain_dataclass_take_output_dir_first_and_can_be_assigned():
    @dataclasses.dataclass
    class Mine(TrainingArguments):
        alpha: float = 0.5

    a = Mine("out", alpha=2.0, learning_rate=0.1, eval_strategy="steps")
    assert (a.output_dir, a.alpha, a.learning_rate, a.eval_steps) == ("out", 2.0, 0.1, 500)
    a.per_device_train_batch_size = 4
    assert a.train_batch_size == 4 and a.eval_batch_size == 8 and a.device.type in ("cpu", "cuda", "mps")
    a.per_device_train_batch_size = 0
    with pytest.raises(ValueError, match="per_device_train_batch_size must be an int >= 1"):
        a.validate()
    with pytest.raises(TypeError):
        TrainingArguments("out", 8)  # only output_dir is positional
    b = TrainingArguments("out", eval_strategy="epoch")
    assert b.do_eval is True and b.disable_tqdm is False and TrainingArguments().output_dir == "trainer_output"


@pytest.mark.parametrize("kwargs, match", [
    (dict(push_to_hub=True), r"push_to_hub=True is not supported .*leave push_to_hub at its default False"),
    (dict(deepspeed="ds.json"), "deepspeed='ds.json' is not supported"),
    (dict(report_to=["neptune"]), "report_to='neptune': that integration is not part of mixprec"),
    (dict(report_to=["wandbb"]), "report_to='wandbb' is not valid; choose one of: .*'wandb'"),
    (dict(logging_steps=2.5), r"logging_steps=2.5: above 1 it must be a whole number"),
    (dict(save_steps=0), "save_steps must be an int >= 1, or a fraction"),
])
def test_unsupported_or_bad_fields_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainingArguments("out", **kwargs)


def test_enum_like_strategies_and_whole_float_steps_become_plain_values():
    import enum

    class Strategy(str, enum.Enum):
        EPOCH = "epoch"

    a = TrainingArguments("out", eval_strategy=Strategy.EPOCH, logging_steps=8.0)
    assert a.eval_strategy == "epoch" and type(a.eval_strategy) is str
    assert a.logging_steps == 8 and isinstance(a.logging_steps, int)


def test_fractional_steps_are_fractions_of_the_training_steps(tmp_path):
    # 32 samples / 8 = 4 steps an epoch, 3 epochs = 12 steps; 0.25 of them = 3
    trainer = make(tmp_path, logging_steps=0.25, save_strategy="steps", save_steps=0.5)
    trainer.train()
    assert trainer.state.logging_steps == 3 and trainer.state.save_steps == 6
    assert [e["step"] for e in trainer.state.log_history if "loss" in e] == [3, 6, 9, 12]
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-6"]


# -- the loop and its events -----------------------------------------------------------------
def test_events_include_pre_optimizer_substep_and_prediction_steps_and_should_save_is_seen(tmp_path):
    rec = Recorder()
    trainer = make(tmp_path, callbacks=[rec], max_steps=2, gradient_accumulation_steps=2,
                   per_device_train_batch_size=4, eval_strategy="steps", eval_steps=2, save_strategy="steps",
                   save_steps=2, logging_steps=1)
    trainer.train()
    names = [e[0] for e in rec.events]
    step1 = names[names.index("on_epoch_begin") + 1:names.index("on_step_end") + 1]
    assert step1 == ["on_step_begin", "on_substep_end", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end"]
    assert names.count("on_prediction_step") == 2  # one evaluation (step 2): 16 samples, 8 a batch
    assert [e for e in rec.events if e[0] == "on_step_end"] == [("on_step_end", 1, False), ("on_step_end", 2, True)]
    assert names[-2:] == ["on_log", "on_train_end"]


def test_default_callbacks_carry_hugging_face_names_and_removing_the_flow_stops_logging_and_saving(tmp_path):
    trainer = make(tmp_path, save_strategy="steps", save_steps=2)
    assert [type(c).__name__ for c in trainer.callback_handler.callbacks] == ["DefaultFlowCallback",
                                                                             "PrinterCallback"]
    assert make(tmp_path, disable_tqdm=False).pop_callback(ProgressCallback) is not None
    trainer.remove_callback(DefaultFlowCallback)
    trainer.train()
    assert [e for e in trainer.state.log_history if "loss" in e] == []
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_hf_compatible_is_the_class_itself_without_transformers_and_both_with_it(monkeypatch):
    monkeypatch.delitem(sys.modules, "transformers.trainer_callback", raising=False)
    assert hf_compatible(PrinterCallback) is PrinterCallback
    fake = types.ModuleType("transformers.trainer_callback")

    class PrinterCallbackOfTheirs:
        def on_log(self, *a, **k):
            raise AssertionError("theirs must not run")

    PrinterCallbackOfTheirs.__name__ = "PrinterCallback"
    fake.PrinterCallback = PrinterCallbackOfTheirs
    monkeypatch.setitem(sys.modules, "transformers.trainer_callback", fake)
    cls = hf_compatible(PrinterCallback)
    cb = cls()
    assert cls.__name__ == "PrinterCallback" and isinstance(cb, PrinterCallback) and isinstance(cb, fake.PrinterCallback)
    cb.on_log(None, types.SimpleNamespace(is_local_process_zero=False), None, logs={"loss": 1.0})  # ours: silent


def test_nan_losses_are_filtered_from_the_logs_by_default_and_kept_when_asked(tmp_path):
    class SometimesNan(Line):
        calls = 0

        def forward(self, input_x, labels=None):
            loss, y = super().forward(input_x, labels)
            SometimesNan.calls += 1
            return (loss * float("nan") if SometimesNan.calls % 3 == 0 else loss), y

    for flag in (True, False):
        trainer = make(tmp_path / str(flag), model=SometimesNan(), logging_nan_inf_filter=flag, max_grad_norm=None,
                       learning_rate=0.0, max_steps=6)
        trainer.train()
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        assert all(math.isfinite(v) for v in losses) == flag, losses


def test_model_init_builds_a_fresh_model_for_every_train_and_refuses_optimizers(tmp_path):
    trainer = Trainer(args=TrainingArguments(str(tmp_path), report_to="none", disable_tqdm=True, save_strategy="no",
                                             learning_rate=0.1, max_steps=4), train_dataset=line_data(),
                      model_init=Line)
    trainer.train()
    first = trainer.model.a.item()
    trainer.train()
    assert trainer.model.a.item() == first != 0.0
    assert trainer.get_num_trainable_parameters() == 2
    trainer.model.b.requires_grad_(False)
    assert trainer.get_num_trainable_parameters() == 1
    opt = torch.optim.SGD(Line().parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="model_init"):
        Trainer(args=TrainingArguments(str(tmp_path)), model_init=Line, optimizers=(opt, None))


def test_a_second_train_continues_the_model_with_a_fresh_schedule_of_its_own(tmp_path):
    trainer = make(tmp_path, max_steps=4)
    trainer.train()
    first = trainer.model.a.item()
    trainer.train()  # the first schedule ended at lr 0: a kept one would leave the model as it was
    assert trainer.model.a.item() != first and trainer.state.global_step == 4


def test_batch_eval_metrics_calls_compute_metrics_per_batch_and_the_last_call_is_the_result(tmp_path):
    seen = []

    def metrics(pred, compute_result):
        seen.append((type(pred.predictions), compute_result))
        return {"batches": len(seen)} if compute_result else None

    trainer = make(tmp_path, batch_eval_metrics=True)
    trainer.compute_metrics = metrics
    out = trainer.evaluate()
    assert seen == [(torch.Tensor, False), (torch.Tensor, True)] and out["eval_batches"] == 2
    assert trainer.predict(line_data(16, seed=1)).predictions.shape == (16,)
    trainer.eval_dataset = {"small": line_data(8, seed=2)}
    seen.clear()
    # A dict's dataset by name: transformers' prefix ("eval"), and each dataset's name when all are evaluated.
    assert trainer.evaluate("small")["eval_batches"] == 1
    seen.clear()
    assert trainer.evaluate()["eval_small_batches"] == 1


# -- checkpoints -------------------------------------------------------------------------------
def test_checkpoints_hold_hugging_face_files_beside_the_manifest_and_resume(tmp_path):
    trainer = make(tmp_path, save_strategy="steps", save_steps=4, max_steps=8)
    trainer.train()
    ckpt = tmp_path / "out" / "checkpoint-4"
    names = {p.name for p in ckpt.iterdir()}
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", "training_args.bin",
            "manifest.json"} <= names
    assert not list((tmp_path / "out").glob(".checkpoint-*"))  # no staging folder left
    assert set(json.loads((ckpt / "manifest.json").read_text())["files"]) >= {"model.safetensors", "optimizer.pt"}
    weights = safetensors.torch.load_file(str(ckpt / "model.safetensors"))
    assert set(weights) == {"a", "b"}
    if hasattr(os, "link"):  # the same bytes as the Accelerator's file: a hard link, not a second copy
        assert os.stat(ckpt / "model.safetensors").st_ino == os.stat(ckpt / "model_0.safetensors").st_ino
    # transformers' two parameter groups (mixprec's one, with weight_decay=0, regrouped): its Trainer loads it.
    assert [len(g["params"]) for g in torch.load(ckpt / "optimizer.pt", weights_only=True)["param_groups"]] == [2, 0]
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and "skipped_steps" not in state  # Hugging Face's fields only
    assert state["stateful_callbacks"]["TrainerControl"]["args"]["should_save"] is True
    final_a = trainer.model.a.item()
    again = make(tmp_path, save_strategy="steps", save_steps=4, max_steps=8)
    again.train(resume_from_checkpoint=str(ckpt))
    assert again.model.a.item() == final_a and again.state.global_step == 8
    with pytest.raises(ValueError, match="Can't find a valid checkpoint at"):
        make(tmp_path).train(resume_from_checkpoint=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
        make(tmp_path / "fresh").train(resume_from_checkpoint=True)


def test_stateful_callbacks_are_rebuilt_from_the_checkpoint_when_asked(tmp_path):
    kw = dict(eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2, max_steps=2,
              load_best_model_at_end=True)
    make(tmp_path, callbacks=[EarlyStoppingCallback(5, 0.25)], **kw).train()
    ckpt = str(tmp_path / "out" / "checkpoint-2")
    kept = make(tmp_path, callbacks=[EarlyStoppingCallback()], **kw)
    kept.train(resume_from_checkpoint=ckpt)
    fresh = [c for c in kept.callback_handler.callbacks if isinstance(c, EarlyStoppingCallback)]
    assert (fresh[0].early_stopping_patience, fresh[0].early_stopping_threshold) == (1, 0.0)  # not asked to restore
    restored = make(tmp_path, callbacks=[EarlyStoppingCallback()], restore_callback_states_from_checkpoint=True, **kw)
    restored.train(resume_from_checkpoint=ckpt)
    cb = [c for c in restored.callback_handler.callbacks if isinstance(c, EarlyStoppingCallback)]
    assert len(cb) == 1 and (cb[0].early_stopping_patience, cb[0].early_stopping_threshold) == (5, 0.25)


def test_save_strategy_best_saves_only_when_the_metric_improves(tmp_path):
    scores = iter([1.0, 3.0, 2.0])
    trainer = make(tmp_path, eval_strategy="steps", eval_steps=2, save_strategy="best", max_steps=6,
                   metric_for_best_model="score")
    trainer.compute_metrics = lambda p: {"score": next(scores)}
    trainer.train()
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert trainer.state.best_global_step == 4
    with pytest.raises(ValueError, match="save_strategy='best'.*metric_for_best_model"):
        TrainingArguments("out", save_strategy="best", eval_strategy="epoch")


def test_prediction_step_is_what_evaluation_calls_and_results_are_written_as_hugging_face_does(tmp_path, capsys):
    class Shifted(Trainer):
        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
            return loss, logits + 100, labels

    data = line_data(8)
    trainer = Shifted(Line(), TrainingArguments(str(tmp_path), report_to="none", disable_tqdm=True))
    out = trainer.predict(data)
    assert out.predictions.tolist() == [100.0] * 8 and "test_loss" in out.metrics
    trainer.log_metrics("test", out.metrics)
    assert "***** test metrics *****" in capsys.readouterr().out
    trainer.save_metrics("test", out.metrics)
    trainer.save_state()
    assert json.loads((tmp_path / "all_results.json").read_text())["test_loss"] == out.metrics["test_loss"]
    assert json.loads((tmp_path / "trainer_state.json").read_text())["global_step"] == 0


def test_a_hugging_face_model_trains_with_gradient_checkpointing_and_its_checkpoint_loads_with_from_pretrained(
        tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    x = torch.randint(0, 16, (8,))
    data = [{"input_ids": x, "labels": x}] * 8
    args = TrainingArguments(str(tmp_path), max_steps=2, save_steps=2, report_to="none", disable_tqdm=True,
                             gradient_checkpointing=True)
    Trainer(model, args, train_dataset=data).train()
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    back = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "checkpoint-2"))
    torch.testing.assert_close(back.transformer.wte.weight, model.transformer.wte.weight)
    with pytest.raises(ValueError, match="gradient_checkpointing=True needs a model with gradient_checkpointing_enable"):
        make(tmp_path, gradient_checkpointing=True).train()


def test_a_batch_encoding_batch_counts_as_a_dict_for_labels_metrics_and_tokens(tmp_path):
    """transformers' collators return a ``BatchEncoding`` (a ``UserDict``, not a ``dict``): its labels
    reach ``compute_metrics`` (so ``metric_for_best_model`` works), its tokens are counted, and
    ``predict`` returns its labels."""
    transformers = pytest.importorskip("transformers")

    def collator(rows):
        return transformers.BatchEncoding({k: torch.stack([r[k] for r in rows]) for k in rows[0]})

    seen = []

    def metrics(p):
        seen.append(p.label_ids.shape)
        return {"mse": float(((p.predictions - p.label_ids) ** 2).mean())}

    model = Line()
    model.main_input_name = "input_x"
    args = TrainingArguments(str(tmp_path / "out"), per_device_train_batch_size=8, learning_rate=0.1, report_to="none",
                             disable_tqdm=True, max_steps=4, eval_strategy="steps", eval_steps=2, save_steps=2,
                             metric_for_best_model="mse", greater_is_better=False, load_best_model_at_end=True,
                             include_num_input_tokens_seen=True)
    trainer = Trainer(model, args, data_collator=collator, train_dataset=line_data(),
                      eval_dataset=line_data(16, seed=1), compute_metrics=metrics)
    trainer.train()
    assert seen == [(16,), (16,)] and trainer.state.best_metric == min(
        row["eval_mse"] for row in trainer.state.log_history if "eval_mse" in row)
    assert trainer.state.num_input_tokens_seen == 32
    assert trainer.predict(line_data(8)).label_ids.shape == (8,)
