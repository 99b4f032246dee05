"""The digits task: the split, batched fetching, the two models learning, and the accuracy metric."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mixprec.tasks import get_task
from mixprec.tasks.digits import DigitsCNN, DigitsDataset, DigitsMLP, accuracy, load_digits_split

pytest.importorskip("sklearn")


def test_split_is_the_same_on_every_call_and_changes_with_the_seed():
    x1, y1 = load_digits_split("train")
    x2, y2 = load_digits_split("train")
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    x3, _ = load_digits_split("train", seed=1)
    assert not torch.equal(x1, x3)


def test_train_and_validation_partition_the_dataset_80_20():
    from sklearn.datasets import load_digits

    full = load_digits()
    (xt, yt), (xv, yv) = load_digits_split("train"), load_digits_split("validation")
    assert (len(yt), len(yv)) == (1438, 359)
    ours = np.concatenate([np.c_[xt.numpy() * 16, yt.numpy()], np.c_[xv.numpy() * 16, yv.numpy()]])
    theirs = np.c_[full.data, full.target]
    # Same multiset of (image, label) rows: every sample is in exactly one split.
    assert np.array_equal(ours[np.lexsort(ours.T)], theirs[np.lexsort(theirs.T)])


def test_pixels_are_float32_in_the_unit_interval_and_labels_int64():
    x, y = load_digits_split("validation")
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0
    assert set(y.tolist()) == set(range(10))


def test_unknown_split_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"choose one of \['train', 'validation'\]"):
        load_digits_split("test")


@pytest.mark.parametrize("image, shape", [(False, (64,)), (True, (1, 8, 8))])
def test_getitems_returns_exactly_the_stacked_getitem_samples(image, shape):
    ds = DigitsDataset("validation", image=image)
    indices = [3, 0, 358, 3]
    batch = ds.__getitems__(indices)
    assert ds[0]["pixel_values"].shape == shape and ds[0]["labels"].dtype == torch.long
    for key in ("pixel_values", "labels"):
        assert torch.equal(batch[key], torch.stack([ds[i][key] for i in indices]))


def test_missing_scikit_learn_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(ImportError, match=r"pip install 'mixprec\[tasks\]'"):
        load_digits_split("train")


def _train(model: torch.nn.Module, image: bool, steps: int) -> float:
    train, val = DigitsDataset("train", image=image), DigitsDataset("validation", image=image)
    batch = train.__getitems__(list(range(len(train))))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):  # full-batch: 1,438 images of 64 pixels are a few microseconds each
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = model(val.pixel_values).logits
    return accuracy(logits, val.labels)


def test_mlp_reaches_well_above_chance_accuracy_after_a_short_training():
    torch.manual_seed(0)
    assert _train(DigitsMLP(), image=False, steps=60) > 0.9


def test_cnn_reaches_well_above_chance_accuracy_after_a_short_training():
    torch.manual_seed(0)
    assert _train(DigitsCNN(), image=True, steps=40) > 0.9


@pytest.mark.parametrize("model_cls, shape", [(DigitsMLP, (8, 64)), (DigitsCNN, (8, 1, 8, 8))])
def test_models_give_a_float32_loss_under_bf16_autocast_and_with_bf16_parameters(model_cls, shape):
    torch.manual_seed(0)
    model, x, y = model_cls(), torch.rand(shape), torch.arange(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, labels=y)
    assert out.logits.dtype == torch.bfloat16 and out.loss.dtype == torch.float32
    out = model.to(torch.bfloat16)(x.bfloat16(), labels=y)
    assert torch.isfinite(out.loss) and out["loss"].dtype == torch.float32
    assert "loss" not in model(x.bfloat16())


def test_models_accept_both_flat_and_image_pixels():
    x = torch.rand(3, 64)
    for model in (DigitsMLP(), DigitsCNN()):
        torch.testing.assert_close(model(x).logits, model(x.view(3, 1, 8, 8)).logits)


def test_accuracy_takes_logits_or_class_ids_as_arrays_or_tensors():
    logits = np.array([[2.0, 1.0], [0.0, 3.0], [5.0, 0.0], [1.0, 2.0]])
    labels = np.array([0, 1, 1, 1])
    assert accuracy(logits, labels) == 0.75
    assert accuracy(logits.argmax(-1), labels) == 0.75
    assert accuracy(torch.tensor(logits, dtype=torch.bfloat16), torch.tensor(labels)) == 0.75


def test_accuracy_rejects_mismatched_shapes_with_the_fix():
    with pytest.raises(ValueError, match="pass class ids shaped like the labels"):
        accuracy(np.zeros(3), np.zeros(4))


def test_digits_task_computes_accuracy_from_eval_predictions():
    task = get_task("digits", arch="cnn")
    assert task.name == "digits/cnn" and task.eval_dataset[0]["pixel_values"].shape == (1, 8, 8)
    labels = task.eval_dataset.labels.numpy()
    one_hot = np.eye(10, dtype=np.float32)[labels]
    metrics = task.compute_metrics(SimpleNamespace(predictions=one_hot, label_ids=labels))
    assert metrics == {"accuracy": 1.0} and task.greater_is_better


def test_digits_task_rejects_an_unknown_arch_and_a_size_with_the_fix():
    with pytest.raises(ValueError, match=r"choose one of \['mlp', 'cnn'\]"):
        get_task("digits", arch="resnet")
    with pytest.raises(ValueError, match="has no sizes"):
        get_task("digits", "tiny")
