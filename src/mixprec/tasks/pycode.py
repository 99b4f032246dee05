"""Byte-level language modelling on the Python standard library's own source code.

Every Python installation carries its standard library as ``.py`` files, so this task needs no
download: the text is the files under ``sysconfig.get_paths()["stdlib"]`` (``site-packages``,
test suites and ``__pycache__`` left out), as raw bytes, one token per byte (vocabulary 256).

The split is by file and reproducible: the relative paths are sorted, and every 10th file is
validation. Reading is capped (``max_bytes``) and deterministic: the first files of the split in
sorted order, concatenated and cut at exactly ``max_bytes``. The text differs between Python
versions, so compare losses only between runs on the same interpreter.
"""

from __future__ import annotations

import functools
import math
import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mixprec.data import collate
from mixprec.tasks.gpt import GPT, GPTConfig
from mixprec.tasks.task import Task

__all__ = [
    "PYCODE_SIZES",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_EVAL_MAX_BYTES",
    "stdlib_root",
    "list_source_files",
    "split_source_files",
    "load_pycode_bytes",
    "ByteBlockDataset",
    "collate",
    "bits_per_byte",
    "generate_sample",
    "pycode_task",
]

PYCODE_SIZES: dict[str, GPTConfig] = {
    # For tests: trains visibly in a few dozen steps, well under a second per step on a CPU.
    "tiny": GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64),
    # For the CPU demo: about 3M parameters, a few minutes for a loss curve worth looking at.
    "mini": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=256),
    # For benchmarks and GPUs: about 25M parameters, where matrix products dominate the step.
    "small": GPTConfig(block_size=256, n_layer=8, n_head=8, n_embd=512),
}

DEFAULT_MAX_BYTES = 4_000_000
DEFAULT_EVAL_MAX_BYTES = 200_000

SPLITS = ("train", "validation")

