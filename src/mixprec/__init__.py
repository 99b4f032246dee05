"""mixprec: fast, safe mixed-precision training for PyTorch.

Three tiers, each built on the one before: plain PyTorch with :class:`LossScaler` (a drop-in
``torch.amp.GradScaler``), an :class:`Accelerator`, and a :class:`Trainer`.
"""

from .accelerator import Accelerator
from .checkpoint import CheckpointError
from .hardware import DeviceCapability, detect_capability
from .precision import PrecisionPerformanceWarning, PrecisionPolicy, precision_names, resolve_precision
from .scaler import LossScaleCollapse, LossScaler

__version__ = "0.1.0"

__all__ = [
    "Accelerator",
    "CheckpointError",
    "DeviceCapability",
    "LossScaleCollapse",
    "LossScaler",
    "PrecisionPerformanceWarning",
    "PrecisionPolicy",
    "__version__",
    "detect_capability",
    "precision_names",
    "resolve_precision",
]
