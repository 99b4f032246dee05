"""Sharding with torch's FSDP2 (``torch.distributed.fsdp.fully_shard``), under Accelerate's names.

``FullyShardedDataParallelPlugin`` takes the fields of Hugging Face Accelerate's plugin that mean
something for FSDP2; the precision plugin supplies FSDP2's ``MixedPrecisionPolicy`` (bf16/fp16
compute over fp32 sharded master weights, gradients reduced in fp32). Checkpoints of sharded
models are the checkpoint layer's (:mod:`mixprec.checkpoint.sharded`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

__all__ = ["FullyShardedDataParallelPlugin", "full_state_dict", "is_sharded", "shard_model"]

# Accelerate's FSDP1 fields with no FSDP2 meaning, and what to do instead.
_FSDP1_ONLY = {
    "sharding_strategy": "FSDP2 always shards parameters, gradients and optimizer state; "
                         "reshard_after_forward=False keeps parameters gathered between forward and backward",
    "backward_prefetch": "FSDP2 prefetches by itself",
    "forward_prefetch": "FSDP2 prefetches by itself",
    "use_orig_params": "FSDP2 always keeps the original parameters (as DTensors)",
    "sync_module_states": "build the model with the same seed on every rank (or load its weights) before prepare",
    "limit_all_gathers": "FSDP2 does not need it",
    "cpu_offload": "not supported yet",
    "state_dict_type": "save_state writes sharded checkpoints (DCP); save_model writes a full one",
}


@dataclass
class FullyShardedDataParallelPlugin:
    """How ``Accelerator.prepare`` shards a model with FSDP2 (Accelerate's plugin, FSDP2 fields).

    Args:
        fsdp_version: 2 (FSDP1 is not offered).
        reshard_after_forward: free the gathered parameters after each block's forward (less
            memory, one more all-gather in backward).
        auto_wrap_policy: ``"transformer_based_wrap"`` (default) shards each block named in
            ``transformer_cls_names_to_wrap``, or, without names, each block of a ``ModuleList``
            of repeated modules (a transformer's layers), then the root; ``"no_wrap"`` shards the
            root only; a callable ``policy(module) -> bool`` picks the blocks itself.
        transformer_cls_names_to_wrap: class names of the blocks to shard one by one.
        reduce_dtype: the dtype gradients are reduced in (default fp32 for 16-bit precisions).
        activation_checkpointing: recompute each block's activations in backward (less memory).
        cpu_ram_efficient_loading: accepted only as ``False`` (every rank builds the model).

    Example:
        >>> FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]).fsdp_version
        2
    """

    fsdp_version: int = 2
    reshard_after_forward: bool = True
    auto_wrap_policy: str | Callable[[torch.nn.Module], bool] | None = "transformer_based_wrap"
    transformer_cls_names_to_wrap: list[str] | None = None
    reduce_dtype: torch.dtype | None = torch.float32
    activation_checkpointing: bool = False
    cpu_ram_efficient_loading: bool = False
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.fsdp_version != 2:
            raise ValueError(f"fsdp_version={self.fsdp_version!r}: mixprec shards with FSDP2 (fully_shard) only; "
                             "set fsdp_version=2")
        for name in self.extra:
            if name in _FSDP1_ONLY:
                raise ValueError(f"FullyShardedDataParallelPlugin({name}=...) has no FSDP2 meaning: {_FSDP1_ONLY[name]}")
            raise TypeError(f"FullyShardedDataParallelPlugin has no field {name!r}; "
                            f"it has {[f.name for f in fields(self) if f.name != 'extra']}")
        if self.cpu_ram_efficient_loading:
            raise ValueError("cpu_ram_efficient_loading=True is not supported yet: every rank builds the model; "
                             "leave it False")
        if isinstance(self.auto_wrap_policy, str) and self.auto_wrap_policy not in ("transformer_based_wrap",
                                                                                    "no_wrap"):
            raise ValueError(f"auto_wrap_policy={self.auto_wrap_policy!r}: choose 'transformer_based_wrap', "
                             "'no_wrap', or a callable(module) -> bool")
        if isinstance(self.transformer_cls_names_to_wrap, str):
            self.transformer_cls_names_to_wrap = [n.strip() for n in self.transformer_cls_names_to_wrap.split(",")]

    @classmethod
    def from_config(cls, config: Any) -> FullyShardedDataParallelPlugin:
        """Read Accelerate's plugin, a dict of fields (Hugging Face's ``fsdp_config`` names, with or
        without their ``fsdp_`` prefix, are accepted), or return ``config`` if it is one already."""
        if isinstance(config, cls):
            return config
        if not isinstance(config, dict):
            config = {k: v for k, v in vars(config).items() if not k.startswith("_")}
        mine = {f.name for f in fields(cls)} - {"extra"}
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in config.items():
            name = key[5:] if key.startswith("fsdp_") and key[5:] in mine | set(_FSDP1_ONLY) else key
            name = {"transformer_layer_cls_to_wrap": "transformer_cls_names_to_wrap"}.get(name, name)
            if name in mine:
                kwargs[name] = value
            elif value not in (None, False) and name not in ("min_num_params", "version"):
                extra[name] = value
        return cls(**kwargs, extra=extra)


def blocks_to_shard(model: torch.nn.Module, plugin: FullyShardedDataParallelPlugin) -> list[torch.nn.Module]:
    """The submodules sharded one by one before the root, in ``model.modules()`` order."""
    policy = plugin.auto_wrap_policy
    if policy in (None, "no_wrap"):
        return []
    if callable(policy):
        return [m for m in model.modules() if m is not model and policy(m)]
    names = set(plugin.transformer_cls_names_to_wrap or [])
    if names:
        found = [m for m in model.modules() if type(m).__name__ in names]
        if not found:
            have = sorted({type(m).__name__ for m in model.modules()})
            raise ValueError(f"transformer_cls_names_to_wrap={sorted(names)} matches no module of the model; "
                             f"its classes are {have}")
        return found
    # What users mean by "wrap the layers": each block of a ModuleList of repeated modules.
    out = []
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) >= 2 and len({type(c) for c in m}) == 1:
            out.extend(m)
    return out


def shard_model(model: torch.nn.Module, plugin: FullyShardedDataParallelPlugin, mp_policy: Any) -> torch.nn.Module:
    """Apply activation checkpointing (if asked), then ``fully_shard`` each block and the root."""
    from torch.distributed.fsdp import fully_shard

    blocks = blocks_to_shard(model, plugin)
    if plugin.activation_checkpointing and blocks:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        ids = {id(b) for b in blocks}
        apply_activation_checkpointing(model, check_fn=lambda m: id(m) in ids)
        # each block is now inside its checkpoint wrapper: shard the wrappers
        blocks = [m for m in model.modules() if id(getattr(m, "_checkpoint_wrapped_module", None)) in ids]
    for block in blocks:
        fully_shard(block, mp_policy=mp_policy, reshard_after_forward=plugin.reshard_after_forward)
    fully_shard(model, mp_policy=mp_policy, reshard_after_forward=plugin.reshard_after_forward)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` was sharded with ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole (unsharded) state dict of a sharded model, on every rank's CPU (collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # (cpu_offload=True would hand the whole dict to rank 0 only)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.cpu() if torch.is_tensor(v) else v for k, v in full.items()}
