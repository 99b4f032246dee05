"""Checkpoints both ways: a run moves between transformers' Trainer and mixprec's mid-way.

Differential, against the installed transformers: a run checkpointed by one Trainer and finished
by the other ends with the weights and the logs of an uninterrupted run (fp32: to the last bit
here). The reading never runs code from a file.
"""

from __future__ import annotations

import functools
import logging
import math
import pickle
import shutil
from pathlib import Path

import pytest
import torch

import mixprec
from mixprec.checkpoint import CheckpointError

from toys import SineRegressor as _Regressor
from toys import SineRows as _Rows

transformers = pytest.importorskip("transformers")

KEYS = ("loss", "grad_norm", "learning_rate", "eval_loss", "epoch", "step")


def run(trainer_cls: type, args_cls: type, out: Path, resume=None, model=None, data=_Rows, callbacks=(), **more):
    """Two epochs of 5 optimizer steps (batches of 4, accumulated over 2), a checkpoint at every
    step; returns the Trainer (its ``state.log_history``) and the final weights."""
    model = model if model is not None else _Regressor()
    settings = dict(output_dir=str(out), num_train_epochs=2, per_device_train_batch_size=4, learning_rate=1e-2,
                    gradient_accumulation_steps=2, max_grad_norm=1.0, warmup_steps=2, weight_decay=0.0,
                    logging_steps=1, save_steps=1, eval_strategy="steps", eval_steps=2, report_to="none",
                    disable_tqdm=True, use_cpu=True, seed=3, per_device_eval_batch_size=8,
                    train_sampling_strategy="sequential")
    trainer = trainer_cls(model=model, args=args_cls(**{**settings, **more}), train_dataset=data(),
                          eval_dataset=data(), callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return trainer, {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_run(history: list[dict], weights: dict, reference: list[dict], reference_weights: dict) -> None:
    """The same weights (bit for bit) and, row for row, the same logged numbers (mixprec logs the
    loss to 6 significant digits, the epoch to 4 decimals)."""
    assert weights.keys() == reference_weights.keys()
    assert all(torch.equal(weights[k], reference_weights[k]) for k in weights)
    ours = [{k: row[k] for k in KEYS if k in row} for row in history if "train_runtime" not in row]
    theirs = [{k: row[k] for k in KEYS if k in row} for row in reference if "train_runtime" not in row]
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys() and all(math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-4 * (k == "epoch"))
                                            for k in a), (a, b)


def checkpoint_copy(src: Path, step: int, dst: Path) -> Path:
    """``src/checkpoint-{step}`` alone in a fresh output folder ``dst`` (the other run's files stay apart)."""
    shutil.copytree(src / f"checkpoint-{step}", dst / f"checkpoint-{step}")
    return dst / f"checkpoint-{step}"


class _RandomStateAtFirstStep(mixprec.TrainerCallback):
    def __init__(self) -> None:
        self.state = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.state is None:
            self.state = torch.random.get_rng_state()


@pytest.mark.parametrize("sampling", ["sequential", "random"])
def test_a_run_transformers_checkpointed_finishes_under_mixprec_as_if_uninterrupted(sampling, tmp_path, one_thread,
                                                                                    caplog):
    """Resumed from transformers' checkpoints mid-epoch (step 3), at an epoch's end (5) and in the
    second epoch (7, with ``resume_from_checkpoint=True``): transformers' final weights and logs;
    the batches already trained on are skipped (shuffled, each epoch's order is transformers')
    and the random state is the checkpoint's."""
    theirs, their_weights = run(transformers.Trainer, transformers.TrainingArguments, tmp_path / "hf",
                                train_sampling_strategy=sampling)
    for step, resume in ((3, None), (5, None), (7, True)):
        folder = checkpoint_copy(tmp_path / "hf", step, tmp_path / f"mp{step}")
        seen = _RandomStateAtFirstStep()
        with caplog.at_level(logging.WARNING, logger="mixprec"):
            ours, our_weights = run(mixprec.Trainer, mixprec.TrainingArguments, folder.parent,
                                    resume=resume or str(folder), callbacks=[seen], train_sampling_strategy=sampling)
        same_run(ours.state.log_history, our_weights, theirs.state.log_history, their_weights)
        assert ours.state.train_batch_size == 4 and ours.state.global_step == 10
        if step != 5:  # mid-epoch, the first step after the resume draws from the checkpoint's random state
            saved = torch.load(folder / "rng_state.pth", weights_only=False)
            assert torch.equal(seen.state, saved["cpu"])
    assert "no mixprec manifest.json, so its files cannot be verified" in caplog.text


@pytest.mark.parametrize("sampling", ["sequential", "random"])
def test_a_run_mixprec_checkpointed_finishes_under_transformers_as_if_uninterrupted(sampling, tmp_path, one_thread):
    """transformers' Trainer resumes mixprec's checkpoints (mid-epoch and in the second epoch) and
    ends with mixprec's weights and logs: the optimizer and the schedule in transformers' two
    parameter groups, the random state as transformers' rng_state.pth, and (shuffled) each
    epoch's order transformers'."""
    ours, our_weights = run(mixprec.Trainer, mixprec.TrainingArguments, tmp_path / "mp", train_sampling_strategy=sampling)
    for step in (3, 7):
        folder = checkpoint_copy(tmp_path / "mp", step, tmp_path / f"hf{step}")
        assert len(torch.load(folder / "optimizer.pt", weights_only=True)["param_groups"]) == 2
        theirs, their_weights = run(transformers.Trainer, transformers.TrainingArguments, folder.parent,
                                    resume=str(folder), train_sampling_strategy=sampling)
        same_run(theirs.state.log_history, their_weights, ours.state.log_history, our_weights)


def test_weights_as_pytorch_model_bin_go_both_ways_with_save_safetensors_false(tmp_path, one_thread):
    """``save_safetensors=False``: mixprec's checkpoints and ``save_model`` hold ``pytorch_model.bin``
    (no ``model.safetensors``), which transformers resumes; and a transformers checkpoint whose
    weights are a ``pytorch_model.bin`` resumes under mixprec (read with ``weights_only=True``)."""
    ours, our_weights = run(mixprec.Trainer, mixprec.TrainingArguments, tmp_path / "mp", save_safetensors=False)
    folder = checkpoint_copy(tmp_path / "mp", 7, tmp_path / "hf")
    assert (folder / "pytorch_model.bin").is_file() and not (folder / "model.safetensors").exists()
    ours.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "pytorch_model.bin").is_file() and not (tmp_path / "final" / "model.safetensors").exists()
    theirs, their_weights = run(transformers.Trainer, transformers.TrainingArguments, folder.parent, resume=str(folder))
    same_run(theirs.state.log_history, their_weights, ours.state.log_history, our_weights)
    # Back: transformers' checkpoint-9 of that run, its weights turned into a pytorch_model.bin.
    back = checkpoint_copy(tmp_path / "hf", 9, tmp_path / "back")
    import safetensors.torch

    torch.save(safetensors.torch.load_file(back / "model.safetensors"), back / "pytorch_model.bin")
    (back / "model.safetensors").unlink()
    again, again_weights = run(mixprec.Trainer, mixprec.TrainingArguments, back.parent, resume=True)
    same_run(again.state.log_history, again_weights, ours.state.log_history, our_weights)


