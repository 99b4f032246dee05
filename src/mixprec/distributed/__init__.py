"""Several processes: the process group as torchrun or ``accelerate launch`` set it up (gloo on
the CPU, nccl on CUDA) and the collectives the tiers use, FSDP2 sharding, and preemption."""

from mixprec.distributed.fsdp import FullyShardedDataParallelPlugin
from mixprec.distributed.groups import ProcessInfo, init_from_env
from mixprec.distributed.preemption import PREEMPTED_EXIT_CODE, Preemption

__all__ = ["FullyShardedDataParallelPlugin", "PREEMPTED_EXIT_CODE", "Preemption", "ProcessInfo", "init_from_env"]
