"""Models wrapped by peft (LoRA and the other adapters) in the Trainer, as transformers' Trainer treats them.

A ``PeftModel``'s ``forward`` takes ``**kwargs``, so its columns and label names are read from the
model it wraps (:func:`model_to_inspect`). Its checkpoints hold the adapter alone, as
transformers writes them: ``adapter_model.safetensors`` and ``adapter_config.json`` (other
adapters than ``default`` in a folder of their name), written by the model's ``save_pretrained``
through the Accelerator's save hook (:func:`checkpoint_adapters`), so the frozen base is not
copied into every checkpoint. Resuming, ``load_best_model_at_end`` and folders transformers' Trainer
wrote load them back into the adapters in place (:func:`load_adapter_weights`): the parameters the
optimizer holds keep their identity and their dtype (peft's ``load_adapter`` would cast a bf16
adapter back to fp32, under bf16-true's optimizer). peft is never imported here unless the
caller already has: a model cannot be a ``PeftModel`` otherwise.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from mixprec.checkpoint.folder import MANIFEST, CheckpointError, CheckpointReader, load_tensor_file
from mixprec.trainer.callbacks import log

__all__ = ["ADAPTER_WEIGHTS_NAMES", "adapter_weight_files", "checkpoint_adapters", "is_peft_model",
           "load_adapter_weights", "model_to_inspect", "save_adapter"]

#: peft's names for an adapter's weights (``save_pretrained`` with and without safetensors).
ADAPTER_WEIGHTS_NAMES = ("adapter_model.safetensors", "adapter_model.bin")


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` or ``PeftMixedModel`` (transformers' ``_is_peft_model``)."""
    peft = sys.modules.get("peft")  # a model made by peft means peft is imported already
    if peft is None:
        return False
    return isinstance(model, tuple(c for c in (getattr(peft, "PeftModel", None), getattr(peft, "PeftMixedModel", None))
                                   if c is not None))


def model_to_inspect(model: Any) -> Any:
    """The model whose ``forward`` names the dataset columns and labels: a peft model's base model
    (its own ``forward`` takes ``**kwargs``), else ``model`` itself, as transformers reads them."""
    if not is_peft_model(model):
        return model
    return model.get_base_model() if hasattr(model, "get_base_model") else model.base_model.model


def save_adapter(model: Any, folder: str | Path, safe_serialization: bool = True) -> None:
    """The adapter(s) of peft model ``model`` into ``folder`` (``save_pretrained``: the weights, the
    config and peft's model card; an adapter other than ``default`` in ``folder/<its name>``)."""
    model.save_pretrained(str(folder), safe_serialization=safe_serialization)


