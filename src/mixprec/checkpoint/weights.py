"""A model's weights as Hugging Face's loaders read them: ``model.safetensors`` (or
``pytorch_model.bin``), split above ``max_shard_size`` into numbered shards with an index; each
file written atomically."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import safetensors.torch
import torch

__all__ = ["parse_size", "save_model_weights", "untied"]


def parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", str(size), re.I)
    if not m:
        raise ValueError(f"max_shard_size must be bytes or like '500MB' / '10GB', got {size!r}")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    return int(float(m.group(1)) * scale)


def untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each tied weight once, under its first name, as transformers stores them
    (safetensors keeps no aliases; ``from_pretrained`` and ``safetensors.torch.load_model`` tie
    them again from the model)."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def save_model_weights(model: torch.nn.Module, directory: Path, *, max_shard_size: int | str = "10GB",
                       safe_serialization: bool = True, state: dict[str, torch.Tensor] | None = None) -> None:
    """See :meth:`Accelerator.save_model`: one weights file, or shards with an index, each written
    atomically. ``state`` overrides ``model.state_dict()`` (a sharded model's, gathered)."""
    directory.mkdir(parents=True, exist_ok=True)
    limit = parse_size(max_shard_size)
    state = {k: v.detach().cpu().contiguous() for k, v in (state if state is not None else model.state_dict()).items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in untied(state).items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")

    def write(tensors: dict[str, torch.Tensor], path: Path) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        if safe_serialization:
            safetensors.torch.save_file(tensors, str(tmp), metadata={"format": "pt"})
        else:
            torch.save(tensors, tmp)
        os.replace(tmp, path)

    if len(shards) == 1:
        write(shards[0], directory / f"{stem}.{ext}")
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"{stem}-{i:05d}-of-{len(shards):05d}.{ext}"
        write(shard, directory / fname)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
    index = directory / f"{stem}.{ext}.index.json"
    tmp = index.with_name(f".{index.name}.tmp")
    tmp.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    os.replace(tmp, index)