class _Evil:
    def __reduce__(self):
        return (exec, ("import builtins; builtins.CHECKPOINT_RAN_CODE = True",))


def test_a_transformers_checkpoint_that_would_run_code_is_refused_before_it_runs(tmp_path, one_thread):
    theirs, _ = run(transformers.Trainer, transformers.TrainingArguments, tmp_path / "hf", max_steps=2,
                    eval_strategy="no")
    folder = checkpoint_copy(tmp_path / "hf", 2, tmp_path / "mp")
    (folder / "optimizer.pt").write_bytes(pickle.dumps({"state": _Evil(), "param_groups": []}, protocol=2))
    with pytest.raises(CheckpointError, match="refusing to load .*optimizer.pt"):
        run(mixprec.Trainer, mixprec.TrainingArguments, folder.parent, resume=str(folder))
    import builtins

    assert not hasattr(builtins, "CHECKPOINT_RAN_CODE")


def test_a_folder_that_is_no_checkpoint_is_refused_with_what_a_checkpoint_holds(tmp_path):
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / "model.safetensors").write_bytes(b"")
    trainer = mixprec.Trainer(model=_Regressor(), train_dataset=_Rows(),
                              args=mixprec.TrainingArguments(str(tmp_path), use_cpu=True, report_to="none"))
    with pytest.raises(ValueError, match="Can't find a valid checkpoint at .*trainer_state.json"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x = torch.randint(0, 64, (24, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _tiny_gpt2() -> torch.nn.Module:
    """A 2-layer GPT-2 of 8k parameters whose ``save_pretrained`` shards above 20 KB (two shards)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    model.accepts_loss_kwargs = False  # transformers' loss is then the mean, as mixprec's is
    model.save_pretrained = functools.partial(model.save_pretrained, max_shard_size="20KB")
    return model


@pytest.mark.slow
def test_sharded_safetensors_resume_and_load_best_both_ways(tmp_path, one_thread):
    """A Hugging Face model whose weights ``save_pretrained`` shards: transformers' sharded
    checkpoint resumes under mixprec, whose ``load_best_model_at_end`` reads the best one
    (transformers' sharded folder); mixprec's own checkpoints hold the same shards and index,
    and transformers resumes them."""
    best = dict(gradient_accumulation_steps=1, save_steps=2, load_best_model_at_end=True,
                metric_for_best_model="loss", greater_is_better=True, weight_decay=0.01)  # best: the first
    theirs, their_weights = run(transformers.Trainer, transformers.TrainingArguments, tmp_path / "hf",
                                model=_tiny_gpt2(), data=_Tokens, **best)
    folder = checkpoint_copy(tmp_path / "hf", 4, tmp_path / "mp")
    assert (folder / "model.safetensors.index.json").is_file() and not (folder / "model.safetensors").exists()
    ours, our_weights = run(mixprec.Trainer, mixprec.TrainingArguments, folder.parent, resume=str(folder),
                            model=_tiny_gpt2(), data=_Tokens, **best)
    assert ours.state.best_model_checkpoint == str(tmp_path / "hf" / "checkpoint-2")
    same_run(ours.state.log_history, our_weights, theirs.state.log_history, their_weights)
    mine = tmp_path / "mp" / "checkpoint-10"
    assert sorted(p.name for p in mine.glob("model-*")) == ["model-00001-of-00002.safetensors",
                                                              "model-00002-of-00002.safetensors"]
    back = checkpoint_copy(tmp_path / "mp", 10, tmp_path / "back")
    again, again_weights = run(transformers.Trainer, transformers.TrainingArguments, back.parent, resume=str(back),
                               model=_tiny_gpt2(), data=_Tokens, **best)
    same_run(again.state.log_history, again_weights, theirs.state.log_history, their_weights)


def test_save_only_model_writes_the_weights_alone_and_refuses_a_resume_from_them(tmp_path, one_thread):
    """As transformers' save_only_model: the checkpoint holds the weights (and the Trainer's state),
    no optimizer, schedule, scaler or random state; it loads as the best model, and a resume from
    it is refused with the fix."""
    trainer, weights = run(mixprec.Trainer, mixprec.TrainingArguments, tmp_path / "mp", save_only_model=True,
                           save_steps=5, load_best_model_at_end=True, eval_steps=5, metric_for_best_model="loss")
    folder = tmp_path / "mp" / "checkpoint-5"
    names = {p.name for p in folder.iterdir()}
    assert {"model.safetensors", "trainer_state.json"} <= names
    assert not names & {"optimizer.pt", "scheduler.pt", "rng_state.pth", "optimizer_0.bin", "random_states_0.bin"}
    assert trainer.state.best_model_checkpoint is not None
    with pytest.raises(ValueError, match=r"save_only_model=True\): a run cannot resume from it"):
        run(mixprec.Trainer, mixprec.TrainingArguments, tmp_path / "mp", resume=str(folder), save_only_model=True)


def test_a_resume_skips_through_get_resumed_dataloader_which_an_override_replaces(tmp_path, one_thread):
    """A mid-epoch resume asks get_resumed_dataloader for the loader, as transformers does: the
    default skips the trained batches (the same run as without the override); an override that
    positions the loader itself is what the run iterates."""
    calls = []

    class Counting(mixprec.Trainer):
        def get_resumed_dataloader(self, dataloader, num_batches):
            calls.append(num_batches)
            return super().get_resumed_dataloader(dataloader, num_batches)

    reference, ref_weights = run(mixprec.Trainer, mixprec.TrainingArguments, tmp_path / "a")
    folder = checkpoint_copy(tmp_path / "a", 3, tmp_path / "b")
    resumed, weights = run(Counting, mixprec.TrainingArguments, folder.parent, resume=str(folder))
    assert calls == [6]  # 3 steps of 2 accumulated batches
    same_run(resumed.state.log_history, weights, reference.state.log_history, ref_weights)

    class Replacing(mixprec.Trainer):
        def get_resumed_dataloader(self, dataloader, num_batches):
            return list(dataloader)

    with pytest.raises(ValueError, match="must return the dataloader it was given"):
        run(Replacing, mixprec.TrainingArguments, folder.parent, resume=str(folder))
