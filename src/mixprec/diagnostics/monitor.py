"""Diagnostics attached to a training run: what the Accelerator and the Trainer switch on.

A :class:`Monitor` owns a :class:`GradientStats` and an :class:`OverflowTracer` per model
and is called around each optimizer step. It observes only: with it on, the run's
numbers are bit for bit those of the run without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mixprec.diagnostics.gradient_stats import GradientStats
from mixprec.diagnostics.tracer import OverflowTracer, TraceEvent

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
    """The diagnostics of every model of a training run.

    Each watched model has its own :class:`GradientStats` and :class:`OverflowTracer`; the
    owner (Accelerator, Trainer) calls :meth:`before_step` / :meth:`after_step` around the step
    of the optimizer that holds a model's parameters, naming that model.

    Args:
        config: what to run.
        model: the user's (unwrapped) first model, if any; :meth:`watch` adds others.
        scaler: the run's loss scaler, if any (read for the "at scale" statistics).

    Example:
        >>> monitor = Monitor(DiagnosticsConfig(gradient_stats_every=1), torch.nn.Linear(2, 1))
        >>> monitor.watch(torch.nn.Linear(1, 1))
        >>> len(monitor.models)
        2
    """

    def __init__(self, config: DiagnosticsConfig, model: torch.nn.Module | None = None, scaler: Any = None) -> None:
        self.config = config
        self.scaler = scaler
        self._stats: list[GradientStats] = []
        self._tracers: list[OverflowTracer] = []
        self.models: list[torch.nn.Module] = []
        self.last_event: TraceEvent | None = None
        if model is not None:
            self.watch(model)

    def use_scaler(self, scaler: Any) -> None:
        """Read ``scaler``'s scale from now on (the run's loss scaler was replaced)."""
        self.scaler = scaler
        for stats in self._stats:
            stats.scale_source = scaler

    def watch(self, model: torch.nn.Module) -> None:
        """Observe ``model`` too (a model already watched is not added twice)."""
        if any(m is model for m in self.models):
            return
        self.models.append(model)
        self._stats.append(GradientStats(model, every_n_steps=self.config.gradient_stats_every or None,
                                         scale_source=self.scaler))
        self._tracers.append(OverflowTracer(model, threshold=self.config.trace_threshold,
                                            enabled=self.config.trace_overflow))

    def _indices(self, models: list[torch.nn.Module] | None) -> list[int]:
        if models is None:
            return list(range(len(self.models)))
        return [i for i, m in enumerate(self.models) if any(m is w for w in models)]

    @property
    def stats(self) -> GradientStats:
        """The first model's gradient statistics."""
        return self._stats[0]

    @property
    def events(self) -> list[TraceEvent]:
        """Every watched model's overflow events, by step. No sync."""
        return sorted((e for t in self._tracers for e in t.events), key=lambda e: e.step)

    def before_step(self, step: int, grads_scaled_by: Any, models: list[torch.nn.Module] | None = None) -> None:
        """Observe the gradients of ``models`` (default: all) about to be applied
        (``grads_scaled_by``: the scale they carry)."""
        for i in self._indices(models):
            self._stats[i].observe(step, grads_are_scaled_by=grads_scaled_by)

    def after_step(self, step: int, models: list[torch.nn.Module] | None = None) -> TraceEvent | None:
        """Close the step for the tracers of ``models`` (default: all); returns the first event, if
        any. Syncs while tracing."""
        first = None
        for i in self._indices(models):
            if self._tracers[i].enabled:
                event = self._tracers[i].end_step(step)
                first = first or event
        if first is not None:
            self.last_event = first
        return first

    def blame(self) -> str:
        """The tracer's culprit, in words (or why there is none)."""
        e = self.last_event
        if e is None:
            return ("no module was traced as overflowing" if self.config.trace_overflow
                    else "turn on trace_overflow to name the overflowing module")
        what = "output" if e.kind == "forward" else "gradient"
        return (f"the first overflow is in module `{e.module_path}` ({what} in {e.dtype}, max |x| = {e.max_abs:g}, "
                f"step {e.step})")

    def summary(self) -> dict[str, dict[str, float]]:
        """Every watched model's :meth:`GradientStats.summary` in one dict; the modules of the second
        and later models are named ``model<i>.<path>``. Syncs."""
        out: dict[str, dict[str, float]] = {}
        for i, stats in enumerate(self._stats):
            if stats.enabled:
                out.update({(f"model{i}.{k}" if i else k): v for k, v in stats.summary().items()})
        return out

    def log_values(self) -> dict[str, Any]:
        """Values for a training log line: worst fp16 flush fractions and the last overflow. Syncs.

        Modules of the second and later models are named ``model<i>.<path>``.
        """
        out: dict[str, Any] = {}
        summary = self.summary()
        for stats in self._stats:
            stats.clear()
        if summary:
            worst = max(summary.items(), key=lambda kv: kv[1]["fp16_flush_unscaled"])
            out["grad_fp16_flush"] = round(worst[1]["fp16_flush_unscaled"], 6)
            out["grad_fp16_flush_at_scale"] = round(max(v["fp16_flush_at_scale"] for v in summary.values()), 6)
            out["grad_fp16_flush_worst_module"] = worst[0]
        if self.last_event is not None:
            out["overflow_module"] = self.last_event.module_path
        return out

    def remove(self) -> None:
        """Detach the tracers' hooks."""
        for t in self._tracers:
            t.remove()