# Directories that are not library source: installed packages, the test suites, bytecode.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
# Written between files, so that no file's end runs straight into the next one's first line.
_FILE_SEPARATOR = b"\n\n"
_VAL_EVERY = 10


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library source.

    Example:
        >>> (stdlib_root() / "os.py").exists()
        True
    """
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(root: str | os.PathLike[str] | None = None) -> list[str]:
    """The ``.py`` files under ``root``, as sorted relative POSIX paths.

    Skips ``site-packages``, ``dist-packages``, ``__pycache__`` and test directories (``test``,
    ``tests``, ``idlelib/idle_test``, ``lib2to3/tests``, ...) at any depth.

    Args:
        root: Directory to walk; the standard library (:func:`stdlib_root`) by default.

    Example:
        >>> "os.py" in list_source_files()
        True
    """
    base = Path(root) if root is not None else stdlib_root()
    if not base.is_dir():
        raise FileNotFoundError(f"{base} is not a directory; pass root= a directory of Python source files")
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        rel = Path(dirpath).relative_to(base)
        found.extend((rel / name).as_posix() for name in filenames if name.endswith(".py"))
    if not found:
        raise FileNotFoundError(f"no .py files under {base} (some installations ship only bytecode); "
                                "pass root= a directory of Python source files")
    return sorted(found)


def split_source_files(files: Sequence[str], split: str) -> list[str]:
    """The files of one split: every 10th file (indices 9, 19, ...) is validation.

    Args:
        files: Sorted relative paths, as :func:`list_source_files` returns them.
        split: ``"train"`` or ``"validation"``.

    Example:
        >>> split_source_files([f"{i}.py" for i in range(20)], "validation")
        ['9.py', '19.py']
    """
    _check_split(split)
    want_validation = split == "validation"
    return [f for i, f in enumerate(files) if (i % _VAL_EVERY == _VAL_EVERY - 1) == want_validation]


def load_pycode_bytes(split: str = "train", max_bytes: int = DEFAULT_MAX_BYTES,
                      root: str | os.PathLike[str] | None = None) -> torch.Tensor:
    """Read one split's text as a 1-D ``uint8`` tensor of at most ``max_bytes`` bytes.

    Reads the split's files in sorted order, joined by a blank line, and stops at ``max_bytes``
    (the last file read is cut), so the same arguments give the same bytes on one interpreter.

    Args:
        split: ``"train"`` or ``"validation"``.
        max_bytes: Cap on the bytes read, which bounds memory and time.
        root: Directory of source files; the standard library by default.

    Example:
        >>> load_pycode_bytes("validation", max_bytes=1000).shape
        torch.Size([1000])
    """
    _check_split(split)
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
    base = Path(root) if root is not None else stdlib_root()
    files = split_source_files(list_source_files(base), split)
    if not files:
        raise ValueError(f"the {split!r} split of {base} has no files (validation takes every "
                         f"{_VAL_EVERY}th file); pass root= a directory with at least {_VAL_EVERY} .py files")
    buffer = bytearray()
    for rel in files:
        if len(buffer) >= max_bytes:
            break
        buffer += (base / rel).read_bytes()
        buffer += _FILE_SEPARATOR
    del buffer[max_bytes:]
    # frombuffer shares the bytearray's memory (no copy); the bytearray stays alive through it.
    return torch.frombuffer(buffer, dtype=torch.uint8)


class ByteBlockDataset(torch.utils.data.Dataset):
    """Non-overlapping blocks of a byte tensor, as language-model samples.

    Sample ``i`` is bytes ``[i * block_size, (i + 1) * block_size)``; a trailing partial block is
    dropped. ``input_ids`` and ``labels`` are the same bytes (separate tensors): the model shifts
    the labels, so each block trains ``block_size - 1`` predictions.

    ``__getitems__(indices)`` returns the whole batch at once, already stacked, with one tensor
    index; torch's ``DataLoader`` calls it and hands the result to ``collate_fn``, so pass
    ``collate_fn=collate`` (:func:`collate` passes the stacked dict through).

    Args:
        data: 1-D tensor of byte values (``uint8``, or any integer dtype with values < 256).
        block_size: Bytes per sample, at most the model's ``GPTConfig.block_size``.

    Example:
        >>> ds = ByteBlockDataset(torch.arange(10, dtype=torch.uint8), block_size=4)
        >>> len(ds), ds[1]["input_ids"].tolist()
        (2, [4, 5, 6, 7])
    """

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        if not isinstance(data, torch.Tensor) or data.dim() != 1 or data.is_floating_point():
            raise TypeError("data must be a 1-D integer tensor of byte values, e.g. load_pycode_bytes(...)")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
            raise ValueError(f"block_size must be an integer >= 2 (one input and one target), got {block_size!r}")
        n_blocks = data.numel() // block_size
        if n_blocks == 0:
            raise ValueError(f"{data.numel()} bytes make no block of {block_size}; "
                             "read more bytes (max_bytes) or use a smaller block_size")
        self.block_size = block_size
        self._blocks = data[: n_blocks * block_size].view(n_blocks, block_size)

    def __len__(self) -> int:
        return self._blocks.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        input_ids = self._blocks[index].long()
        return {"input_ids": input_ids, "labels": input_ids.clone()}

    def __getitems__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """The samples at ``indices``, stacked: ``{"input_ids": [n, block_size], "labels": ...}``."""
        input_ids = self._blocks[torch.as_tensor(indices, dtype=torch.long)].long()
        return {"input_ids": input_ids, "labels": input_ids.clone()}


def bits_per_byte(loss_nats: float | torch.Tensor) -> float | torch.Tensor:
    """Convert a per-byte cross-entropy from nats to bits: ``loss / ln 2``.

    Bits per byte is the usual figure for byte-level models; 8 means no better than uniform.

    Example:
        >>> round(bits_per_byte(math.log(256)), 6)
        8.0
    """
    return loss_nats / math.log(2)


def generate_sample(model: nn.Module, prompt: str | bytes = "def ", max_new_tokens: int = 200,
                    temperature: float = 0.8, top_k: int | None = None,
                    generator: torch.Generator | None = None) -> str:
    """Let a byte-level model continue ``prompt`` and return prompt and continuation as text.

    The model runs in eval mode for the sample and is put back in the mode it was in. Bytes that
    are not valid UTF-8 (a multi-byte character cut or invented) decode as U+FFFD.

    Args:
        model: A model with ``generate(input_ids, max_new_tokens, temperature, top_k, generator)``,
            such as :class:`~mixprec.tasks.gpt.GPT`, over a 256-byte vocabulary.
        prompt: Text (encoded as UTF-8) or bytes to start from; at least one byte.
        max_new_tokens: Bytes to generate.
        temperature: Sampling temperature; ``0`` is greedy.
        top_k: Sample only among the ``top_k`` most likely bytes.
        generator: Random generator on the model's device, for a reproducible sample.

    Example:
        >>> from mixprec.tasks.gpt import GPT
        >>> text = generate_sample(GPT(PYCODE_SIZES["tiny"]), "import ", max_new_tokens=8)
        >>> text.startswith("import ")
        True
    """
    prompt_bytes = prompt.encode("utf-8") if isinstance(prompt, str) else bytes(prompt)
    if not prompt_bytes:
        raise ValueError("prompt must have at least one byte, e.g. 'def ' or '\\n'")
    device = next(model.parameters()).device
    input_ids = torch.tensor([list(prompt_bytes)], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        ids = model.generate(input_ids, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator)
    finally:
        model.train(was_training)
    return bytes(ids[0].clamp(0, 255).tolist()).decode("utf-8", errors="replace")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {list(SPLITS)}")


def pycode_task(size: str = "mini", *, max_bytes: int = DEFAULT_MAX_BYTES, eval_max_bytes: int = DEFAULT_EVAL_MAX_BYTES,
                root: str | os.PathLike[str] | None = None) -> Task:
    """The pycode :class:`Task`: a byte-level GPT of ``size`` on the standard library's source.

    Reached through ``get_task("pycode", size, ...)``, which checks the options first.

    Args:
        size: A key of :data:`PYCODE_SIZES`.
        max_bytes: Bytes of training text read.
        eval_max_bytes: Bytes of validation text read.
        root: A directory of ``.py`` files to read instead of the standard library.
    """
    config = PYCODE_SIZES[size]
    train = load_pycode_bytes("train", max_bytes, root)
    val = load_pycode_bytes("validation", eval_max_bytes, root)
    return Task(
        name=f"pycode/{size}",
        build_model=functools.partial(GPT, config),
        train_dataset=ByteBlockDataset(train, config.block_size),
        eval_dataset=ByteBlockDataset(val, config.block_size),
        compute_metrics=_pycode_metrics,
        metric_name="bits_per_byte",
        greater_is_better=False,
        preprocess_logits_for_metrics=_token_nll,
        description=(f"byte-level GPT ({config.n_layer} layers, width {config.n_embd}, context "
                     f"{config.block_size}) on {train.numel():,} bytes of Python stdlib source"),
    )


def _token_nll(logits: torch.Tensor | tuple[torch.Tensor, ...], labels: torch.Tensor) -> torch.Tensor:
    """Per-position next-byte cross-entropy ``[batch, time - 1]`` (0 where the label is -100)."""
    if isinstance(logits, tuple):  # Hugging Face passes a tuple when a model returns more outputs.
        logits = logits[0]
    return F.cross_entropy(logits[:, :-1].float().transpose(1, 2), labels[:, 1:].long(),
                           ignore_index=-100, reduction="none")


def _pycode_metrics(eval_pred: Any) -> dict[str, float]:
    """Mean next-byte loss (nats) and bits per byte, from per-token losses or from raw logits."""
    predictions = eval_pred.predictions
    predictions = predictions[0] if isinstance(predictions, tuple) else predictions
    labels = torch.as_tensor(np.asarray(eval_pred.label_ids))
    values = torch.as_tensor(np.asarray(predictions))
    # Without the preprocess hook the trainer keeps raw logits [n, time, vocab]; reduce them here.
    nll = _token_nll(values, labels) if values.dim() == 3 else values.float()
    mask = labels[:, 1:] != -100
    loss = float(nll[mask].sum() / mask.sum().clamp(min=1))
    return {"loss": loss, "bits_per_byte": float(bits_per_byte(loss))}
