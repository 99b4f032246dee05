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
