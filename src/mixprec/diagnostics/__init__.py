"""Precision diagnostics: what low precision does to a model's numbers. They observe only.

* :class:`GradientStats`: per parameter and module, the fraction of gradient values that fp16 or
  bf16 would flush to zero, keep as subnormals or overflow, unscaled and at the loss scale.
* :class:`OverflowTracer`: the first module whose activation or gradient overflows its dtype.
* :func:`precision_drift`: a batch's loss under autocast beside the same loss in fp32.
* :data:`FORMAT_LIMITS`: the fp16 and bf16 range facts, from ``torch.finfo``.
* :class:`DiagnosticsConfig` / :class:`Monitor`: the same, switched on in an Accelerator or Trainer.
* :func:`mixprec.diagnostics.hf.DiagnosticsCallback`: the same for the Hugging Face Trainer.
* :func:`count_host_syncs`: the host-device syncs a block of code makes (``mixprec bench``'s
  ``syncs`` column), with :func:`host_side_tensors` naming the optimizer's host-side counters.

Nothing here changes a gradient, an activation, a parameter or an RNG stream, and nothing
syncs the host with the device except the methods whose docstrings say so. Nothing here imports
the Accelerator or the Trainer: :mod:`mixprec.apps.doctor`, which trains probe runs with these
instruments on, sits above them.
"""

from mixprec.diagnostics.drift import precision_drift
from mixprec.diagnostics.gradient_stats import GradientStats
from mixprec.diagnostics.limits import FORMAT_LIMITS, FormatLimits, format_limits
from mixprec.diagnostics.monitor import DiagnosticsConfig, Monitor
from mixprec.diagnostics.syncs import HostSyncs, SyncEvent, count_host_syncs, host_side_tensors
from mixprec.diagnostics.tracer import OverflowTracer, TraceEvent

__all__ = [
    "DiagnosticsConfig",
    "FORMAT_LIMITS",
    "FormatLimits",
    "GradientStats",
    "HostSyncs",
    "Monitor",
    "OverflowTracer",
    "SyncEvent",
    "TraceEvent",
    "count_host_syncs",
    "format_limits",
    "host_side_tensors",
    "precision_drift",
]
