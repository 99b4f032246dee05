"""The Trainer tier: TrainingArguments, Trainer, callbacks."""

from .args import TrainingArguments
from .callbacks import EarlyStoppingCallback, TrainerCallback, TrainerControl, TrainerState
from .schedules import get_scheduler
from .trainer import EvalPrediction, PredictionOutput, Trainer, TrainOutput, set_seed

__all__ = [
    "EarlyStoppingCallback",
    "EvalPrediction",
    "PredictionOutput",
    "TrainOutput",
    "Trainer",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "TrainingArguments",
    "get_scheduler",
    "set_seed",
]
