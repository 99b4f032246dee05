"""Diagnostics attached to a training run: what the Accelerator and the Trainer switch on.

A :class:`Monitor` owns the :class:`GradientStats` and the :class:`OverflowTracer` of one
model and is called around each optimizer step. It observes only: with it on, the run's
numbers are bit for bit those of the run without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .gradient_stats import GradientStats
from .tracer import OverflowTracer, TraceEvent

__all__ = ["DiagnosticsConfig", "Monitor"]


@dataclass(frozen=True, kw_only=True)
class DiagnosticsConfig:
    """Which diagnostics run, and how often. Everything is off by default.

    Args:
        gradient_stats_every: observe gradient statistics every N optimizer steps (0: off).
        trace_overflow: hook every module to name the first one whose output or gradient
            overflows (one host sync per step while on).
        trace_threshold: flag values above this fraction of their dtype's maximum.
        drift_every: every N steps, the same batch's loss in fp32 beside the mixed one (0: off;
            the Trainer runs it, since it has the batch).

    Example:
        >>> DiagnosticsConfig(gradient_stats_every=10, trace_overflow=True).enabled
        True
    """

    gradient_stats_every: int = 0
    trace_overflow: bool = False
    trace_threshold: float = 0.5
    drift_every: int = 0

    def __post_init__(self) -> None:
        for name in ("gradient_stats_every", "drift_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an int >= 0 (0 switches it off), got {v!r}")
        if not isinstance(self.trace_overflow, bool):
            raise ValueError(f"trace_overflow must be True or False, got {self.trace_overflow!r}")
        if not 0.0 < self.trace_threshold <= 1.0:
            raise ValueError(f"trace_threshold must be in (0, 1], got {self.trace_threshold!r}")

    @property
    def enabled(self) -> bool:
        """Whether anything is switched on."""
        return bool(self.gradient_stats_every or self.trace_overflow or self.drift_every)

    @classmethod
    def coerce(cls, value: DiagnosticsConfig | dict | None) -> DiagnosticsConfig:
        """A config from ``None``, a dict of its fields, or a config."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(f"unknown diagnostics option(s) {sorted(unknown)}; valid: "
                                 f"{', '.join(cls.__dataclass_fields__)}")
            return cls(**value)
        raise TypeError(f"diagnostics must be a DiagnosticsConfig, a dict or None, got {type(value).__name__}")


class Monitor:
    """The diagnostics of one model during training.

    Args:
        config: what to run.
        model: the user's (unwrapped) model.
        scaler: the run's loss scaler, if any (read for the "at scale" statistics).
    """

    def __init__(self, config: DiagnosticsConfig, model: torch.nn.Module, scaler: Any = None) -> None:
        self.config = config
        self.stats = GradientStats(model, every_n_steps=config.gradient_stats_every or None,
                                   scale_source=scaler if scaler is not None else None)
        self.tracer = OverflowTracer(model, threshold=config.trace_threshold, enabled=config.trace_overflow)
        self.last_event: TraceEvent | None = None

    def before_step(self, step: int, grads_scaled_by: Any) -> None:
        """Observe the gradients about to be applied (``grads_scaled_by``: the scale they carry)."""
        self.stats.observe(step, grads_are_scaled_by=grads_scaled_by)

    def after_step(self, step: int) -> TraceEvent | None:
        """Close the step for the tracer; returns its event, if any. Syncs while tracing."""
        if not self.tracer.enabled:
            return None
        event = self.tracer.end_step(step)
        if event is not None:
            self.last_event = event
        return event

    def blame(self) -> str:
        """The tracer's culprit, in words (or why there is none)."""
        e = self.last_event
        if e is None:
            return ("no module was traced as overflowing" if self.tracer.enabled
                    else "turn on trace_overflow to name the overflowing module")
        what = "output" if e.kind == "forward" else "gradient"
        return (f"the first overflow is in module `{e.module_path}` ({what} in {e.dtype}, max |x| = {e.max_abs:g}, "
                f"step {e.step})")

    def log_values(self) -> dict[str, Any]:
        """Values for a training log line: worst fp16 flush fractions and the last overflow. Syncs."""
        out: dict[str, Any] = {}
        if self.stats.enabled:
            summary = self.stats.summary()
            if summary:
                worst = max(summary.items(), key=lambda kv: kv[1]["fp16_flush_unscaled"])
                out["grad_fp16_flush"] = round(worst[1]["fp16_flush_unscaled"], 6)
                out["grad_fp16_flush_at_scale"] = round(max(v["fp16_flush_at_scale"] for v in summary.values()), 6)
                out["grad_fp16_flush_worst_module"] = worst[0]
            self.stats.clear()
        if self.last_event is not None:
            out["overflow_module"] = self.last_event.module_path
        return out

    def remove(self) -> None:
        """Detach the tracer's hooks."""
        self.tracer.remove()
