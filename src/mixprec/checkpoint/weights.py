"""A model's weights as Hugging Face's loaders read them: ``model.safetensors`` (or
``pytorch_model.bin``), split above ``max_shard_size`` into numbered shards with an index; each
file written atomically, and read back (whole or sharded, safetensors or ``torch.load`` with
``weights_only=True``: nothing in them runs)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

import safetensors.torch
import torch

from mixprec.checkpoint.folder import CheckpointError, load_tensor_file

__all__ = ["WEIGHTS_NAMES", "find_weights", "is_weights_file", "load_model_weights", "parse_size", "replacing_weights",
           "save_model_weights", "untied"]

#: The weights files Hugging Face writes, in the order its loaders look for them.
WEIGHTS_NAMES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
# A weights file under one of Hugging Face's names: whole, a shard (model-00001-of-00002.safetensors), an index.
_WEIGHTS_FILE = re.compile(r"(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?")


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


def find_weights(folder: Path) -> list[Path]:
    """The files holding the model's weights in ``folder``, as Hugging Face writes them: the first
    of :data:`WEIGHTS_NAMES` there, an index replaced by the shards it names (each once, in order).

    Raises:
        FileNotFoundError: none of them is there, or an index names a shard that is not.
        ValueError: an index that is not Hugging Face's (no ``weight_map``), or names a file outside ``folder``.
    """
    folder = Path(folder)
    for name in WEIGHTS_NAMES:
        path = folder / name
        if not path.is_file():
            continue
        if not name.endswith(".index.json"):
            return [path]
        weight_map = json.loads(path.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{path} has no 'weight_map': it is not a Hugging Face weights index")
        shards = []
        for shard in dict.fromkeys(weight_map.values()):
            if not isinstance(shard, str) or Path(shard).name != shard:
                raise ValueError(f"{path} names {shard!r}, which is not a file beside it")
            if not (folder / shard).is_file():
                raise FileNotFoundError(f"{folder / shard} is missing: {path} names it")
            shards.append(folder / shard)
        return shards
    raise FileNotFoundError(f"{folder} holds no model weights ({', '.join(WEIGHTS_NAMES)})")


def load_model_weights(model: torch.nn.Module, folder: Path, device: str | torch.device = "cpu") -> tuple[list[str], list[str]]:
    """Load the weights Hugging Face wrote in ``folder`` (:func:`find_weights`) into ``model``, one
    file at a time (a sharded model is never whole in memory twice). Returns the model's keys no
    file held, and the files' keys the model lacks; a tied weight stored once (under the name
    of its first alias) is not missing.

    Raises:
        CheckpointError: a ``.bin`` file that holds anything but tensors.
    """
    expected = model.state_dict()
    loaded: set[str] = set()
    unexpected: list[str] = []
    for path in find_weights(folder):
        if path.suffix == ".safetensors":
            tensors = safetensors.torch.load_file(str(path), device=str(device))
        else:
            tensors = load_tensor_file(path, map_location=device)
        unexpected += [k for k in tensors if k not in expected]
        model.load_state_dict({k: v for k, v in tensors.items() if k in expected}, strict=False)
        loaded.update(k for k in tensors if k in expected)
    stored = {(t.untyped_storage().data_ptr(), t.storage_offset()) for k, t in expected.items() if k in loaded}
    missing = [k for k, t in expected.items() if k not in loaded
               and not (t.numel() and (t.untyped_storage().data_ptr(), t.storage_offset()) in stored)]
    return missing, unexpected


def is_weights_file(name: str) -> bool:
    """Whether ``name`` (a file name, or a path relative to a checkpoint folder) is one of the model's
    weights files under Hugging Face's names: whole, a shard or an index, safetensors or ``.bin``.

    Example:
        >>> [is_weights_file(n) for n in ("model-00001-of-00002.safetensors", "optimizer.pt", "sub/model.safetensors")]
        [True, False, False]
    """
    return _WEIGHTS_FILE.fullmatch(name) is not None


def replacing_weights(folder: str | os.PathLike, listed: Iterable[str]) -> list[Path] | None:
    """The weights files that replaced the ``listed`` ones (the Hugging Face weights files a
    checkpoint's manifest lists) in ``folder``, as :func:`find_weights` finds them.

    The weights were replaced when a listed weights file is gone and a complete set of weights
    that the manifest does not list wholly is there: re-saved by the user, as transformers' tests
    do it (``save_pretrained(folder, max_shard_size=...)`` writes shards and an index, then the
    whole ``model.safetensors`` is deleted), or the other way round, or as ``.bin``. ``None``
    where every listed weights file is there (or none is listed), or where no weights are there
    at all (then the checkpoint is damaged, and the missing file is what to report).

    Raises:
        CheckpointError: a listed file is gone and the weights there are incomplete (an index
            names a shard that is not there) or not Hugging Face's; saying how to fix it.
    """
    folder = Path(folder)
    listed = [name for name in listed if is_weights_file(name)]
    if all((folder / name).is_file() for name in listed):
        return None
    try:
        found = find_weights(folder)
    except FileNotFoundError as e:
        if not any((folder / name).is_file() for name in WEIGHTS_NAMES):
            return None  # no weights at all: a listed file is missing, the damage the manifest reports
        problem = str(e)
    except ValueError as e:  # (an index that is not JSON, or not Hugging Face's)
        problem = str(e)
    else:
        return None if all(p.name in listed for p in found) else found
    raise CheckpointError(f"the model's weights in {folder} are not a complete set: {problem}. Its manifest lists "
                          f"{', '.join(sorted(listed))}, which are not all there either: put the missing file back, "
                          f"save the weights again (model.save_pretrained({str(folder)!r})), or resume from another "
                          "checkpoint")
