"""A mixprec checkpoint whose model weights the user saved again in another Hugging Face layout.

transformers' Trainer resumes from a checkpoint whose ``model.safetensors`` was replaced by shards
and their index (its tests make them so); mixprec's does too: the weights there now are read as
transformers reads them (tensors only, unverified, with a warning naming them), and every other
file is still checked against the manifest.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import pytest
import torch

import mixprec
from mixprec.checkpoint import CheckpointError
from mixprec.checkpoint.weights import save_model_weights
from mixprec.trainer.checkpoints import load_checkpoint_weights

transformers = pytest.importorskip("transformers")


def _bert(shard_size: str | None = None) -> torch.nn.Module:
    """A 1-layer BERT classifier of about 3,000 weights (random, from a config: no download); with
    ``shard_size``, its ``save_pretrained`` (what mixprec's checkpoints call) shards above it."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=16, max_position_embeddings=16, num_labels=2)
    model = transformers.BertForSequenceClassification(config)
    if shard_size is not None:
        model.save_pretrained = functools.partial(model.save_pretrained, max_shard_size=shard_size)
    return model


def _rows() -> list[dict]:
    x = torch.randint(0, 32, (16, 6), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": x[i], "labels": i % 2} for i in range(16)]


def _train(out: Path, model: torch.nn.Module, resume=None, **more) -> mixprec.Trainer:
    """Two optimizer steps, a checkpoint after the second (``out/checkpoint-2``)."""
    args = mixprec.TrainingArguments(str(out), max_steps=2, save_steps=2, per_device_train_batch_size=4,
                                     learning_rate=1e-2, use_cpu=True, report_to="none", disable_tqdm=True, **more)
    trainer = mixprec.Trainer(model=model, args=args, train_dataset=_rows())
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _edited(folder: Path) -> torch.nn.Module:
    """The checkpoint's model, as a user loads it to save it again, with other weights (so loading them shows)."""
    edited = transformers.BertForSequenceClassification.from_pretrained(str(folder))
    with torch.no_grad():
        for p in edited.parameters():
            p.add_(0.25)
    return edited


def _whole_to_shards(folder: Path, model: torch.nn.Module) -> str:
    model.save_pretrained(str(folder), max_shard_size="4KB")
    (folder / "model.safetensors").unlink()
    return "model.safetensors.index.json"


def _shards_to_whole(folder: Path, model: torch.nn.Module) -> str:
    type(model).save_pretrained(model, str(folder))  # (transformers deletes the old shards, keeps the old index)
    return "model.safetensors"


def _safetensors_to_bin_shards(folder: Path, model: torch.nn.Module) -> str:
    save_model_weights(model, folder, max_shard_size="4KB", safe_serialization=False)
    (folder / "model.safetensors").unlink()
    return "pytorch_model.bin.index.json"


@pytest.mark.parametrize("resave, shard_size", [(_whole_to_shards, None), (_shards_to_whole, "4KB"),
                                                (_safetensors_to_bin_shards, None)],
                         ids=["whole-to-shards", "shards-to-whole", "to-pytorch_model-bin-shards"])
def test_a_checkpoint_whose_weights_were_saved_again_in_another_layout_resumes_with_those_weights(
        resave, shard_size, tmp_path, one_thread, caplog):
    """The run resumes at the checkpoint's step with the weights saved there now (not the ones its
    manifest verified), with a warning naming them; ``load_best_model_at_end``'s loading reads
    them too."""
    _train(tmp_path, _bert(shard_size))
    folder = tmp_path / "checkpoint-2"
    listed = sorted(p.name for p in folder.glob("model*.safetensors*"))
    edited = _edited(folder)
    source = resave(folder, edited)
    assert sorted(p.name for p in folder.glob("model*.safetensors*")) != listed
    want = edited.state_dict()
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        resumed = _train(tmp_path, _bert(shard_size), resume=str(folder))
    assert resumed.state.global_step == 2 and resumed.optimizer.state  # resumed, the optimizer's state and all
    got = resumed.model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    said = [r.getMessage() for r in caplog.records if "saved again" in r.getMessage()]
    assert len(said) == 1 and str(folder) in said[0] and f": {source}" in said[0], said
    if source.endswith(".index.json"):  # the shards it names, read in place of the listed weights
        shards = [p.name for p in folder.glob("*-of-*") if p.is_file()]
        assert f": {source} (shards " in said[0] and shards and all(n in said[0] for n in shards), said
    else:
        assert f": {source} in place of " in said[0], said
    best = _bert()
    load_checkpoint_weights(best, folder, "cpu")
    assert all(torch.equal(best.state_dict()[k], want[k]) for k in want)


def _resaved_checkpoint(tmp_path: Path) -> Path:
    _train(tmp_path, _bert())
    folder = tmp_path / "checkpoint-2"
    _whole_to_shards(folder, transformers.BertForSequenceClassification.from_pretrained(str(folder)))
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 2
    return folder


def test_a_checkpoint_with_resaved_weights_still_refuses_a_damaged_optimizer(tmp_path, one_thread):
    """Only the weights' files are taken unverified: the optimizer's state is checked as ever."""
    folder = _resaved_checkpoint(tmp_path)
    data = bytearray((folder / "optimizer_0.bin").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / "optimizer_0.bin").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"sha256 of .*optimizer_0\.bin is not the one in the manifest"):
        _train(tmp_path, _bert(), resume=str(folder))


@pytest.mark.parametrize("resume", ["path", True])
def test_resaved_weights_with_a_shard_missing_are_refused_naming_the_shard_and_the_fix(resume, tmp_path, one_thread):
    folder = _resaved_checkpoint(tmp_path)
    shard = sorted(folder.glob("model-*-of-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"not a complete set: .*{shard.name}"
                                              r" is missing.*model\.save_pretrained"):
        _train(tmp_path, _bert(), resume=str(folder) if resume == "path" else True)
