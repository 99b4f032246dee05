"""``accelerator.state`` and ``accelerator.gradient_state``, under Hugging Face Accelerate's names.

Accelerate keeps these in process-global singletons (every ``Accelerator`` of a process shares
one); here each Accelerator owns its own, built from values (the :class:`Processes` part it
shares with the Accelerator, the precision's name), so two Accelerators with different settings
do not change each other. The fields and the error after ``_reset_state()`` are Accelerate's.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from mixprec.accelerator.configs import GradientAccumulationPlugin
from mixprec.accelerator.processes import PROCESS_API, Processes, expose

__all__ = ["AcceleratorState", "DistributedType", "GradientState"]


class DistributedType(str, enum.Enum):
    """How the processes of a run are arranged (Accelerate's names; compares equal to Accelerate's)."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    # Accelerate's other arrangements, for scripts that compare against them (mixprec runs none of
    # them but FSDP, reported as MULTI_CPU / MULTI_GPU with ``is_fsdp2``):
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


class _State:
    """Attributes held in ``__dict__``; after ``_reset_state()`` reading one says what happened."""

    def _reset_state(self, reset_partial_state: bool = False) -> None:
        """Forget every field (Accelerate's testing hook); reading one afterwards raises ``AttributeError``."""
        self.__dict__.clear()

    def __getattr__(self, name: str) -> Any:  # only reached for a missing attribute
        cls = type(self).__name__
        if name.startswith("__") or self.__dict__:
            raise AttributeError(f"'{cls}' object has no attribute '{name}'")
        raise AttributeError(f"`{cls}` object has no attribute `{name}`. This happens if `{cls}._reset_state()` was "
                             "called and an `Accelerator` was not reinitialized: build a new Accelerator")


@expose(PROCESS_API, "_processes")
class AcceleratorState(_State):
    """Who this process is and the run's precision: ``num_processes``, ``process_index``,
    ``local_process_index``, ``device``, ``distributed_type``, ``mixed_precision``, ``backend``,
    and, like Accelerate's, the process helpers (``is_main_process``, ``wait_for_everyone``,
    ``on_main_process``, ...), those of the :class:`Processes` it holds.

    Args:
        processes: this process among all of them (the Accelerator holds the same one).
        mixed_precision: the precision in Accelerate's words (``"no"``, ``"fp16"``, ``"bf16"``);
            the Accelerator sets it again when a run switches precision.
    """

    def __init__(self, processes: Processes, *, mixed_precision: str) -> None:
        self._processes = processes
        self.device = processes.device
        self.mixed_precision = mixed_precision
        distributed = processes.info.is_distributed
        self.backend = torch.distributed.get_backend() if distributed else None
        if not distributed:
            self.distributed_type = DistributedType.NO
        else:
            self.distributed_type = DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU
        # Accelerate's fields for what mixprec does not run (DeepSpeed, tensor parallelism, dynamo
        # plugins, a device mesh): present, and empty.
        self.initialized = True
        self.debug = False
        self.fork_launched = False
        self.is_fsdp2 = False  # the Accelerator sets it when given an fsdp_plugin
        self.deepspeed_plugins = None
        self.torch_tp_plugin = None
        self.dynamo_plugin = None
        self.parallelism_config = None
        self.device_mesh = None

    @property
    def use_distributed(self) -> bool:
        return self.distributed_type != DistributedType.NO

    @property
    def deepspeed_plugin(self) -> None:
        """DeepSpeed is not run by mixprec: always ``None``."""
        return None

    def get_deepspeed_plugin(self, name: str) -> Any:
        raise ValueError(f"no DeepSpeed plugin {name!r}: mixprec does not run DeepSpeed (shard with FSDP2: "
                         "Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin()))")

    def select_deepspeed_plugin(self, name: str | None = None) -> None:
        self.get_deepspeed_plugin(str(name))

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's share of ``inputs`` (see ``Accelerator.split_between_processes``)."""
        n, i = self.num_processes, self.process_index
        yield split_for_process(inputs, n, i, apply_padding) if n > 1 else inputs

    def destroy_process_group(self, group: Any = None) -> None:
        """Release the process group, if several processes ran (a one-process group is left alone)."""
        if self.num_processes > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group(group)

    def __repr__(self) -> str:
        return (f"Distributed environment: {self.distributed_type.value}\nNum processes: {self.num_processes}\n"
                f"Process index: {self.process_index}\nLocal process index: {self.local_process_index}\n"
                f"Device: {self.device}\nMixed precision type: {self.mixed_precision}\n")


