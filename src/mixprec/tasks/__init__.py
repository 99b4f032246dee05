"""Built-in training tasks: a model, its data and a metric, with nothing downloaded at run time.

``get_task("pycode", "mini")`` is a byte-level GPT on the Python standard library's source;
``get_task("digits", arch="cnn")`` is scikit-learn's bundled handwritten digits. A user's own
task comes from ``load_factory("package.module:factory")``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mixprec.data import collate
from mixprec.tasks._output import CausalLMOutput, ClassifierOutput, ModelOutput
from mixprec.tasks.digits import DigitsCNN, DigitsDataset, DigitsMLP, accuracy
from mixprec.tasks.gpt import GPT, GPTConfig
from mixprec.tasks.pycode import (
    DEFAULT_EVAL_MAX_BYTES,
    DEFAULT_MAX_BYTES,
    PYCODE_SIZES,
    ByteBlockDataset,
    bits_per_byte,
    generate_sample,
    load_pycode_bytes,
)

__all__ = [
    "Task",
    "get_task",
    "list_tasks",
    "load_factory",
    "GPT",
    "GPTConfig",
    "PYCODE_SIZES",
    "ByteBlockDataset",
    "DigitsDataset",
    "DigitsMLP",
    "DigitsCNN",
    "ModelOutput",
    "CausalLMOutput",
    "ClassifierOutput",
    "collate",
    "accuracy",
    "bits_per_byte",
    "generate_sample",
]

_DIGITS_ARCHS: dict[str, Callable[[], nn.Module]] = {"mlp": DigitsMLP, "cnn": DigitsCNN}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Task:
    """A model, its data and its metric, ready for a Trainer.

    The fields mirror what Hugging Face's ``Trainer`` takes, so a task plugs into either trainer:
    ``compute_metrics`` receives an object with ``.predictions`` and ``.label_ids`` numpy arrays
    (an ``EvalPrediction``), after ``preprocess_logits_for_metrics(logits, labels)`` (when set)
    has reduced each batch's logits on the device.

    Args:
        name: The task's name, with its size (``"pycode/mini"``).
        build_model: Builds a freshly initialised model (seed torch first for a fixed init).
        train_dataset: Training samples.
        eval_dataset: Held-out samples.
        collate_fn: The DataLoader's ``collate_fn`` for both datasets.
        compute_metrics: ``EvalPrediction -> {metric: float}``.
        metric_name: The key of ``compute_metrics``'s result that ranks checkpoints.
        greater_is_better: Whether a larger ``metric_name`` is better.
        preprocess_logits_for_metrics: Optional ``(logits, labels) -> tensor`` kept instead of
            the logits, so evaluation does not hold every batch's logits in memory.
        description: One line for humans.

    Example:
        >>> task = get_task("digits")
        >>> task.metric_name, task.greater_is_better
        ('accuracy', True)
    """

    name: str
    build_model: Callable[[], nn.Module]
    train_dataset: torch.utils.data.Dataset
    eval_dataset: torch.utils.data.Dataset
    collate_fn: Callable[[Any], Any] = collate
    compute_metrics: Callable[[Any], dict[str, float]]
    metric_name: str
    greater_is_better: bool
    preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    description: str = ""

    def __post_init__(self) -> None:
        for field in ("build_model", "collate_fn", "compute_metrics"):
            if not callable(getattr(self, field)):
                raise TypeError(f"Task.{field} must be callable, got {type(getattr(self, field)).__name__}")
        if self.preprocess_logits_for_metrics is not None and not callable(self.preprocess_logits_for_metrics):
            raise TypeError("Task.preprocess_logits_for_metrics must be callable or None")
        if not self.metric_name:
            raise ValueError("Task.metric_name must name a key returned by compute_metrics, e.g. 'accuracy'")


def list_tasks() -> dict[str, list[str]]:
    """The built-in task names and, for each, its sizes (empty when it has none).

    Example:
        >>> list_tasks()
        {'pycode': ['tiny', 'mini', 'small'], 'digits': []}
    """
    return {"pycode": list(PYCODE_SIZES), "digits": []}


def get_task(name: str, size: str | None = None, **options: Any) -> Task:
    """Build a built-in task.

    Args:
        name: ``"pycode"`` or ``"digits"``.
        size: For ``pycode``, ``"tiny"`` (tests), ``"mini"`` (default, CPU demo) or ``"small"``;
            ``digits`` has no sizes.
        **options: For ``pycode``: ``max_bytes`` and ``eval_max_bytes`` (bytes of text read per
            split), ``root`` (a directory of ``.py`` files instead of the standard library).
            For ``digits``: ``arch`` (``"mlp"`` or ``"cnn"``) and ``seed`` (of the split).

    Example:
        >>> task = get_task("pycode", "tiny", max_bytes=20_000, eval_max_bytes=5_000)
        >>> task.name, len(task.train_dataset)
        ('pycode/tiny', 312)
    """
    if name == "pycode":
        return _pycode_task(size, **options)
    if name == "digits":
        if size is not None:
            raise ValueError(f"the digits task has no sizes, got size={size!r}; leave size out and choose the "
                             f"model with arch= one of {list(_DIGITS_ARCHS)}")
        return _digits_task(**options)
    raise ValueError(f"unknown task {name!r}; the built-in tasks are {list(list_tasks())}, or load your own "
                     "with load_factory('package.module:factory')")


def _check_options(task: str, options: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for the {task} task; the options are {list(allowed)}")


def _pycode_task(size: str | None = None, **options: Any) -> Task:
    _check_options("pycode", options, ("max_bytes", "eval_max_bytes", "root"))
    size = "mini" if size is None else size
    if size not in PYCODE_SIZES:
        raise ValueError(f"unknown pycode size {size!r}; choose one of {list(PYCODE_SIZES)}")
    config = PYCODE_SIZES[size]
    root = options.get("root")
    train = load_pycode_bytes("train", options.get("max_bytes", DEFAULT_MAX_BYTES), root)
    val = load_pycode_bytes("validation", options.get("eval_max_bytes", DEFAULT_EVAL_MAX_BYTES), root)
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


def _digits_task(arch: str = "mlp", seed: int = 0, **options: Any) -> Task:
    _check_options("digits", options, ())
    if arch not in _DIGITS_ARCHS:
        raise ValueError(f"unknown digits arch {arch!r}; choose one of {list(_DIGITS_ARCHS)}")
    image = arch == "cnn"
    return Task(
        name=f"digits/{arch}",
        build_model=_DIGITS_ARCHS[arch],
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


def load_factory(spec: str) -> Callable[..., Any]:
    """Import ``"package.module:factory"`` and return the object it names.

    The attribute may be dotted (``"pkg.mod:Builder.create"``). The module is imported from
    ``sys.path``: for a file in the working directory, run with ``PYTHONPATH=.``.

    Args:
        spec: ``"module:attribute"``.

    Example:
        >>> load_factory("mixprec.tasks:get_task") is get_task
        True
    """
    module_name, sep, attr_path = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or not module_name or not attr_path or ":" in attr_path:
        raise ValueError(f"factory spec {spec!r} must look like 'package.module:factory' (one colon between "
                         "the module path and the name of the factory in it)")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ImportError(f"module {module_name!r} (from factory spec {spec!r}) was not found; check the "
                              "spelling and that it is installed or on PYTHONPATH") from exc
        raise ImportError(f"module {module_name!r} (from factory spec {spec!r}) was found but importing it "
                          f"failed: it needs {exc.name!r}, which is not installed") from exc
    target: Any = module
    for depth, part in enumerate(attr_path.split(".")):
        if not hasattr(target, part):
            owner = ".".join([module_name] + attr_path.split(".")[:depth]) if depth else f"module {module_name!r}"
            raise AttributeError(f"{owner} has no attribute {part!r} (from factory spec {spec!r}); check the name "
                                 "after the colon")
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"{spec!r} names a {type(target).__name__}, not a callable factory")
    return target
