"""The pycode task: the stdlib file list and split, byte blocks, metrics, and that the GPT learns."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

from mixprec.tasks import get_task
from mixprec.tasks.gpt import GPT
from mixprec.tasks.pycode import (
    PYCODE_SIZES,
    ByteBlockDataset,
    bits_per_byte,
    collate,
    generate_sample,
    list_source_files,
    load_pycode_bytes,
    split_source_files,
    stdlib_root,
)


@pytest.fixture(scope="module")
def files() -> list[str]:
    return list_source_files()


def test_file_list_is_sorted_and_the_same_on_every_call(files):
    assert files == sorted(files)
    assert list_source_files() == files
    assert "os.py" in files and len(files) > 100


def test_file_list_leaves_out_tests_installed_packages_and_bytecode(files):
    banned = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
    assert not [f for f in files if banned & set(f.split("/")[:-1])]
    assert all(f.endswith(".py") for f in files)


def test_train_and_validation_files_are_disjoint_and_cover_every_file(files):
    train = split_source_files(files, "train")
    val = split_source_files(files, "validation")
    assert not set(train) & set(val)
    assert sorted(train + val) == files
    assert len(val) == len(files) // 10


def test_unknown_split_lists_the_valid_ones(files):
    with pytest.raises(ValueError, match=r"choose one of \['train', 'validation'\]"):
        split_source_files(files, "test")


def test_bytes_are_capped_exactly_and_read_from_the_first_files_in_sorted_order(files):
    data = load_pycode_bytes("train", max_bytes=5000)
    assert data.dtype == torch.uint8 and data.shape == (5000,)
    first = (stdlib_root() / split_source_files(files, "train")[0]).read_bytes()
    n = min(len(first), 5000)
    assert bytes(data[:n].tolist()) == first[:n]
    assert torch.equal(load_pycode_bytes("train", max_bytes=5000), data)


def test_train_and_validation_text_differ():
    train = load_pycode_bytes("train", max_bytes=2000)
    val = load_pycode_bytes("validation", max_bytes=2000)
    assert not torch.equal(train, val)


def test_a_directory_without_sources_raises_with_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="pass root= a directory of Python source files"):
        list_source_files(tmp_path)


def test_blocks_are_consecutive_and_do_not_overlap():
    data = torch.arange(250, dtype=torch.uint8)
    ds = ByteBlockDataset(data, block_size=8)
    assert len(ds) == 31  # the 2 trailing bytes make no full block
    assert torch.equal(torch.cat([ds[i]["input_ids"] for i in range(len(ds))]), data[:248].long())


def test_getitems_returns_exactly_the_stacked_getitem_samples():
    ds = ByteBlockDataset(load_pycode_bytes("validation", max_bytes=4096), block_size=64)
    indices = [5, 0, 17, 5, 63]
    batch = ds.__getitems__(indices)
    for key in ("input_ids", "labels"):
        expected = torch.stack([ds[i][key] for i in indices])
        assert batch[key].dtype == expected.dtype == torch.long
        assert torch.equal(batch[key], expected)


def test_labels_are_not_the_same_tensor_as_input_ids():
    ds = ByteBlockDataset(torch.arange(16, dtype=torch.uint8), block_size=4)
    for sample in (ds[0], ds.__getitems__([0, 1])):
        sample["labels"][..., 0] = -100
        assert int(sample["input_ids"].min()) >= 0


def test_dataloader_with_collate_yields_the_batches_getitem_would_build():
    ds = ByteBlockDataset(load_pycode_bytes("train", max_bytes=2048), block_size=32)
    loader = DataLoader(ds, batch_size=16, shuffle=False, collate_fn=collate)
    batches = list(loader)
    assert len(batches) == 4
    assert torch.equal(batches[1]["input_ids"], torch.stack([ds[i]["input_ids"] for i in range(16, 32)]))


def test_collate_passes_a_stacked_dict_through_and_stacks_a_list_of_dicts():
    stacked = {"input_ids": torch.zeros(2, 3, dtype=torch.long)}
    assert collate(stacked)["input_ids"] is stacked["input_ids"]
    samples = [{"input_ids": torch.tensor([1, 2])}, {"input_ids": torch.tensor([3, 4])}]
    assert torch.equal(collate(samples)["input_ids"], torch.tensor([[1, 2], [3, 4]]))


def test_too_little_data_for_one_block_raises_with_the_fix():
    with pytest.raises(ValueError, match="read more bytes"):
        ByteBlockDataset(torch.zeros(10, dtype=torch.uint8), block_size=64)


def test_bits_per_byte_of_a_uniform_byte_model_is_8():
    assert bits_per_byte(math.log(256)) == pytest.approx(8.0)


def test_generate_sample_starts_with_the_prompt_and_restores_training_mode():
    torch.manual_seed(0)
    model = GPT(PYCODE_SIZES["tiny"]).train()
    text = generate_sample(model, "import ", max_new_tokens=30, generator=torch.Generator().manual_seed(0))
    assert isinstance(text, str) and text.startswith("import ")
    assert model.training


def test_sizes_have_the_intended_parameter_counts():
    counts = {name: GPT(config).num_parameters() for name, config in PYCODE_SIZES.items() if name != "small"}
    assert counts["tiny"] < 1_000_000
    assert 2_500_000 < counts["mini"] < 4_000_000


def test_unknown_size_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"choose one of \['tiny', 'mini', 'small'\]"):
        get_task("pycode", "huge")


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"the options are \['size', 'max_bytes', 'eval_max_bytes', 'root'\]"):
        get_task("pycode", "tiny", max_byte=10)


def _eval_loss(model: GPT, batch: dict[str, torch.Tensor]) -> float:
    model.eval()
    with torch.no_grad():
        loss = model(**batch).loss.item()
    model.train()
    return loss


def test_compute_metrics_matches_the_model_loss_from_preprocessed_or_raw_logits():
    task = get_task("pycode", "tiny", max_bytes=4096, eval_max_bytes=2048)
    torch.manual_seed(0)
    model = task.build_model()
    batch = task.collate_fn(task.eval_dataset.__getitems__(list(range(len(task.eval_dataset)))))
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits
    expected = model(**batch).loss.item()
    reduced = task.preprocess_logits_for_metrics(logits, batch["labels"])
    for predictions in (reduced.numpy(), logits.numpy()):
        metrics = task.compute_metrics(SimpleNamespace(predictions=predictions, label_ids=batch["labels"].numpy()))
        assert metrics["loss"] == pytest.approx(expected, rel=1e-5)
        assert metrics[task.metric_name] == pytest.approx(expected / math.log(2), rel=1e-5)
    assert task.greater_is_better is False


def test_a_few_dozen_adamw_steps_on_tiny_lower_the_eval_loss():
    task = get_task("pycode", "tiny", max_bytes=64_000, eval_max_bytes=4096)
    torch.manual_seed(0)
    model = task.build_model()
    eval_batch = task.collate_fn(task.eval_dataset.__getitems__(list(range(len(task.eval_dataset)))))
    before = _eval_loss(model, eval_batch)
    loader = DataLoader(task.train_dataset, batch_size=16, shuffle=True, collate_fn=task.collate_fn,
                        generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step, batch in enumerate(loader):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 39:
            break
    after = _eval_loss(model, eval_batch)
    assert before > 5.0  # near ln 256 = 5.55: real text repeats bytes, which an untrained model scores a bit higher
    assert after < before - 1.5