def split_for_process(inputs: Any, num_processes: int, index: int, apply_padding: bool = False) -> Any:
    """Process ``index``'s contiguous share of ``inputs`` (a list, tuple, tensor, or a mapping of
    them): the first processes take one more when the length does not divide; with
    ``apply_padding`` the others repeat the last element so every share has the same length."""
    if isinstance(inputs, Mapping):  # a dict, or a mapping such as transformers' BatchEncoding (kept as its type)
        parts = {k: split_for_process(v, num_processes, index, apply_padding) for k, v in inputs.items()}
        try:
            return parts if type(inputs) is dict else type(inputs)(parts)
        except TypeError:  # a mapping whose constructor takes something else
            return parts
    per, extra = divmod(len(inputs), num_processes)
    start = index * per + min(index, extra)
    part = inputs[start:start + per + (1 if index < extra else 0)]
    if apply_padding and extra and index >= extra:
        part = torch.cat([part, inputs[-1:]]) if torch.is_tensor(inputs) else part + type(inputs)(inputs[-1:])
    return part


class GradientState(_State):
    """Gradient accumulation as the loop sees it: ``num_steps``, ``sync_gradients``,
    ``end_of_dataloader``, ``active_dataloader``, ``remainder``, ``adjust_scheduler``."""

    def __init__(self, num_steps: int, adjust_scheduler: bool = True, sync_with_dataloader: bool = True,
                 sync_each_batch: bool = False) -> None:
        self.num_steps = num_steps
        self.adjust_scheduler = adjust_scheduler
        self.sync_with_dataloader = sync_with_dataloader
        self.sync_each_batch = sync_each_batch
        self.sync_gradients = True
        self.initialized = True
        self.is_xla_gradients_synced = False  # no XLA here
        self.dataloader_references: list[Any] = []  # the loaders being iterated, innermost last

    @property
    def active_dataloader(self) -> Any:
        """The prepared dataloader being iterated (the innermost one), or ``None``."""
        return self.dataloader_references[-1] if self.dataloader_references else None

    @property
    def in_dataloader(self) -> bool:
        return self.active_dataloader is not None

    @property
    def end_of_dataloader(self) -> bool:
        """Whether the batch just yielded is the active dataloader's last."""
        dl = self.active_dataloader
        return bool(dl is not None and dl.end_of_dataloader)

    @property
    def remainder(self) -> int:
        """Accelerate's meaning: the real samples in the active dataloader's last batch round over all
        processes (``len(dataset) % total_batch_size``, what ``gather_for_metrics`` keeps of the
        last round); ``-1`` outside a dataloader or where it is not known."""
        dl = self.active_dataloader
        return dl.remainder if dl is not None else -1

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        """Set :attr:`sync_gradients` (Accelerate's private setter: transformers' Trainer, which
        counts its own accumulation, calls it on every micro-batch)."""
        self.sync_gradients = sync_gradients

    @property
    def plugin_kwargs(self) -> dict[str, Any]:
        """The accumulation plugin's settings that differ from its defaults (Accelerate's ``to_kwargs()``:
        ``num_steps`` always, its default being none)."""
        values = {"num_steps": self.num_steps, "adjust_scheduler": self.adjust_scheduler,
                  "sync_with_dataloader": self.sync_with_dataloader, "sync_each_batch": self.sync_each_batch}
        defaults = GradientAccumulationPlugin()
        return {k: v for k, v in values.items() if k == "num_steps" or v != getattr(defaults, k)}

    def _add_dataloader(self, dataloader: Any) -> None:
        if dataloader in self.dataloader_references:
            self.dataloader_references.remove(dataloader)
        self.dataloader_references.append(dataloader)

    def _remove_dataloader(self, dataloader: Any) -> None:
        if dataloader in self.dataloader_references:
            self.dataloader_references.remove(dataloader)
