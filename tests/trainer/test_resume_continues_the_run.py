"""A resume continues the run it comes from: from the checkpoint chosen as told (or, after a
torchrun restart, untold), with each step logged once, under the arguments of the new run, its
files verified before they are read, and its Hugging Face files beside the Accelerator's."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

from mixprec import Trainer, TrainerCallback, TrainingArguments
from mixprec.checkpoint import CheckpointError
from mixprec.checkpoint.folder import MANIFEST, write_checkpoint
from mixprec.trainer.checkpoints import load_checkpoint_weights, verify_trainer_files

from toys import Classifier, blobs

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.PrecisionPerformanceWarning")


def _trainer(out: Path, steps: int = 6, callbacks=(), model=None, **more) -> Trainer:
    """64 samples in batches of 8 (8 steps an epoch), a checkpoint every 2 steps."""
    settings = dict(output_dir=str(out), max_steps=steps, save_steps=2, per_device_train_batch_size=8,
                    disable_tqdm=True, report_to="none", use_cpu=True, seed=0)
    torch.manual_seed(0)
    return Trainer(model=model if model is not None else Classifier(), args=TrainingArguments(**{**settings, **more}),
                   train_dataset=blobs(64), callbacks=list(callbacks))


class _Began(TrainerCallback):
    """The step each train() began at."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def three_checkpoints(tmp_path):
    out = tmp_path / "run"
    _trainer(out).train()
    return out


# -- which checkpoint ------------------------------------------------------------------------------
def test_a_run_restarted_by_torchrun_resumes_from_its_newest_checkpoint_untold(three_checkpoints, tmp_path,
                                                                              monkeypatch, caplog):
    out = three_checkpoints
    for count, folder, began in (("1", out, 6), ("1", tmp_path / "new", 0), ("0", out, 0), ("", out, 0)):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", count)
        caplog.clear()
        cb = _Began()
        with caplog.at_level(logging.WARNING, logger="mixprec"):
            _trainer(folder, steps=8, callbacks=[cb]).train()
        said = " ".join(r.getMessage() for r in caplog.records)
        assert cb.steps == [began], (count, folder)
        assert ("restart 1 of this run (torchrun); resuming from " + str(out / "checkpoint-6") in said) is (began == 6)
        assert ("restart 1 of this run (torchrun); no checkpoint yet: starting over" in said) is (folder != out)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mixprec"):  # told, without a restart: nothing said of one
        _trainer(tmp_path / "empty", steps=2).train(resume_from_checkpoint="auto")
        _trainer(out, steps=8).train(resume_from_checkpoint=True)
    assert not any("restart" in r.getMessage() for r in caplog.records)


def test_auto_with_no_checkpoint_that_verifies_starts_over_and_says_so(three_checkpoints, caplog):
    out = three_checkpoints
    for step in (2, 4, 6):
        _flip_a_byte(out / f"checkpoint-{step}" / "optimizer_0.bin")
    cb = _Began()
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        _trainer(out, steps=6, callbacks=[cb]).train(resume_from_checkpoint="auto")
    assert cb.steps == [0]
    assert f"no checkpoint in {out} verifies (3 skipped): starting over" in caplog.text


@pytest.mark.parametrize("told", ["path", "newest"])
def test_a_checkpoint_named_or_newest_with_a_missing_or_truncated_file_fails_the_resume_and_says_so(three_checkpoints,
                                                                                                   told):
    # Only "auto" skips a damaged checkpoint; a resume told which one (or True, the newest) stops.
    folder = three_checkpoints / "checkpoint-6"
    data = (folder / "optimizer_0.bin").read_bytes()
    (folder / "optimizer_0.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"optimizer(_0\.bin|\.pt) is \d+ bytes, the manifest says"):
        _trainer(three_checkpoints, steps=8).train(resume_from_checkpoint=str(folder) if told == "path" else True)


def test_the_trainers_own_files_are_verified_before_they_are_read(three_checkpoints, tmp_path):
    folder = three_checkpoints / "checkpoint-4"
    _flip_a_byte(folder / "mixprec_trainer_state.json")
    with pytest.raises(CheckpointError, match="sha256 of .*mixprec_trainer_state.json is not the one"):
        _trainer(three_checkpoints, steps=8).train(resume_from_checkpoint=str(folder))
    other = write_checkpoint(tmp_path / "other", {"a.bin": lambda p: p.write_bytes(b"a")})
    with pytest.raises(CheckpointError, match=r"other/trainer_state.json is not listed in .*manifest.json"):
        verify_trainer_files(other)


# -- what continues ------------------------------------------------------------------------------------
def test_a_resume_logs_each_step_once_under_the_new_runs_logging_steps_and_purges_tensorboard_after_it(tmp_path):
    out = tmp_path / "run"
    _trainer(out, logging_steps=1, report_to=["jsonl"]).train()
    resumed = _trainer(out, logging_steps=3, report_to=["jsonl", "tensorboard"])
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 6]  # 3..6 of the first run dropped, replayed
    (tensorboard,) = [cb for cb in resumed.callback_handler.callbacks if type(cb).__name__ == "TensorBoardCallback"]
    assert tensorboard.purge_step == 3


