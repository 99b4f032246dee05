"""The Trainer's way out: the model's weights and arguments as Hugging Face's Trainer writes them
(``Trainer.save_model`` calls :func:`save_model_files` with what it holds)."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch

from mixprec.trainer.callbacks import log
from mixprec.trainer.checkpoints import MAX_SHARD_SIZE

__all__ = ["args_bin", "save_model_files"]


def save_model_files(accelerator: Any, model: torch.nn.Module, args: Any, processing_class: Any, out: Path) -> Path:
    """Save ``model``'s weights into ``out`` as transformers' Trainer does (a Hugging Face model's
    through ``save_pretrained``: its config, and ``model.safetensors`` or shards with their index
    above its ``max_shard_size``; a plain module's ``model.safetensors``; with
    ``args.save_safetensors=False``, ``pytorch_model.bin``), the arguments (``training_args.json``,
    and ``training_args.bin`` as Hugging Face writes it) and the tokenizer or processor beside
    them. Every process calls it."""
    model = accelerator.unwrap_model(model)
    safe = getattr(args, "save_safetensors", True)
    if hasattr(model, "save_pretrained") and hasattr(model, "config") and safe:
        if accelerator.is_main_process:
            model.save_pretrained(str(out))
        accelerator.wait_for_everyone()
    else:
        accelerator.save_model(model, out, max_shard_size=MAX_SHARD_SIZE, safe_serialization=safe)
        if accelerator.is_main_process and hasattr(getattr(model, "config", None), "save_pretrained"):
            model.config.save_pretrained(str(out))  # from_pretrained(out) loads the .bin with it
    if accelerator.is_main_process:
        args.to_json_file(out / "training_args.json")
        if pickled := args_bin(args):
            (out / "training_args.bin").write_bytes(pickled)
        if hasattr(processing_class, "save_pretrained"):  # the tokenizer beside the model, as in HF
            processing_class.save_pretrained(str(out))
    return out


def args_bin(args: Any) -> bytes:
    """``training_args.bin``: the arguments pickled with ``torch.save``, as Hugging Face writes them
    (for tools that read them back; mixprec itself never unpickles it). ``b""`` where they cannot be."""
    buf = io.BytesIO()
    try:
        torch.save(args, buf)
    except (pickle.PicklingError, AttributeError, TypeError) as e:  # e.g. a subclass defined in a function
        log.warning(f"training_args.bin not written: the arguments cannot be pickled ({e}); "
                    "training_args.json holds them")
        return b""
    return buf.getvalue()
