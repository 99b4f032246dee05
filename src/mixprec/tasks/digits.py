"""Image classification on scikit-learn's bundled 8x8 handwritten digits (no download).

``sklearn.datasets.load_digits`` reads 1,797 images shipped inside scikit-learn. They are split
80/20 by a fixed permutation, and pixel values (0..16) are scaled to [0, 1]. Two models: an MLP
over the 64 pixels and a small CNN over the ``[1, 8, 8]`` image.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mixprec.data import collate
from mixprec.models import ClassifierOutput
from mixprec.tasks.task import Task

__all__ = ["NUM_CLASSES", "DIGITS_ARCHS", "load_digits_split", "DigitsDataset", "DigitsMLP", "DigitsCNN", "accuracy",
           "collate", "digits_task"]

NUM_CLASSES = 10
SPLITS = ("train", "validation")
_IMAGE_SHAPE = (1, 8, 8)
_MAX_PIXEL = 16.0


def _load_digits() -> Any:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError("the digits task needs scikit-learn, which ships the data: "
                          "pip install 'mixprec[tasks]'") from exc
    return load_digits()


def load_digits_split(split: str = "train", *, seed: int = 0,
                      val_fraction: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """One split of the digits as ``(pixels float32 [n, 64] in [0, 1], labels int64 [n])``.

    Args:
        split: ``"train"`` or ``"validation"``.
        seed: Seed of the permutation that splits the data; the same seed gives the same split.
        val_fraction: Share of the images in the validation split.

    Example:
        >>> x, y = load_digits_split("validation")
        >>> x.shape, float(x.max()) <= 1.0
        (torch.Size([359, 64]), True)
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {list(SPLITS)}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be strictly between 0 and 1, got {val_fraction!r}")
    digits = _load_digits()
    n = len(digits.target)
    # The legacy RandomState stream is frozen by NumPy's compatibility policy, so the split is
    # the same under every NumPy version (the newer Generator's streams may change).
    order = np.random.RandomState(seed).permutation(n)
    n_val = int(round(n * val_fraction))
    chosen = order[:n_val] if split == "validation" else order[n_val:]
    pixels = torch.from_numpy(digits.data[chosen].astype(np.float32) / _MAX_PIXEL)
    labels = torch.from_numpy(digits.target[chosen].astype(np.int64))
    return pixels, labels


class DigitsDataset(torch.utils.data.Dataset):
    """One split of the digits: ``{"pixel_values": ..., "labels": LongTensor[]}`` per sample.

    ``pixel_values`` is ``FloatTensor[64]`` for the MLP or ``FloatTensor[1, 8, 8]`` with
    ``image=True`` for the CNN. ``__getitems__(indices)`` returns the batch already stacked (one
    tensor index); torch's ``DataLoader`` hands it to ``collate_fn``, so pass
    ``collate_fn=collate``, which passes a stacked dict through.

    Args:
        split: ``"train"`` or ``"validation"``.
        image: Shape each sample ``[1, 8, 8]`` instead of ``[64]``.
        seed: Seed of the split (see :func:`load_digits_split`).
        val_fraction: Share of the images in the validation split.

    Example:
        >>> ds = DigitsDataset("train", image=True)
        >>> len(ds), ds[0]["pixel_values"].shape
        (1438, torch.Size([1, 8, 8]))
    """

    def __init__(self, split: str = "train", *, image: bool = False, seed: int = 0, val_fraction: float = 0.2) -> None:
        pixels, labels = load_digits_split(split, seed=seed, val_fraction=val_fraction)
        self.split = split
        self.pixel_values = pixels.view(-1, *_IMAGE_SHAPE) if image else pixels
        self.labels = labels

    def __len__(self) -> int:
        return self.labels.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.pixel_values[index], "labels": self.labels[index]}

    def __getitems__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """The samples at ``indices``, stacked along a new first dimension."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        return {"pixel_values": self.pixel_values[idx], "labels": self.labels[idx]}


def _classifier_output(logits: torch.Tensor, labels: torch.Tensor | None) -> ClassifierOutput:
    # Float32 cross-entropy, so the loss is exact under bf16/fp16 autocast and bf16 parameters.
    loss = None if labels is None else F.cross_entropy(logits.float(), labels)
    return ClassifierOutput(loss=loss, logits=logits)


class DigitsMLP(nn.Module):
    """A two-hidden-layer perceptron over the 64 pixels.

    Args:
        hidden_size: Width of the hidden layers.
        dropout: Dropout probability after each hidden layer.

    Example:
        >>> out = DigitsMLP()(torch.rand(4, 64), labels=torch.tensor([0, 1, 2, 3]))
        >>> out.logits.shape
        torch.Size([4, 10])
    """

    def __init__(self, hidden_size: int = 128, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, hidden_size), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden_size, hidden_size), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden_size, NUM_CLASSES),
        )

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> ClassifierOutput:
        """Class scores for ``pixel_values`` (``[batch, 64]`` or ``[batch, 1, 8, 8]``), and the loss."""
        return _classifier_output(self.net(pixel_values.flatten(1)), labels)


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, a 2x2 max-pool and a linear classifier over the 8x8 image.

    Args:
        channels: Channels of the first convolution (the second has twice as many).

    Example:
        >>> DigitsCNN()(torch.rand(4, 1, 8, 8)).logits.shape
        torch.Size([4, 10])
    """

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, kernel_size=3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, kernel_size=3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(2 * channels * 4 * 4, NUM_CLASSES)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> ClassifierOutput:
        """Class scores for ``pixel_values`` (``[batch, 1, 8, 8]`` or ``[batch, 64]``), and the loss."""
        images = pixel_values.view(-1, *_IMAGE_SHAPE) if pixel_values.dim() == 2 else pixel_values
        return _classifier_output(self.classifier(self.features(images).flatten(1)), labels)


