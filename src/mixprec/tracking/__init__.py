"""Experiment tracking, Accelerate's way: ``Accelerator(log_with=..., project_dir=...)``, then
``init_trackers(project_name, config, init_kwargs)``, ``log(values, step, log_kwargs)``,
``get_tracker(name, unwrap)`` and ``end_training()``.

The built-in trackers are TensorBoard, Weights & Biases, MLflow, Comet, Aim, ClearML, DVCLive, trackio and
SwanLab, each through its own library (imported when the run starts, never a dependency of mixprec); your
own is a :class:`GeneralTracker` subclass, passed as an instance or registered by name.
"""

from mixprec.tracking.base import GeneralTracker, LoggerType
from mixprec.tracking.registry import Trackers, register_tracker_class, resolve_log_with, start_trackers
from mixprec.tracking.trackers import (
    AimTracker,
    ClearMLTracker,
    CometMLTracker,
    DVCLiveTracker,
    MLflowTracker,
    SwanLabTracker,
    TensorBoardTracker,
    TrackioTracker,
    WandBTracker,
)

__all__ = ["AimTracker", "ClearMLTracker", "CometMLTracker", "DVCLiveTracker", "GeneralTracker", "LoggerType",
           "MLflowTracker", "SwanLabTracker", "TensorBoardTracker", "TrackioTracker", "Trackers", "WandBTracker",
           "register_tracker_class", "resolve_log_with", "start_trackers"]
