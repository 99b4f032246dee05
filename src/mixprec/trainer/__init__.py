"""The Trainer tier: TrainingArguments, Trainer, callbacks."""

from mixprec.trainer.args import TrainingArguments
from mixprec.trainer.callbacks import (
    DefaultFlowCallback,
    EarlyStoppingCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)
from mixprec.trainer.reporters import PrinterCallback, ProgressCallback
from mixprec.trainer.schedules import get_scheduler
from mixprec.trainer.seq2seq import Seq2SeqTrainer, Seq2SeqTrainingArguments
from mixprec.trainer.trainer import EvalPrediction, PredictionOutput, Trainer, TrainOutput, set_seed
from mixprec.trainer.trainer_state import ExportableState

__all__ = [
    "DefaultFlowCallback",
    "EarlyStoppingCallback",
    "ExportableState",
    "EvalPrediction",
    "PredictionOutput",
    "PrinterCallback",
    "ProgressCallback",
    "Seq2SeqTrainer",
    "Seq2SeqTrainingArguments",
    "TrainOutput",
    "Trainer",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "TrainingArguments",
    "get_scheduler",
    "set_seed",
]
