"""Sharding with torch's FSDP2 (``torch.distributed.fsdp.fully_shard``), under Accelerate's names.

``FullyShardedDataParallelPlugin`` takes the fields of Hugging Face Accelerate's plugin that mean
something for FSDP2; the precision plugin supplies FSDP2's ``MixedPrecisionPolicy`` (bf16/fp16
compute over fp32 sharded master weights, gradients reduced in fp32). Checkpoints of sharded
models are the checkpoint layer's (:mod:`mixprec.checkpoint.sharded`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
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
_FSDP1_MORE = {
    "mixed_precision_policy": "the precision comes from Accelerator(mixed_precision=...); the gradients' reduce "
                              "dtype from FullyShardedDataParallelPlugin(reduce_dtype=...)",
    "ignored_modules": "every parameter is sharded; keep a module out of the model passed to prepare instead",
    "param_init_fn": "build the model on every rank (or load its weights) before prepare",
    "min_num_params": "size-based wrapping is not offered: auto_wrap_policy='transformer_based_wrap' with "
                      "transformer_cls_names_to_wrap, or a callable(module) -> bool",
    "activation_checkpointing_offload": "not supported: activation_checkpointing=True recomputes on the device",
    "sharding_strategy": "FULL_SHARD (reshard_after_forward=True) and SHARD_GRAD_OP (reshard_after_forward=False) "
                         "are FSDP2's; NO_SHARD is DDP (no fsdp_plugin), HYBRID_SHARD is not offered",
    "cpu_offload": "offloading parameters to the CPU is not supported yet",
}
_FSDP1_FIELDS = ("sharding_strategy", "backward_prefetch", "forward_prefetch", "use_orig_params", "sync_module_states",
                 "limit_all_gathers", "cpu_offload", "state_dict_type", "state_dict_config", "optim_state_dict_config",
                 "mixed_precision_policy", "ignored_modules", "param_init_fn", "min_num_params",
                 "activation_checkpointing_offload")


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
    # Accelerate's FSDP1 fields: accepted where FSDP2 has their meaning, an error that says what
    # FSDP2 does instead where it has none (see _fsdp1_field).
    sharding_strategy: Any = None
    backward_prefetch: Any = None
    forward_prefetch: Any = None
    use_orig_params: Any = None
    sync_module_states: Any = None
    limit_all_gathers: Any = None
    cpu_offload: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    mixed_precision_policy: Any = None
    ignored_modules: Any = None
    param_init_fn: Any = None
    min_num_params: Any = None
    activation_checkpointing_offload: Any = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.fsdp_version != 2:
            raise ValueError(f"fsdp_version={self.fsdp_version!r}: mixprec shards with FSDP2 (fully_shard) only; "
                             "set fsdp_version=2")
        for name in _FSDP1_FIELDS:
            value = getattr(self, name)
            if value is not None:
                self._fsdp1_field(name, value)
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

    def _fsdp1_field(self, name: str, value: Any) -> None:
        """Accept an FSDP1 field whose meaning FSDP2 has (mapping it), else refuse it saying why."""
        text = str(getattr(value, "name", value)).upper()
        if name == "sharding_strategy":
            if text in ("FULL_SHARD", "1"):
                self.reshard_after_forward = True
                return
            if text in ("SHARD_GRAD_OP", "2"):
                self.reshard_after_forward = False  # FSDP2's spelling of ZeRO-2
                return
        accepted = {
            "backward_prefetch": True, "forward_prefetch": True, "limit_all_gathers": True,  # FSDP2 does it itself
            "use_orig_params": value in (True, False),  # FSDP2 always keeps the original parameters
            "sync_module_states": value in (True, False),  # prepare broadcasts rank 0's weights
            "cpu_offload": not getattr(value, "offload_params", bool(value)),
            "state_dict_type": text in ("SHARDED_STATE_DICT", "3", "FULL_STATE_DICT", "1"),
            "state_dict_config": True, "optim_state_dict_config": True,  # save_model gathers a full one anyway
            "min_num_params": value in (0, False),
            "activation_checkpointing_offload": value is False,
        }
        if accepted.get(name, False):
            return
        raise ValueError(f"FullyShardedDataParallelPlugin({name}={value!r}) has no FSDP2 meaning here: "
                         f"{_FSDP1_MORE.get(name) or _FSDP1_ONLY.get(name, 'not supported')}")

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
            elif value not in (None, False) and name != "version":
                extra[name] = value
        return cls(**kwargs, extra=extra)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> FullyShardedDataParallelPlugin:
        """The plugin ``accelerate launch`` describes in its ``FSDP_*`` variables (what
        ``accelerate config`` or ``--fsdp_*`` set), resolved as Accelerate resolves them: an
        unset wrap policy is ``NO_WRAP``; an FSDP1 setting with an FSDP2 meaning is mapped
        (``FULL_SHARD`` / ``SHARD_GRAD_OP``); one without is refused saying why, by the same rules
        as the plugin's own fields. ``FSDP_VERSION=1`` is run as FSDP2, with a warning."""
        def flag(name: str) -> bool:
            return env.get("FSDP_" + name, "false").strip().lower() in ("1", "true", "yes", "y", "on")

        version = env.get("FSDP_VERSION", "1").strip()
        if version == "1":
            warnings.warn("accelerate launch asks for FSDP1 (FSDP_VERSION=1, the default of `accelerate config`): "
                          "mixprec shards with FSDP2 (fully_shard), which trains the same model; set "
                          "fsdp_version: 2 in the config to say so", stacklevel=3)
        config: dict[str, Any] = {}
        if version == "2" and "FSDP_RESHARD_AFTER_FORWARD" in env:
            config["reshard_after_forward"] = flag("RESHARD_AFTER_FORWARD")
        elif version != "2":
            config["sharding_strategy"] = env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD")
        policy = env.get("FSDP_AUTO_WRAP_POLICY", "NO_WRAP").strip().upper()
        if policy == "SIZE_BASED_WRAP":
            config["min_num_params"] = int(env.get("FSDP_MIN_NUM_PARAMS", "0")) or 1  # refused, saying why
        elif policy not in ("TRANSFORMER_BASED_WRAP", "NO_WRAP"):
            raise ValueError(f"FSDP_AUTO_WRAP_POLICY={policy!r}: choose TRANSFORMER_BASED_WRAP or NO_WRAP")
        config["auto_wrap_policy"] = policy.lower()
        if env.get("FSDP_TRANSFORMER_CLS_TO_WRAP"):
            config["transformer_cls_names_to_wrap"] = env["FSDP_TRANSFORMER_CLS_TO_WRAP"]
        if env.get("FSDP_STATE_DICT_TYPE"):
            config["state_dict_type"] = env["FSDP_STATE_DICT_TYPE"]
        for name, field_name in (("OFFLOAD_PARAMS", "cpu_offload"), ("ACTIVATION_CHECKPOINTING_OFFLOAD",
                                 "activation_checkpointing_offload")):
            if flag(name):
                config[field_name] = True  # refused, saying why
        config["activation_checkpointing"] = flag("ACTIVATION_CHECKPOINTING")
        config["cpu_ram_efficient_loading"] = flag("CPU_RAM_EFFICIENT_LOADING")
        return cls.from_config(config)


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
