"""The Accelerator tier: :class:`Accelerator` (composed of the parts it holds: the preparer, the
checkpointer, the processes), the prepared objects it hands back, the precision audit, and the
Accelerate-compatible configurations and state."""

from mixprec.accelerator.accelerator import Accelerator
from mixprec.accelerator.configs import (
           DataLoaderConfiguration,
           GradientAccumulationPlugin,
           ProjectConfiguration,
)
from mixprec.accelerator.local_sgd import LocalSGD
from mixprec.accelerator.state import AcceleratorState, DistributedType, GradientState
from mixprec.accelerator.utils import (
    broadcast_object_list,
    find_executable_batch_size,
    gather_object,
    get_logger,
    set_seed,
)

__all__ = ["Accelerator", "AcceleratorState", "DataLoaderConfiguration", "DistributedType", "GradientAccumulationPlugin",
           "GradientState", "LocalSGD", "ProjectConfiguration", "broadcast_object_list", "find_executable_batch_size",
           "gather_object", "get_logger", "set_seed"]
