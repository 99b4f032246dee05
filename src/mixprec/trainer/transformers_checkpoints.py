"""Checkpoints both ways between transformers' Trainer and mixprec's: a run moves from one to the other mid-way.

Read: a ``checkpoint-N`` folder transformers' Trainer wrote (no mixprec manifest) resumes a mixprec
run. The weights (``model.safetensors``, sharded ``model-*-of-*.safetensors`` with their index, or
``pytorch_model.bin``), ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt`` and ``rng_state.pth`` are
read as transformers reads them, with safetensors or ``torch.load(weights_only=True)``: nothing in
them runs. ``trainer_state.json`` gives the step, the epoch, the logs and the best metric, and the
run skips the batches of the current epoch already trained on, as transformers does. Without a
manifest nothing can be verified: the resume says so in a log line.

Written: what transformers' Trainer reads beside mixprec's own files (:func:`transformers_rng_files`:
``rng_state.pth``, one per process under torchrun); the rest (weights, ``optimizer.pt`` and
``scheduler.pt``, trainer state) are in :mod:`mixprec.trainer.checkpoints`.

The optimizer's parameter groups: both Trainers make the same two (weight decay, and none on
biases and norms), so ``optimizer.pt`` is one file for both. An optimizer of another layout (one
group, passed through ``optimizers=``) takes transformers' two-group state by parameter name
(:func:`regroup_optimizer_state`), and the schedule's per-group lists with it
(:func:`regroup_scheduler_state`).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from mixprec.checkpoint.folder import MANIFEST, load_tensor_file
from mixprec.checkpoint.transformers_rng import (
    read_transformers_rng,
    transformers_rng_name,
    transformers_rng_state,
)
from mixprec.checkpoint.weights import WEIGHTS_NAMES, load_model_weights
from mixprec.distributed import groups as D
from mixprec.trainer.adapters import adapter_weight_files, is_peft_model, load_adapter_weights
from mixprec.trainer.callbacks import log
from mixprec.trainer.schedules import decay_parameter_names

__all__ = ["is_transformers_checkpoint", "load_transformers_checkpoint", "loss_total_from_history",
           "regroup_optimizer_state", "regroup_scheduler_state", "report_weights_load", "transformers_rng_files"]


def is_transformers_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a checkpoint folder another trainer (transformers') wrote: no mixprec
    manifest, a ``trainer_state.json`` (transformers writes it last, so a save it finished) and
    the model's weights under one of Hugging Face's names (a peft model's adapter under peft's)."""
    path = Path(path)
    return (path.is_dir() and not (path / MANIFEST).exists() and (path / "trainer_state.json").is_file()
            and (any((path / name).is_file() for name in WEIGHTS_NAMES) or bool(adapter_weight_files(path))))


def report_weights_load(path: Path, missing: list[str], unexpected: list[str]) -> None:
    """Warn, as transformers does, about the model's keys the files lacked and the files' extra keys."""
    if missing:
        log.warning("mixprec: there were missing keys in the checkpoint model loaded from %s: %s", path, missing)
    if unexpected:
        log.warning("mixprec: there were unexpected keys in the checkpoint model loaded from %s: %s", path, unexpected)


def load_transformers_checkpoint(path: Path, *, accelerator: Any, model: torch.nn.Module, optimizer: Any,
                                 lr_scheduler: Any) -> dict[str, Any] | None:
    """Restore ``model``, ``optimizer``, ``lr_scheduler`` and the loss scaler from a folder
    transformers' Trainer wrote; returns this process's random state from ``rng_state.pth`` (to be
    set when the loop starts, as transformers sets it), or ``None`` where there is none.

    A missing ``optimizer.pt`` / ``scheduler.pt`` (``save_only_model=True``) leaves a fresh optimizer
    and schedule, with a warning; transformers loads them only as a pair, and so does this.

    Raises:
        CheckpointError: a ``.pt`` / ``.pth`` / ``.bin`` file holding anything but tensors and plain
            values (a pickle that would run code is refused before it runs).
    """
    path = Path(path)
    log.warning("mixprec: %s was written by another trainer (transformers'): it has no mixprec %s, so its files "
                "cannot be verified; reading them as tensors only (safetensors, torch.load(weights_only=True))",
                path, MANIFEST)
    device = accelerator.device
    inner = accelerator.unwrap_model(model, keep_torch_compile=False)
    if is_peft_model(inner) and adapter_weight_files(path):  # a peft model's checkpoint holds its adapter
        load_adapter_weights(inner, path)
    else:
        report_weights_load(path, *load_model_weights(inner, path, device=device))
    if (path / "optimizer.pt").is_file() and (path / "scheduler.pt").is_file():
        saved = load_tensor_file(path / "optimizer.pt", map_location=device)
        schedule = load_tensor_file(path / "scheduler.pt")
        ours, theirs = _group_names(optimizer, inner), _transformers_groups(inner)
        if _sizes(saved) != [len(g) for g in ours] and _sizes(saved) == [len(g) for g in theirs]:
            # transformers' two groups into mixprec's one
            saved, schedule = regroup_optimizer_state(saved, theirs, ours), regroup_scheduler_state(schedule, theirs, ours)
        optimizer.load_state_dict(saved)
        lr_scheduler.load_state_dict(schedule)
    else:
        log.warning("mixprec: %s holds no optimizer.pt and scheduler.pt (saved with save_only_model?): the "
                    "optimizer and the learning-rate schedule start afresh", path)
    if (path / "scaler.pt").is_file():
        if accelerator.scaler is not None:
            accelerator.precision.load_state_dict(load_tensor_file(path / "scaler.pt"))
        else:
            log.info("mixprec: %s holds a scaler.pt; %s has no loss scaler, so it is not read", path,
                     accelerator.policy.name)
    rng = path / transformers_rng_name(accelerator.process_index, accelerator.num_processes)
    if not rng.is_file():
        log.info("mixprec: %s has no %s: the random state is not restored, so random numbers (dropout) differ from "
                 "an uninterrupted run's", path, rng.name)
        return None
    return read_transformers_rng(rng)


