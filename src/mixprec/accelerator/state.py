"""``accelerator.state`` and ``accelerator.gradient_state``, under Hugging Face Accelerate's names.

Accelerate keeps these in process-global singletons (every ``Accelerator`` of a process shares
one); here each Accelerator owns its own, built from values (the :class:`Processes` part it
shares with the Accelerator, the precision's name), so two Accelerators with different settings
do not change each other. The fields and the error after ``_reset_state()`` are Accelerate's.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from mixprec.accelerator.processes import PROCESS_API, Processes, expose

__all__ = ["AcceleratorState", "DistributedType", "GradientState"]


class DistributedType(str, enum.Enum):
    """How the processes of a run are arranged (Accelerate's names; compares equal to Accelerate's)."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"


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

    @property
    def use_distributed(self) -> bool:
        return self.distributed_type != DistributedType.NO

    def destroy_process_group(self, group: Any = None) -> None:
        """Release the process group, if several processes ran (a one-process group is left alone)."""
        if self.num_processes > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group(group)

    def __repr__(self) -> str:
        return (f"Distributed environment: {self.distributed_type.value}\nNum processes: {self.num_processes}\n"
                f"Process index: {self.process_index}\nLocal process index: {self.local_process_index}\n"
                f"Device: {self.device}\nMixed precision type: {self.mixed_precision}\n")


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
        """Padded duplicates in the active dataloader's last batch round (0 elsewhere)."""
        dl = self.active_dataloader
        return dl.remainder if (dl is not None and dl.end_of_dataloader) else -1

    @property
    def plugin_kwargs(self) -> dict[str, Any]:
        return {"num_steps": self.num_steps, "adjust_scheduler": self.adjust_scheduler,
                "sync_with_dataloader": self.sync_with_dataloader, "sync_each_batch": self.sync_each_batch}

    def _add_dataloader(self, dl: Any) -> None:
        if dl in self.dataloader_references:
            self.dataloader_references.remove(dl)
        self.dataloader_references.append(dl)

    def _remove_dataloader(self, dl: Any) -> None:
        if dl in self.dataloader_references:
            self.dataloader_references.remove(dl)