def accuracy(predictions_or_logits: np.ndarray | torch.Tensor, labels: np.ndarray | torch.Tensor) -> float:
    """The share of predictions equal to the labels.

    Args:
        predictions_or_logits: Class ids ``[n]``, or scores ``[n, num_classes]`` (argmax taken).
        labels: Class ids ``[n]``.

    Example:
        >>> accuracy(np.array([[0.1, 0.9], [0.8, 0.2]]), np.array([1, 1]))
        0.5
    """
    preds, target = _to_numpy(predictions_or_logits), _to_numpy(labels)
    if preds.ndim == target.ndim + 1:
        preds = preds.argmax(axis=-1)
    if preds.shape != target.shape:
        raise ValueError(f"predictions of shape {preds.shape} do not match labels of shape {target.shape}; "
                         "pass class ids shaped like the labels, or logits with one extra last dimension")
    if target.size == 0:
        raise ValueError("accuracy() of no labels is undefined; pass at least one sample")
    return float((preds == target).mean())


def _to_numpy(values: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu()
        # numpy has no bfloat16; widen floating tensors before converting.
        return (values.float() if values.is_floating_point() else values).numpy()
    return np.asarray(values)


DIGITS_ARCHS: dict[str, Callable[[], nn.Module]] = {"mlp": DigitsMLP, "cnn": DigitsCNN}


def digits_task(arch: str = "mlp", *, seed: int = 0) -> Task:
    """The digits :class:`Task`: a classifier (``arch``, a key of :data:`DIGITS_ARCHS`) of the 8x8 digits.

    Reached through ``get_task("digits", arch=...)``, which checks the options first.

    Args:
        arch: ``"mlp"`` over the 64 pixels, or ``"cnn"`` over the ``[1, 8, 8]`` image.
        seed: Seed of the train/validation split.
    """
    image = arch == "cnn"
    return Task(
        name=f"digits/{arch}",
        build_model=DIGITS_ARCHS[arch],
        train_dataset=DigitsDataset("train", image=image, seed=seed),
        eval_dataset=DigitsDataset("validation", image=image, seed=seed),
        compute_metrics=_digits_metrics,
        metric_name="accuracy",
        greater_is_better=True,
        description=f"scikit-learn's 8x8 handwritten digits, {arch.upper()} classifier",
    )


def _digits_metrics(eval_pred: Any) -> dict[str, float]:
    predictions = eval_pred.predictions
    predictions = predictions[0] if isinstance(predictions, tuple) else predictions
    return {"accuracy": accuracy(np.asarray(predictions), np.asarray(eval_pred.label_ids))}
