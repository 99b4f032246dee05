"""mixprec: fast, safe mixed-precision training for PyTorch.

Three tiers, each built on the one before: plain PyTorch with :class:`LossScaler` (a drop-in
``torch.amp.GradScaler``), an :class:`Accelerator`, and a :class:`Trainer`.
"""

from mixprec import diagnostics
from mixprec.accelerator import (
    Accelerator,
    DataLoaderConfiguration,
    DistributedType,
    GradientAccumulationPlugin,
    LocalSGD,
    ProjectConfiguration,
    find_executable_batch_size,
    gather_object,
    get_logger,
    set_seed,
)
from mixprec.checkpoint import CheckpointError, CheckpointNotFoundError
from mixprec.distributed import FullyShardedDataParallelPlugin
from mixprec.hardware import DeviceCapability, detect_capability
from mixprec.integrations.transformers_engine import patch_transformers, unpatch_transformers
from mixprec.precision import PrecisionPerformanceWarning, PrecisionPolicy, precision_names, resolve_precision
from mixprec.precision.scaler import LossScaleCollapse, LossScaler
from mixprec.tasks import GPT, GPTConfig, Task, get_task, load_factory
from mixprec.trainer import (
    DefaultFlowCallback,
    EarlyStoppingCallback,
    EvalPrediction,
    ExportableState,
    PredictionOutput,
    PrinterCallback,
    ProgressCallback,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
    TrainOutput,
)

__version__ = "0.1.0"

__all__ = [
    "set_seed",
    "get_logger",
    "gather_object",
    "find_executable_batch_size",
    "Accelerator",
    "CheckpointError",
    "CheckpointNotFoundError",
    "DataLoaderConfiguration",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GradientAccumulationPlugin",
    "LocalSGD",
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
    "Seq2SeqTrainer",
    "Seq2SeqTrainingArguments",
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
    "patch_transformers",
    "precision_names",
    "resolve_precision",
    "unpatch_transformers",
]