def loss_total_from_history(log_history: list[dict[str, Any]], global_step: int) -> float:
    """The sum of the training losses of the first ``global_step`` steps, from the logged means
    (each ``loss`` row times the steps since the previous one): what ``train_loss`` averages at
    the end. Steps after the last log before the checkpoint are not in it (transformers' own
    resume drops them too)."""
    total, previous = 0.0, 0
    for row in log_history:
        if "loss" in row and "step" in row and previous < row["step"] <= global_step:
            total += float(row["loss"]) * (row["step"] - previous)
            previous = row["step"]
    return total


def transformers_rng_files(rank: int, world_size: int) -> dict[str, bytes]:
    """Every process's random state in transformers' format, by file name (``rng_state.pth``; under
    torchrun ``rng_state_<rank>.pth`` each), on every process; a collective where there are several."""
    buf = io.BytesIO()
    torch.save(transformers_rng_state(distributed=world_size > 1), buf)
    states = D.all_gather_object(buf.getvalue()) if world_size > 1 else [buf.getvalue()]
    return {transformers_rng_name(r, world_size): data for r, data in enumerate(states)}


def _sizes(state: dict[str, Any]) -> list[int]:
    return [len(g["params"]) for g in state["param_groups"]]


def _group_names(optimizer: Any, model: torch.nn.Module) -> list[list[str]]:
    """The names of the parameters in each of ``optimizer``'s groups (``""`` for one ``model`` lacks)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [[name_of.get(id(p), "") for p in g["params"]] for g in optimizer.param_groups]


def _transformers_groups(model: torch.nn.Module) -> list[list[str]]:
    """The parameter groups transformers' Trainer builds for ``model``: those weight decay applies
    to, then the rest (biases, norms), trainable ones only, in the model's order."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    decay = set(decay_parameter_names(model))
    return [[n for n in names if n in decay], [n for n in names if n not in decay]]


def regroup_optimizer_state(state: dict[str, Any], source: list[list[str]], target: list[list[str]]) -> dict[str, Any]:
    """An optimizer's ``state_dict`` whose groups hold the parameters ``source`` names, laid out in
    ``target``'s groups (the same parameters, grouped otherwise): each parameter keeps its state;
    a group takes the settings (``lr``, ``weight_decay``, ...) of the source group of its first
    parameter. No tensor is copied.

    Example:
        >>> state = {"state": {0: "a", 1: "b"}, "param_groups": [{"lr": 1, "params": [0]}, {"lr": 1, "params": [1]}]}
        >>> regroup_optimizer_state(state, [["w"], ["b"]], [["w", "b"]])["param_groups"]
        [{'lr': 1, 'params': [0, 1]}]
    """
    flat = [n for group in source for n in group]
    group_of = {n: i for i, group in enumerate(source) for n in group}
    by_name = {flat[i]: s for i, s in state["state"].items()}
    new_state: dict[int, Any] = {}
    groups = []
    for names in target:
        settings = state["param_groups"][group_of[names[0]] if names else 0]
        start = sum(len(g["params"]) for g in groups)
        ids = list(range(start, start + len(names)))
        groups.append({**{k: v for k, v in settings.items() if k != "params"}, "params": ids})
        new_state.update({i: by_name[n] for i, n in zip(ids, names) if n in by_name})
    return {"state": new_state, "param_groups": groups}


def regroup_scheduler_state(state: dict[str, Any], source: list[list[str]], target: list[list[str]]) -> dict[str, Any]:
    """A scheduler's ``state_dict`` for the optimizer regrouped by :func:`regroup_optimizer_state`:
    each per-group list (``base_lrs``, ``_last_lr``, ``lr_lambdas``, ``min_lrs``...) gets one entry
    per ``target`` group, the source group's of its first parameter."""
    group_of = {n: i for i, group in enumerate(source) for n in group}
    pick = [group_of[names[0]] if names else 0 for names in target]
    return {k: [v[i] for i in pick] if isinstance(v, list) and len(v) == len(source) else v for k, v in state.items()}
