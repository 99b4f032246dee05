"""mixprec: fast, safe mixed-precision training for PyTorch.

Three tiers, each built on the one before: plain PyTorch with :class:`LossScaler` (a drop-in
``torch.amp.GradScaler``), an :class:`Accelerator`, and a :class:`Trainer`.
"""

from . import diagnostics
from .accelerator import Accelerator
from .accelerator_state import DistributedType
from .checkpoint import CheckpointError, CheckpointNotFoundError
from .configs import DataLoaderConfiguration, GradientAccumulationPlugin, ProjectConfiguration
from .fsdp import FullyShardedDataParallelPlugin
from .hardware import DeviceCapability, detect_capability
from .precision import PrecisionPerformanceWarning, PrecisionPolicy, precision_names, resolve_precision
from .scaler import LossScaleCollapse, LossScaler
from .tasks import GPT, GPTConfig, Task, get_task, load_factory
from .trainer import (
    DefaultFlowCallback,
    EarlyStoppingCallback,
    EvalPrediction,
    ExportableState,
    PredictionOutput,
    PrinterCallback,
    ProgressCallback,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
    TrainOutput,
)

__version__ = "0.1.0"

__all__ = [
    "Accelerator",
    "CheckpointError",
    "CheckpointNotFoundError",
    "DataLoaderConfiguration",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GradientAccumulationPlugin",
    "ProjectConfiguration",
    "DeviceCapability",
    "DefaultFlowCallback",
    "EarlyStoppingCallback",
    "ExportableState",
    "PrinterCallback",
    "ProgressCallback",
    "GPT",
    "GPTConfig",
    "Task",
    "EvalPrediction",
    "PredictionOutput",
    "Trainer",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "TrainingArguments",
    "TrainOutput",
    "LossScaleCollapse",
    "LossScaler",
    "PrecisionPerformanceWarning",
    "PrecisionPolicy",
    "__version__",
    "detect_capability",
    "diagnostics",
    "get_task",
    "load_factory",
    "precision_names",
    "resolve_precision",
]
