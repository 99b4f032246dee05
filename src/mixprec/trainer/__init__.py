"""The Trainer tier: TrainingArguments, Trainer, callbacks."""

from .args import TrainingArguments
from .callbacks import (
    DefaultFlowCallback,
    EarlyStoppingCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)
from .reporters import PrinterCallback, ProgressCallback
from .schedules import get_scheduler
from .trainer import EvalPrediction, PredictionOutput, Trainer, TrainOutput, set_seed
from .trainer_state import ExportableState

__all__ = [
    "DefaultFlowCallback",
    "EarlyStoppingCallback",
    "ExportableState",
    "EvalPrediction",
    "PredictionOutput",
    "PrinterCallback",
    "ProgressCallback",
    "TrainOutput",
    "Trainer",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "TrainingArguments",
    "get_scheduler",
    "set_seed",
]
