"""Hugging Face's Trainer helpers answer as transformers' do on the same model, data and arguments."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

import mixprec

transformers = pytest.importorskip("transformers")


def _pair(tmp_path):
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    data = [{"input_ids": torch.arange(8) % 64, "labels": torch.arange(8) % 64} for _ in range(10)]
    out = []
    for lib in (transformers, mixprec):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args = lib.TrainingArguments(output_dir=str(tmp_path / lib.__name__), per_device_train_batch_size=4,
                                         gradient_accumulation_steps=3, use_cpu=True, report_to="none")
            out.append(lib.Trainer(model=transformers.GPT2LMHeadModel(cfg), args=args, train_dataset=data))
    return out


def test_the_helpers_give_transformers_answers(tmp_path):
    theirs, ours = _pair(tmp_path)
    batch = {"input_ids": torch.zeros(4, 8, dtype=torch.long)}
    assert ours.floating_point_ops(batch) == theirs.floating_point_ops(batch) > 0
    assert ours.num_examples(ours.get_train_dataloader()) == theirs.num_examples(theirs.get_train_dataloader()) == 10
    assert ours.get_total_train_batch_size(ours.args) == theirs.get_total_train_batch_size(theirs.args) == 12
    assert (ours.get_tp_size(), ours.get_cp_size(), ours.get_sp_size()) == (
        theirs.get_tp_size(), theirs.get_cp_size(), theirs.get_sp_size())
    assert isinstance(ours.autocast_smart_context_manager(), contextlib.nullcontext)
    with ours.compute_loss_context_manager():
        pass
    ours.end()


def test_total_flos_is_counted_logged_and_returned_as_transformers_does(tmp_path):
    runs = []
    for trainer in _pair(tmp_path):
        trainer.args.max_steps, trainer.args.logging_steps, trainer.args.save_strategy = 2, 1, "no"
        out = trainer.train()
        runs.append((sorted(out.metrics), [r["total_flos"] for r in trainer.state.log_history if "total_flos" in r],
                     type(trainer.state.total_flos)))
    assert runs[0] == runs[1]
    assert runs[1][1][0] > 0 and runs[1][2] is float


def test_the_last_seven_names_of_transformers_trainer_behave_as_documented(tmp_path, one_thread):
    """evaluation_loop, get_batch_samples, set_initial_training_values (equal to transformers'),
    create_model_card, init_hf_repo, loss_is_scaled_for_ga, create_accelerator_and_postprocess."""
    import transformers

    from toys import SineRegressor as _Regressor
    from toys import SineRows as _Rows

    def make(lib, **more):
        args = lib.TrainingArguments(output_dir=str(tmp_path / lib.__name__), report_to="none", disable_tqdm=True,
                                     use_cpu=True, per_device_train_batch_size=4, gradient_accumulation_steps=3,
                                     num_train_epochs=2, save_strategy="no", logging_steps=1, seed=3,
                                     eval_strategy="epoch", train_sampling_strategy="sequential", **more)
        return lib.Trainer(model=_Regressor(), args=args, train_dataset=_Rows(), eval_dataset=_Rows())

    ours, theirs = make(mixprec), make(transformers)
    for trainer in (ours, theirs):  # two epochs of ceil(10 / 3) = 4 steps
        assert trainer.set_initial_training_values(trainer.args, trainer.get_train_dataloader()) == (
            2, 4, 40, 80, 12, 10, 8)
    out = ours.evaluation_loop(ours.get_eval_dataloader(), "Evaluation")
    assert out.num_samples == 40 and out.predictions.shape == (40, 1) and "eval_loss" in out.metrics
    batches, items = ours.get_batch_samples(iter(ours.get_train_dataloader()), 3, None)
    assert len(batches) == 3 and items == 12  # 3 batches of 4 labels, none -100
    with pytest.raises(NotImplementedError, match="create_repo"):
        ours.init_hf_repo()
    first = ours.accelerator
    ours.create_accelerator_and_postprocess()
    assert ours.accelerator is not first and ours.accelerator.gradient_accumulation_steps == 3
    ours = make(mixprec)
    ours.train()
    ours.create_model_card(model_name="line", finetuned_from="nothing", dataset="rows", license="apache-2.0")
    card = (tmp_path / "mixprec" / "README.md").read_text()
    assert "license: apache-2.0" in card and "base_model: nothing" in card and "- gradient_accumulation_steps: 3" in card
    assert "| 4 | 1.0 |" in card and "## Training results" in card

    class PreScaled(mixprec.Trainer):  # divides the loss itself, and says so
        loss_is_scaled_for_ga = True

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            # (evaluation asks for the outputs too, as transformers' prediction_step does)
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True)
            loss = loss / self.args.gradient_accumulation_steps
            return (loss, outputs) if return_outputs else loss

    plain = make(mixprec)
    plain.train()
    scaled = PreScaled(model=_Regressor(), args=plain.args, train_dataset=_Rows(), eval_dataset=_Rows())
    scaled.train()
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(plain.model.parameters(),
                                                                         scaled.model.parameters()))


def _plain_values(trainer) -> dict[str, object]:
    """The trainer's public attributes whose values are plain data (None, a bool, number or string,
    or a list of strings): what user code reads and compares (``trainer.is_in_train``)."""
    values = {}
    for name in dir(trainer):
        if name.startswith("_"):
            continue
        try:
            value = getattr(trainer, name)
        except Exception:  # (a property with nothing to answer yet)
            continue
        if value is None or isinstance(value, (bool, int, float, str)) or (
                isinstance(value, list) and all(isinstance(v, str) for v in value)):
            values[name] = value
    return values


#: transformers leaves these None where no FSDP is configured, mixprec says False: compared by truth.
_TRUTH_ONLY = {"is_fsdp_xla_enabled", "is_fsdp_xla_v1_enabled", "is_fsdp_xla_v2_enabled"}
#: Values mixprec holds on purpose, whatever transformers' are: each pinned, with why.
_OURS = {"model_accepts_loss_kwargs": False}  # its loop passes no num_items_in_batch: the loss is the model's mean


def _values_over_a_run(lib, out) -> dict[str, dict[str, object]]:
    """:func:`_plain_values` of ``lib``'s Trainer at each point of a run with evaluations: made, the
    training's first event, the first step's end, the first evaluation in training, after training,
    and an evaluation after it."""
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    data = [{"input_ids": torch.arange(8) % 64, "labels": torch.arange(8) % 64} for _ in range(10)]
    seen: dict[str, dict] = {}
    phase = "in train"

    class Reader(lib.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen["on_train_begin"] = _plain_values(trainer)

        def on_step_end(self, args, state, control, **kwargs):
            seen.setdefault("on_step_end", _plain_values(trainer))

        def on_evaluate(self, args, state, control, **kwargs):
            seen.setdefault(f"on_evaluate {phase}", _plain_values(trainer))

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = lib.TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=3,
                                     use_cpu=True, report_to="none", max_steps=2, eval_strategy="steps", eval_steps=1,
                                     save_strategy="no", disable_tqdm=True)
        trainer = lib.Trainer(model=transformers.GPT2LMHeadModel(cfg), args=args, train_dataset=data,
                              eval_dataset=data[:4], callbacks=[Reader()])
        seen["made"] = _plain_values(trainer)
        trainer.train()
        seen["after train"] = _plain_values(trainer)
        phase = "after train"
        trainer.evaluate()
    return seen


def test_the_trainers_attributes_hold_transformers_values_before_during_and_after_a_run(tmp_path):
    """Read at each point of a run, every plain-valued attribute transformers' Trainer has holds the
    same value on mixprec's: is_in_train True inside train() only, the gradient accumulation steps of
    the current step, the step's flos, can_return_loss, label_names, ..."""
    theirs, ours = (_values_over_a_run(lib, tmp_path / lib.__name__) for lib in (transformers, mixprec))
    assert list(ours) == list(theirs)
    assert [ours[at]["is_in_train"] for at in ours] == [False, True, True, True, False, False]
    for at, values in theirs.items():
        assert values, at
        for name, value in values.items():
            mine, expected = ours[at].get(name, "<missing>"), _OURS.get(name, value)
            assert (bool(mine) == bool(value) if name in _TRUTH_ONLY else mine == expected), (at, name, value, mine)