class _Inputs(Classifier):
    """Records the first feature of each batch it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[float] = []

    def forward(self, features, labels=None):
        self.seen.append(round(float(features[0, 0]), 5))
        return super().forward(features, labels)


def test_ignore_data_skip_starts_the_data_over_while_the_steps_go_on(tmp_path):
    out = tmp_path / "run"
    first = _Inputs()
    _trainer(out, steps=12, model=first, save_steps=10).train()  # checkpoint-10: in the second epoch
    again = _Inputs()
    trainer = _trainer(out, steps=12, model=again, save_steps=10, ignore_data_skip=True)
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-10"))
    assert again.seen == first.seen[:2] and trainer.state.global_step == 12  # epoch 0's first batches


def test_an_override_of_get_resumed_dataloader_that_skips_nothing_trains_the_epoch_from_its_start(tmp_path):
    out = tmp_path / "run"
    first = _Inputs()
    _trainer(out, steps=8, model=first).train()

    class Restarting(Trainer):
        def get_resumed_dataloader(self, dataloader, num_batches):
            return dataloader  # positioned by the loader's own state: here, none kept

    again = _Inputs()
    args = _trainer(out, steps=8).args
    torch.manual_seed(0)
    Restarting(model=again, args=args, train_dataset=blobs(64)).train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert again.seen == first.seen[:6]  # the epoch's batches from its first, for the 6 steps left


def test_a_best_checkpoint_that_is_gone_is_forgotten_with_a_warning(tmp_path, caplog):
    out = tmp_path / "run"
    settings = dict(eval_strategy="steps", eval_steps=2, metric_for_best_model="loss", greater_is_better=True)
    trainer = _trainer(out, **settings)
    trainer.eval_dataset = blobs(16, seed=1)
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and best != str(out / "checkpoint-6")
    os.rename(best, tmp_path / "elsewhere")
    resumed = _trainer(out, steps=8, **settings)
    resumed.eval_dataset = blobs(16, seed=1)
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-6"))
    assert f"the best checkpoint {best} recorded in the resumed state does not exist anymore" in caplog.text
    assert resumed.state.best_model_checkpoint != best


# -- the files -------------------------------------------------------------------------------------------
def test_load_checkpoint_weights_checks_each_file_it_reads_and_says_when_it_cannot(tmp_path, caplog):
    source = Classifier()
    ours = tmp_path / "ours"
    _trainer(ours, steps=2, model=source).train()
    model_0 = ours / "checkpoint-2" / "model_0.safetensors"
    _flip_a_byte(model_0)
    with pytest.raises(CheckpointError, match="sha256 of .*model_0.safetensors"):
        load_checkpoint_weights(Classifier(), ours / "checkpoint-2", "cpu")
    hf_only = write_checkpoint(tmp_path / "hf_only", {  # a manifest, and Hugging Face's weights alone
        "model.safetensors": lambda p: safetensors.torch.save_model(source, str(p))})
    target = Classifier()
    load_checkpoint_weights(target, hf_only, "cpu")
    assert torch.equal(target.net.weight, source.net.weight)
    _flip_a_byte(hf_only / "model.safetensors")
    with pytest.raises(CheckpointError, match="sha256 of .*model.safetensors"):
        load_checkpoint_weights(Classifier(), hf_only, "cpu")
    foreign = tmp_path / "foreign"  # no manifest: another trainer's folder
    foreign.mkdir()
    safetensors.torch.save_model(source, str(foreign / "model.safetensors"))
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        load_checkpoint_weights(Classifier(), foreign, "cpu")
    assert f"{foreign} has no mixprec {MANIFEST} (written by another trainer)" in caplog.text


class _Tokenizer:
    def save_pretrained(self, folder: str) -> None:
        Path(folder, "tokenizer_config.json").write_text("{}")


def test_a_checkpoint_holds_hugging_faces_names_linked_to_the_accelerators_files_or_copied(tmp_path, monkeypatch):
    out = tmp_path / "fp16"
    trainer = _trainer(out, steps=2, fp16=True)
    trainer.processing_class = _Tokenizer()
    trainer.train()
    folder = out / "checkpoint-2"
    files = json.loads((folder / MANIFEST).read_text())["files"]
    for hf, ours in (("scaler.pt", "scaler.bin"), ("optimizer.pt", "optimizer_0.bin"),
                     ("model.safetensors", "model_0.safetensors")):
        assert (folder / hf).stat().st_ino == (folder / ours).stat().st_ino, hf
    assert "tokenizer_config.json" in files and "scaler.pt" in files
    monkeypatch.setattr(os, "link", lambda src, dst: (_ for _ in ()).throw(OSError(18, "no hard links here")))
    out = tmp_path / "no-links"
    _trainer(out, steps=2).train()
    folder = out / "checkpoint-2"
    assert (folder / "optimizer.pt").read_bytes() == (folder / "optimizer_0.bin").read_bytes()
    assert (folder / "optimizer.pt").stat().st_ino != (folder / "optimizer_0.bin").stat().st_ino


def test_a_hugging_face_models_checkpoint_links_its_identical_weights_and_holds_its_config(tmp_path):
    transformers = pytest.importorskip("transformers")

    def bert():
        torch.manual_seed(0)
        config = transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=16, max_position_embeddings=16, num_labels=2)
        return transformers.BertForSequenceClassification(config)

    x = torch.randint(0, 32, (16, 6), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": x[i], "labels": i % 2} for i in range(16)]
    for safe in (True, False):
        args = TrainingArguments(str(tmp_path / str(safe)), max_steps=2, save_steps=2, per_device_train_batch_size=4,
                                 use_cpu=True, report_to="none", disable_tqdm=True, save_safetensors=safe)
        Trainer(model=bert(), args=args, train_dataset=rows).train()
        folder = tmp_path / str(safe) / "checkpoint-2"
        assert (folder / "config.json").is_file()
        if safe:  # save_pretrained wrote the Accelerator's very bytes: one copy on disk
            assert (folder / "model.safetensors").stat().st_ino == (folder / "model_0.safetensors").stat().st_ino
        else:
            assert (folder / "pytorch_model.bin").is_file()


def test_a_checkpoint_holds_the_runs_counts_at_its_step_and_a_resume_ends_with_the_uninterrupted_runs(tmp_path):
    def run(out: Path, resume: str | None = None) -> Trainer:
        model = Classifier()
        model.main_input_name = "features"  # its "tokens": 16 features a sample
        model.num_parameters = lambda exclude_embeddings=False: 68  # (what transformers' models count FLOPs with)
        trainer = _trainer(out, steps=4, model=model, fp16=True, logging_steps=100, include_num_input_tokens_seen=True)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full")
    folder = tmp_path / "full" / "checkpoint-2"  # no log before it: what it holds was read for it
    theirs = json.loads((folder / "trainer_state.json").read_text())
    ours = json.loads((folder / "mixprec_trainer_state.json").read_text())
    scaler = torch.load(folder / "scaler.bin", weights_only=True)
    assert (theirs["num_input_tokens_seen"], theirs["total_flos"]) == (2 * 8 * 16, 6 * 2 * 8 * 16 * 68)
    assert (ours["loss_scale"], ours["skipped_steps"]) == (scaler["scale"], scaler["skipped_steps"])
    assert json.loads((folder / "training_args.json").read_text())["max_steps"] == 4
    resumed = run(tmp_path / "part", resume=str(folder))
    assert (resumed.state.num_input_tokens_seen, resumed.state.total_flos) == (
        full.state.num_input_tokens_seen, full.state.total_flos)
