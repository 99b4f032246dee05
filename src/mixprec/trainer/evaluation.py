"""The evaluation loop: losses, predictions and labels gathered across processes, then metrics."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from mixprec.models import call_model, extract_logits, extract_loss
from mixprec.nested import tree_leaves, tree_map

__all__ = ["EvalLoopOutput", "EvalPrediction", "PredictionOutput", "evaluation_loop", "nested_concat", "predict_batch", "to_numpy"]


class EvalPrediction:
    """What ``compute_metrics`` receives: numpy ``predictions`` and ``label_ids`` and, with
    ``include_for_metrics``, the model's main ``inputs`` and the per-sample ``losses``.

    Unpacks and indexes as transformers' does: ``predictions, label_ids = p`` (``inputs`` and
    ``losses`` follow only where they were asked for).
    """

    def __init__(self, predictions: Any, label_ids: Any, inputs: Any = None, losses: Any = None) -> None:
        self.predictions, self.label_ids, self.inputs, self.losses = predictions, label_ids, inputs, losses
        self.elements = (predictions, label_ids, *(x for x in (inputs, losses) if x is not None))

    def __iter__(self) -> Any:
        return iter(self.elements)

    def __getitem__(self, index: int) -> Any:
        return self.elements[index]


class PredictionOutput(NamedTuple):
    """What ``Trainer.predict`` returns: numpy predictions, labels (where present) and metrics."""

    predictions: Any
    label_ids: Any
    metrics: dict[str, float]


class EvalLoopOutput(NamedTuple):
    """What ``Trainer.evaluation_loop`` returns: :class:`PredictionOutput`'s fields and the number
    of samples evaluated (over all processes, duplicates of the last uneven round dropped)."""

    predictions: Any
    label_ids: Any
    metrics: dict[str, float]
    num_samples: int


class Evaluated(Protocol):
    """What the loop reads of the Trainer (its public attributes, so this module needs no Trainer)."""

    accelerator: Any
    model: torch.nn.Module
    model_wrapped: torch.nn.Module
    label_names: list[str]
    compute_metrics: Callable[[EvalPrediction], dict[str, float]] | None
    gather_function: Callable[[Any], Any]
    preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None

    def prediction_step(self, model: torch.nn.Module, inputs: Any, prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]: ...

    def compute_loss(self, model: torch.nn.Module, inputs: Any, return_outputs: bool = False) -> Any: ...


def predict_batch(trainer: Evaluated, model: torch.nn.Module, inputs: Any, prediction_loss_only: bool,
                  ignore_keys: list[str] | None) -> tuple[Any, Any, Any]:
    """``(loss, logits, labels)`` of one batch, without gradients (``Trainer.prediction_step``'s work).

    A batch with its labels is scored by ``trainer.compute_loss``, as transformers scores it (a
    subclass's loss, ``compute_loss_func`` and label smoothing count in evaluation too); any other
    batch by the loss the model returns, if it returns one."""
    labels = _labels(inputs, trainer.label_names)
    with torch.no_grad():
        if labels is not None:
            loss, outputs = trainer.compute_loss(model, inputs, return_outputs=True)
        else:
            outputs = call_model(model, inputs, trainer.model)
            loss = extract_loss(outputs)
    loss = loss.detach().mean() if loss is not None else None
    if prediction_loss_only:
        return loss, None, None
    return loss, extract_logits(outputs, ignore_keys or []), labels


def evaluation_loop(trainer: Evaluated, dl: Any, ignore_keys: list[str] | None, prefix: str, *,
                    on_step: Callable[[], Any] | None = None, prediction_loss_only: bool = False,
                    batch_metrics: bool = False, concat_batches: bool = True,
                    include: tuple[str, ...] = ()) -> EvalLoopOutput:
    """Run ``dl`` through ``trainer.prediction_step`` batch by batch; metrics are named ``{prefix}_...``.
    Predictions, labels and inputs are gathered across processes by ``trainer.gather_function``
    (``gather_for_metrics``, with ``eval_use_gather_object``), as transformers gathers them.

    Args:
        on_step: called after each batch (the Trainer's ``on_prediction_step`` event).
        prediction_loss_only: keep only the loss (no predictions, labels or ``compute_metrics``).
        batch_metrics: call ``compute_metrics(EvalPrediction(logits, labels), compute_result=...)``
            on each batch's (gathered, on-device) tensors, ``compute_result=True`` on the last
            one, whose return is the metrics (Hugging Face's ``batch_eval_metrics``).
        concat_batches: join the batches' predictions and labels into one array each; ``False``:
            a list with one array per batch (``eval_do_concat_batches``).
        include: ``"inputs"`` (the model's main input) and/or ``"loss"`` (per-sample losses), also
            passed to ``compute_metrics`` (``include_for_metrics``).
    """
    acc, model = trainer.accelerator, trainer.model_wrapped
    was_training = model.training
    model.eval()
    if callable(getattr(trainer.optimizer, "eval", None)):  # schedule-free: evaluate at the averaged weights
        trainer.optimizer.eval()
    losses, preds, labels, seen_inputs = [], [], [], []
    main_input = getattr(trainer.model, "main_input_name", "input_ids")

    gather = trainer.gather_function
    batch_result: dict[str, float] | None = None
    start, n, batches = time.time(), 0, 0
    for inputs in dl:
        # Asked of the loader, which knows it when it yields the batch; not by looking one batch ahead:
        # gather_for_metrics reads the loader's state, which must be this batch's.
        last = _is_last(dl, batches)
        loss, logits, label = trainer.prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        bs = _batch_size(inputs)
        if loss is not None:
            losses.append(acc.gather_for_metrics(loss.float().reshape(1).repeat(bs)).cpu())
        if not prediction_loss_only:
            if logits is not None and trainer.preprocess_logits_for_metrics is not None:
                logits = trainer.preprocess_logits_for_metrics(logits, label)
            logits = gather(logits) if logits is not None else None
            label = gather(label) if label is not None else None
            if "inputs" in include and isinstance(inputs, Mapping) and main_input in inputs:
                seen_inputs.append(_cpu(gather(inputs[main_input])))
            if batch_metrics and trainer.compute_metrics is not None and logits is not None and label is not None:
                batch_result = trainer.compute_metrics(EvalPrediction(logits, label), compute_result=last)
            if logits is not None:
                preds.append(_cpu(logits))
            if label is not None:
                labels.append(_cpu(label))
        n += bs
        batches += 1
        if on_step is not None:
            on_step()
    model.train(was_training)
    join = nested_concat if concat_batches else list
    predictions = to_numpy(join(preds)) if preds else None
    label_ids = to_numpy(join(labels)) if labels else None
    extra = {"inputs": to_numpy(join(seen_inputs)) if seen_inputs else None,
             "losses": to_numpy(join(losses)) if "loss" in include and losses else None}
    metrics: dict[str, float] = {}
    if losses:
        metrics[f"{prefix}_loss"] = float(torch.cat(losses).mean())
    found = batch_result if batch_metrics else (
        trainer.compute_metrics(EvalPrediction(predictions, label_ids, **extra))
        if trainer.compute_metrics is not None and predictions is not None and label_ids is not None else None)
    for k, v in (found or {}).items():
        metrics[k if k.startswith(f"{prefix}_") else f"{prefix}_{k}"] = float(v)
    runtime = time.time() - start
    metrics.update({f"{prefix}_runtime": round(runtime, 4),
                    f"{prefix}_samples_per_second": round(n * acc.num_processes / max(runtime, 1e-9), 3),
                    f"{prefix}_steps_per_second": round(batches / max(runtime, 1e-9), 3)})
    if getattr(trainer, "model_preparation_time", None) is not None:  # transformers reports it with each evaluation
        metrics[f"{prefix}_model_preparation_time"] = trainer.model_preparation_time
    n_gathered = sum(len(x) for x in losses) if losses else n * acc.num_processes
    return EvalLoopOutput(predictions, label_ids, metrics, n_gathered)


def _is_last(dl: Any, index: int) -> bool:
    """Whether the batch ``dl`` just yielded (the ``index``-th) is its last: a prepared loader's
    ``end_of_dataloader``, else by its length (``False`` where it has none)."""
    end = getattr(dl, "end_of_dataloader", None)
    if end is not None:
        return bool(end)
    try:
        return index == len(dl) - 1
    except TypeError:
        return False


def _batch_size(inputs: Any) -> int:
    """The length of the batch's first tensor with a dimension (1 when it has none)."""
    return next((len(t) for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.dim() > 0), 1)


def _labels(inputs: Any, names: list[str]) -> Any:
    if not isinstance(inputs, Mapping) or not all(k in inputs for k in names):  # BatchEncoding is a UserDict
        return None
    found = tuple(inputs[k] for k in names)
    return found[0] if len(found) == 1 else found


def _cpu(x: Any) -> Any:
    return tree_map(lambda t: t.detach().cpu(), x)


def _pad_cat(parts: list[torch.Tensor], pad: int = -100) -> torch.Tensor:
    if all(p.shape[1:] == parts[0].shape[1:] for p in parts):
        return torch.cat(parts)
    # Variable sequence lengths across batches: pad as Hugging Face does, with -100.
    dims = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
    out = parts[0].new_full((sum(len(p) for p in parts), *dims), pad)
    row = 0
    for p in parts:
        out[(slice(row, row + len(p)), *[slice(0, s) for s in p.shape[1:]])] = p
        row += len(p)
    return out


def nested_concat(parts: list[Any]) -> Any:
    """Concatenate per-batch tensors (or containers of them, all of one structure) along dim 0."""
    return tree_map(lambda *xs: _pad_cat(list(xs)), parts[0], *parts[1:])


def _numpy(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return np.asarray(x)
    return (x.float() if x.is_floating_point() and x.dtype != torch.float64 else x).numpy()


def to_numpy(x: Any) -> Any:
    """Tensors (or containers of them) as numpy arrays; bf16/fp16 become float32."""
    return tree_map(_numpy, x)