def adapter_weight_files(folder: str | Path, active: str = "default") -> dict[str, str]:
    """The adapter weights file in ``folder`` for each adapter name, relative to it, found as
    transformers finds them: one in a subfolder is the adapter of that name; one in ``folder``
    itself is ``default`` beside subfolders, else ``active`` (the model's active adapter)."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}

    def weights_in(d: Path) -> str | None:
        return next((name for name in ADAPTER_WEIGHTS_NAMES if (d / name).is_file()), None)

    found = {sub.name: f"{sub.name}/{name}" for sub in sorted(folder.iterdir())
             if sub.is_dir() and (name := weights_in(sub)) is not None}
    if (name := weights_in(folder)) is not None:
        found["default" if found else active] = name
    return found


def load_adapter_weights(model: Any, folder: str | Path, *, verified: bool = False) -> None:
    """Load the adapter weights of checkpoint ``folder`` into peft model ``model``, in place.

    In a mixprec checkpoint each file must be in the manifest and is checked against it (size and
    sha256) before it is read, unless ``verified`` (the Accelerator's ``load_state`` verified every
    file before its load hooks ran); a folder transformers' Trainer wrote has no manifest: read as
    tensors only, with a log line. An adapter the model lacks is added as transformers adds it
    (``load_adapter``; trainable if it is the active one).

    Raises:
        FileNotFoundError: ``folder`` holds no adapter weights.
        CheckpointError: a file that is not the one the manifest lists, or a ``.bin`` holding more than tensors.
    """
    folder = Path(folder)
    active = _active_adapter(model)
    files = adapter_weight_files(folder, active)
    if not files:
        raise FileNotFoundError(f"{folder} holds no adapter weights ({' or '.join(ADAPTER_WEIGHTS_NAMES)}): it was "
                                "not saved from a peft model; load it into the model it was saved from")
    if (folder / MANIFEST).is_file():
        reader = CheckpointReader(folder)
        if verified:
            unlisted = [rel for rel in files.values() if rel not in reader.files]
            if unlisted:
                raise CheckpointError(f"{folder / unlisted[0]} is not listed in {folder / MANIFEST}: it was added "
                                      "after the checkpoint was written; load an earlier checkpoint, or restore this "
                                      "folder from a copy")
        else:
            reader.check(list(files.values()))
            reader.verify()
    else:
        log.warning("mixprec: %s has no mixprec %s (written by another trainer): its adapter weights cannot be "
                    "verified; reading them as tensors only", folder, MANIFEST)
    from peft import set_peft_model_state_dict

    added = False
    for name, rel in files.items():
        if name not in model.peft_config:
            model.load_adapter(str((folder / rel).parent), name, is_trainable=name == active)
            added = True
            continue
        path = folder / rel
        state = (safetensors.torch.load_file(str(path)) if path.suffix == ".safetensors"
                 else load_tensor_file(path))
        result = set_peft_model_state_dict(model, state, adapter_name=name)
        missing = [k for k in result.missing_keys if name in k]
        if missing or result.unexpected_keys:
            log.warning("mixprec: the adapter %r loaded from %s: missing keys %s, unexpected keys %s", name, path,
                        missing, result.unexpected_keys)
    if added:
        model.set_adapter(active)


def _active_adapter(model: Any) -> str:
    active = getattr(model, "active_adapters", None)
    if active:
        if len(active) > 1:
            log.warning("mixprec: several active adapters (%s): the first, %r, takes the checkpoint's top-level "
                        "adapter weights, as transformers does", ", ".join(active), active[0])
        return active[0]
    return getattr(model, "active_adapter", "default")


def checkpoint_adapters(accelerator: Any, model: Any, safe_serialization: Callable[[], bool]) -> list[Any]:
    """Where ``model`` is a peft model, make ``accelerator``'s checkpoints hold each prepared peft
    model's adapter instead of its whole state (the frozen base is not copied into every
    checkpoint), through Accelerate's save and load pre-hooks; returns their handles (none for
    another model). ``safe_serialization()`` says, at each save, whether the adapter is written as
    safetensors (``TrainingArguments.save_safetensors``).

    Register it before any other hook: it finds a model's state dict in ``weights`` by its index.
    A checkpoint without adapter files (written before, with the model's whole state) loads as
    any other.
    """
    if not is_peft_model(accelerator.unwrap_model(model, keep_torch_compile=False)):
        return []

    def unwrapped(m: Any) -> Any:
        return accelerator.unwrap_model(m, keep_torch_compile=False)

    def save(models: list[Any], weights: list[dict[str, torch.Tensor]], output_dir: str) -> None:
        for i in reversed(range(len(models))):
            if is_peft_model(inner := unwrapped(models[i])):
                if accelerator.is_main_process:
                    save_adapter(inner, output_dir, safe_serialization())
                weights.pop(i)

    def load(models: list[Any], input_dir: str) -> None:
        for i in reversed(range(len(models))):
            if is_peft_model(inner := unwrapped(models[i])) and adapter_weight_files(input_dir, _active_adapter(inner)):
                load_adapter_weights(inner, input_dir, verified=True)
                models.pop(i)

    return [accelerator.register_save_state_pre_hook(save), accelerator.register_load_state_pre_hook(load)]
