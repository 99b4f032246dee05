"""Accelerate's ``kwargs_handlers``: small dataclasses that carry options to the parts that use them
(the loss scaler, DDP, the process group, autocast, the profiler), as mixprec's own classes and as
Accelerate's (an object of Accelerate's class with the same name is read field by field).

Example:
    >>> from mixprec import Accelerator
    >>> from mixprec.accelerator.handlers import GradScalerKwargs
    >>> Accelerator(kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)]).kwargs_handlers["GradScalerKwargs"]
    {'init_scale': 1024.0}
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["AORecipeKwargs", "AutocastKwargs", "DDPCommunicationHookType", "DistributedDataParallelKwargs", "GradScalerKwargs",
           "InitProcessGroupKwargs", "KwargsHandler", "ProfileKwargs", "read_kwargs_handlers"]


class KwargsHandler:
    """The base of the handlers: ``to_kwargs()`` holds the fields set to other than their default."""

    def to_kwargs(self) -> dict[str, Any]:
        default = type(self)()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)  # type: ignore[arg-type]
                if getattr(self, f.name) != getattr(default, f.name)}


@dataclass
class AutocastKwargs(KwargsHandler):
    """``torch.autocast``'s ``enabled`` and ``cache_enabled`` for the prepared models' forward."""

    enabled: bool = True
    cache_enabled: bool | None = None


class DDPCommunicationHookType(str, enum.Enum):
    """DDP's gradient compression (Accelerate's names): ``fp16`` and ``bf16`` are mixprec's ``ddp_comm_hook``."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments of ``torch.nn.parallel.DistributedDataParallel`` (and its communication hook)."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: str = "no"
    comm_state_option: dict = field(default_factory=dict)


@dataclass
class AORecipeKwargs(KwargsHandler):
    """fp8 through torchao (Accelerate's handler): torchao's ``Float8LinearConfig`` (``None``: the
    recipe of ``PrecisionConfig.fp8_recipe``, tensorwise by default) and the layer filter
    ``module_filter_func(module, name) -> bool`` (``None``: all Linear layers but the first and the
    last). ``pad_inner_dim`` and ``enable_fsdp_float8_all_gather`` set those fields of the config."""

    config: Any = None
    module_filter_func: Any = None
    pad_inner_dim: bool | None = None
    enable_fsdp_float8_all_gather: bool | None = None


@dataclass
class GradScalerKwargs(KwargsHandler):
    """The fp16 loss scaler's arguments (``torch.amp.GradScaler``'s names)."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """``torch.distributed.init_process_group``'s ``backend``, ``init_method`` and ``timeout``."""

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: datetime.timedelta | None = None


@dataclass
class ProfileKwargs(KwargsHandler):
    """What :meth:`Accelerator.profile` records (``torch.profiler.profile``'s arguments; ``activities``
    by name, ``schedule_option`` for ``torch.profiler.schedule``, ``output_trace_dir`` for a Chrome trace)."""

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def build(self) -> torch.profiler.profile:
        """The ``torch.profiler.profile`` these options describe."""
        names = {"cpu": torch.profiler.ProfilerActivity.CPU, "cuda": torch.profiler.ProfilerActivity.CUDA}
        activities = None
        if self.activities is not None:
            bad = [a for a in self.activities if a not in names]
            if bad:
                raise ValueError(f"profiler activities {bad} are not known here; use some of {sorted(names)}")
            activities = [names[a] for a in self.activities]
        schedule = torch.profiler.schedule(**self.schedule_option) if self.schedule_option is not None else None
        return torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=self.on_trace_ready,
                                      record_shapes=self.record_shapes, profile_memory=self.profile_memory,
                                      with_stack=self.with_stack, with_flops=self.with_flops,
                                      with_modules=self.with_modules)


_OURS = {cls.__name__: cls for cls in (AORecipeKwargs, AutocastKwargs, DistributedDataParallelKwargs,
                                       GradScalerKwargs, InitProcessGroupKwargs, ProfileKwargs)}
_OTHER_FP8 = ("FP8RecipeKwargs", "TERecipeKwargs", "MSAMPRecipeKwargs")


def read_kwargs_handlers(handlers: list[Any] | None) -> dict[str, Any]:
    """mixprec's handler object for each handler given (Accelerate's converted field by field), by class name.

    Raises:
        ValueError: two handlers of one kind, or one mixprec does not take (naming those it takes).
        NotImplementedError: an fp8 recipe of another backend than torchao (TransformerEngine, MS-AMP).
    """
    found: dict[str, Any] = {}
    for handler in handlers or []:
        name = type(handler).__name__
        if name in _OTHER_FP8 and str(getattr(getattr(handler, "backend", None), "value",
                                              getattr(handler, "backend", ""))).upper() != "AO":
            raise NotImplementedError(f"{name}: mixprec's fp8 runs torchao's float8 training, not TransformerEngine "
                                      "or MS-AMP; pass AORecipeKwargs(...) or just mixed_precision='fp8'")
        if name == "FP8RecipeKwargs":  # Accelerate's old catch-all, with backend="AO"
            name = "AORecipeKwargs"
        if name not in _OURS:
            raise ValueError(f"kwargs_handlers: {name} is not a handler mixprec takes; it takes "
                             f"{', '.join(sorted(_OURS))}")
        if name in found:
            raise ValueError(f"You can only pass one {name} in `kwargs_handlers`.")
        ours = _OURS[name]
        if not isinstance(handler, ours):
            values = {f.name: getattr(handler, f.name) for f in dataclasses.fields(ours) if hasattr(handler, f.name)}
            if "comm_hook" in values:
                values["comm_hook"] = DDPCommunicationHookType(getattr(values["comm_hook"], "value",
                                                                       values["comm_hook"]))
            if "comm_wrapper" in values:
                values["comm_wrapper"] = str(getattr(values["comm_wrapper"], "value", values["comm_wrapper"]))
            handler = ours(**values)
        found[name] = handler
    return found
