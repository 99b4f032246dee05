"""Seq2SeqTrainer and Seq2SeqTrainingArguments: the same script as under transformers gives the
same losses, generated ids, labels and metrics; the same names; the same serialised arguments."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

import mixprec

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.PrecisionPerformanceWarning")

PAD, EOS, VOCAB = 0, 1, 64


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """transformers' Trainer makes an Accelerate Accelerator, whose state is process-global."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _t5():
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16,
                                   decoder_start_token_id=PAD, pad_token_id=PAD, eos_token_id=EOS)
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config)


def _rows(n: int, seed: int) -> list[dict[str, list[int]]]:
    """Sequences of 2-7 tokens; the target is the sequence reversed (every third one: copied), then EOS."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        seq = torch.randint(2, VOCAB, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g).tolist()
        target = seq if i % 3 == 0 else seq[::-1]
        rows.append({"input_ids": seq + [EOS], "labels": target + [EOS]})
    return rows


def _collate(rows):
    """Right-padded: inputs with PAD (and their mask), labels with -100 (each batch its own width)."""
    width, label_width = max(len(r["input_ids"]) for r in rows), max(len(r["labels"]) for r in rows)
    ids = torch.tensor([r["input_ids"] + [PAD] * (width - len(r["input_ids"])) for r in rows])
    labels = torch.tensor([r["labels"] + [-100] * (label_width - len(r["labels"])) for r in rows])
    return {"input_ids": ids, "attention_mask": (ids != PAD).long(), "labels": labels}


class _Metrics:
    """compute_metrics that keeps what it received: token accuracy over the real label positions."""

    def __init__(self):
        self.seen = []

    def __call__(self, p):
        preds, labels = p.predictions, p.label_ids
        self.seen.append((np.array(preds), np.array(labels)))
        width = min(preds.shape[1], labels.shape[1])
        real = labels[:, :width] >= 2
        return {"token_accuracy": float((preds[:, :width] == labels[:, :width])[real].mean())}


def _run(lib, tmp_path, num_beams):
    metrics = _Metrics()
    args = lib.Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / lib.__name__), predict_with_generate=True, generation_max_length=10,
        generation_num_beams=num_beams, eval_strategy="epoch", num_train_epochs=2, per_device_train_batch_size=8,
        per_device_eval_batch_size=4, learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, use_cpu=True, seed=5)
    trainer = lib.Seq2SeqTrainer(model=_t5(), args=args, data_collator=_collate, train_dataset=_rows(16, 1),
                                 eval_dataset=_rows(8, 2), compute_metrics=metrics)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
        predicted = trainer.predict(_rows(4, 3))
        # the call's gen_kwargs win over the arguments: 3 new tokens, greedy
        overridden = trainer.evaluate(max_new_tokens=3, num_beams=1)
    losses = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    return losses, metrics.seen, predicted, overridden


def _timeless(metrics):
    # (and "epoch": transformers' Trainer.log writes it into the dict evaluate() returns; mixprec's
    # Trainer logs it without touching that dict, a difference of the Trainer's, not of this module)
    return {k: v for k, v in metrics.items() if not k.endswith(("_runtime", "_per_second")) and k != "epoch"}


@pytest.mark.parametrize("num_beams", [1, 2])
def test_generated_ids_labels_losses_and_metrics_are_transformers(tmp_path, num_beams, one_thread):
    theirs = _run(transformers, tmp_path, num_beams)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    ours = _run(mixprec, tmp_path, num_beams)
    (their_losses, their_seen, their_pred, their_eval), (losses, seen, pred, evaluated) = theirs, ours
    assert len(losses) == 3 and np.allclose(losses, their_losses, rtol=1e-5, atol=0)  # 2 epochs, 1 call
    # every compute_metrics call (two evaluations, one predict, one overridden evaluation) got the same arrays
    assert len(seen) == len(their_seen) == 4
    for (p, lab), (their_p, their_lab) in zip(seen, their_seen):
        assert p.dtype == their_p.dtype and np.array_equal(p, their_p)
        assert np.array_equal(lab, their_lab)
    # ids and labels are padded with PAD to the model's generation config's max_length (20), as
    # transformers pads them, whatever the call's length (10, or 3 new tokens: 4 ids)
    assert seen[0][0].shape == seen[-1][0].shape == seen[-1][1].shape == (8, 20)
    assert (seen[0][0][:, 10:] == PAD).all() and (seen[-1][0][:, 4:] == PAD).all()
    assert np.array_equal(pred.predictions, their_pred.predictions)
    assert np.array_equal(pred.label_ids, their_pred.label_ids)
    assert _timeless(pred.metrics).keys() == _timeless(their_pred.metrics).keys()
    assert np.allclose(list(_timeless(pred.metrics).values()), list(_timeless(their_pred.metrics).values()),
                       rtol=1e-5, atol=0)
    assert _timeless(evaluated).keys() == _timeless(their_eval).keys()
    assert evaluated["eval_token_accuracy"] == their_eval["eval_token_accuracy"]


def test_eval_loss_weighs_each_sample_once_where_transformers_seq2seq_weighs_a_short_last_batch_as_full(tmp_path):
    """A deliberate difference: transformers' Seq2SeqTrainer gathers with ``accelerator.gather``
    (not ``gather_for_metrics``), so the loss of a short last batch, repeated by the full batch
    size, is not cut back: its ``eval_loss`` is the mean of the batches' losses. mixprec's is the
    mean over the samples, as transformers' own Trainer computes it (and, over several processes,
    the duplicated samples of an uneven last round are dropped from the predictions too)."""
    rows, results = _rows(10, 2), {}  # batches of 4, 4 and 2
    for lib, name in ((transformers, "Seq2SeqTrainer"), (transformers, "Trainer"), (mixprec, "Seq2SeqTrainer")):
        args = lib.Seq2SeqTrainingArguments(output_dir=str(tmp_path), predict_with_generate=True,
                                            generation_max_length=6, per_device_eval_batch_size=4, report_to="none",
                                            use_cpu=True, disable_tqdm=True)
        trainer = getattr(lib, name)(model=_t5(), args=args, data_collator=_collate, compute_metrics=lambda p: {})
        results[lib.__name__, name] = trainer.evaluate(rows)["eval_loss"]
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    model = _t5().eval()
    with torch.no_grad():
        batch_losses = [float(model(**_collate(rows[i:i + 4])).loss) for i in range(0, 10, 4)]
    assert results["transformers", "Seq2SeqTrainer"] == pytest.approx(np.mean(batch_losses), rel=1e-5)
    assert results["mixprec", "Seq2SeqTrainer"] == pytest.approx(np.average(batch_losses, weights=[4, 4, 2]), rel=1e-5)
    assert results["mixprec", "Seq2SeqTrainer"] == pytest.approx(results["transformers", "Trainer"], rel=1e-5)


def test_the_generating_steps_loss_is_label_smoothed_as_transformers(tmp_path):
    losses = []
    for lib in (transformers, mixprec):
        args = lib.Seq2SeqTrainingArguments(output_dir=str(tmp_path), predict_with_generate=True, generation_max_length=6,
                                            label_smoothing_factor=0.1, per_device_eval_batch_size=4, report_to="none",
                                            use_cpu=True, disable_tqdm=True)
        trainer = lib.Seq2SeqTrainer(model=_t5(), args=args, data_collator=_collate, compute_metrics=lambda p: {})
        losses.append(trainer.evaluate(_rows(8, 6))["eval_loss"])
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    model = _t5().eval()
    with torch.no_grad():
        plain = float(model(**_collate(_rows(8, 6)[:4])).loss + model(**_collate(_rows(8, 6)[4:])).loss) / 2
    assert losses[1] == pytest.approx(losses[0], rel=1e-5) and losses[1] != pytest.approx(plain, rel=1e-3)


def _public(obj) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


def _instances(lib, tmp_path):
    args = lib.Seq2SeqTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    trainer = lib.Seq2SeqTrainer(model=_t5(), args=args)
    if lib is transformers:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    return _public(trainer), _public(args)


def test_live_instances_have_every_public_name_of_transformers(tmp_path):
    """Every name, with no list of gaps: what the Seq2Seq classes add (load_generation_config,
    predict_with_generate, ...) and what they inherit from the base Trainer and TrainingArguments."""
    (their_trainer, their_args), (trainer, args) = (_instances(lib, tmp_path) for lib in (transformers, mixprec))
    assert their_trainer - trainer == set() and their_args - args == set()


def test_generation_config_arguments_serialise_to_json_as_transformers(tmp_path):
    config = transformers.GenerationConfig(max_length=12, num_beams=3, decoder_start_token_id=PAD)
    dicts = [lib.Seq2SeqTrainingArguments(output_dir=str(tmp_path), generation_config=config, report_to="none",
                                          use_cpu=True).to_dict() for lib in (transformers, mixprec)]
    assert dicts[1]["generation_config"] == dicts[0]["generation_config"] == config.to_dict()
    assert json.loads(json.dumps(dicts[1]))["generation_config"]["num_beams"] == 3
    shared = {"sortish_sampler", "predict_with_generate", "generation_max_length", "generation_num_beams"}
    assert {k: dicts[1][k] for k in shared} == {k: dicts[0][k] for k in shared}


def test_the_generation_config_argument_becomes_the_models_from_an_object_a_folder_or_a_file(tmp_path):
    config = transformers.GenerationConfig(max_length=7, num_beams=2, decoder_start_token_id=PAD)
    config.save_pretrained(tmp_path / "gen")
    for given in (config, str(tmp_path / "gen"), tmp_path / "gen" / "generation_config.json"):
        args = mixprec.Seq2SeqTrainingArguments(output_dir=str(tmp_path / "o"), generation_config=given,
                                                report_to="none", use_cpu=True)
        trainer = mixprec.Seq2SeqTrainer(model=_t5(), args=args)
        found = trainer.model.generation_config
        assert (found.max_length, found.num_beams) == (7, 2) and found is not config
    with pytest.raises(ValueError, match="Fix these issues"):  # strict validation, as transformers'
        mixprec.Seq2SeqTrainer.load_generation_config(transformers.GenerationConfig(num_beams=1, early_stopping=True))


def test_hf_argument_parser_reads_the_generation_fields_as_transformers():
    argv = ["--output_dir", "o", "--predict_with_generate", "--generation_max_length", "32",
            "--generation_num_beams", "4", "--sortish_sampler", "--generation_config", "gen_dir", "--report_to", "none"]
    parsed = [transformers.HfArgumentParser(lib.Seq2SeqTrainingArguments).parse_args_into_dataclasses(argv)[0]
              for lib in (transformers, mixprec)]
    for name in ("predict_with_generate", "generation_max_length", "generation_num_beams", "sortish_sampler",
                 "generation_config"):
        assert getattr(parsed[1], name) == getattr(parsed[0], name), name


def test_without_metrics_evaluate_generates_nothing_and_predict_generates(tmp_path):
    args = mixprec.Seq2SeqTrainingArguments(output_dir=str(tmp_path), predict_with_generate=True,
                                            generation_max_length=6, report_to="none", use_cpu=True,
                                            per_device_eval_batch_size=4)
    trainer = mixprec.Seq2SeqTrainer(model=_t5(), args=args, data_collator=_collate)
    calls = []
    generate = trainer.model.generate
    trainer.model.generate = lambda **kw: calls.append(kw) or generate(**kw)
    assert "eval_loss" in trainer.evaluate(_rows(8, 4)) and calls == []  # as transformers: the loss alone
    out = trainer.predict(_rows(8, 4), num_beams=2)
    assert len(calls) == 2 and calls[0]["num_beams"] == 2 and calls[0]["max_length"] == 6
    assert out.predictions.shape == (8, 20) and "test_loss" in out.metrics  # the model config's max_length


def test_without_predict_with_generate_evaluation_is_the_trainers(tmp_path):
    args = mixprec.Seq2SeqTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                                            per_device_eval_batch_size=8)
    trainer = mixprec.Seq2SeqTrainer(model=_t5(), args=args, data_collator=_collate)
    out = trainer.predict(_rows(8, 4))
    assert out.predictions[0].shape[-1] == VOCAB  # logits, not ids
    plain = mixprec.Trainer(model=_t5(), args=mixprec.TrainingArguments(output_dir=str(tmp_path), report_to="none",
                                                                       use_cpu=True, per_device_eval_batch_size=8),
                            data_collator=_collate)
    assert plain.predict(_rows(8, 4)).metrics["test_loss"] == out.metrics["test_loss"]


def test_seq2seq_trainer_refuses_plain_training_arguments_with_the_fix(tmp_path):
    with pytest.raises(TypeError, match="Seq2SeqTrainingArguments"):
        mixprec.Seq2SeqTrainer(model=_t5(), args=mixprec.TrainingArguments(output_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="generation_num_beams=0"):
        mixprec.Seq2SeqTrainingArguments(output_dir=str(tmp_path), generation_num_beams=0)

