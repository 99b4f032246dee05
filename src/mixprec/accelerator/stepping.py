"""The prepared optimizers' step, and the precision the run is in.

A prepared optimizer's ``step()`` and ``zero_grad()`` and a prepared model's forward reach these
parts, never the Accelerator: nothing the Accelerator hands out holds it (or its list of prepared
objects) back. So dropping an Accelerator and what it prepared frees them at once, by reference
counting, as in Accelerate, rather than when the garbage collector next runs (until then a GPU's
memory stays taken); and ``Accelerator().prepare(model, optimizer)`` with the Accelerator never
named still trains, in the precision it was made with.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from mixprec.accelerator.state import AcceleratorState, GradientState
from mixprec.precision import PrecisionConfig, PrecisionPlugin, PrecisionPolicy, accelerate_name, make_plugin
from mixprec.precision.fallback import fallback_target, log_fallback
from mixprec.precision.scaler import LossScaleCollapse

if TYPE_CHECKING:
    from mixprec.accelerator.audit import PrecisionAudit
    from mixprec.accelerator.wrappers import AcceleratedOptimizer
    from mixprec.diagnostics.monitor import Monitor

__all__ = ["CurrentPrecision", "OptimizerSteps", "accelerate_word", "build_precision"]


def accelerate_word(policy: PrecisionPolicy) -> str:
    """The precision in Accelerate's words (the names table's); bf16-true, which Accelerate has no
    name for, in mixprec's."""
    return accelerate_name(policy.name) or policy.name


def build_precision(precision: Any, device: torch.device, config: PrecisionConfig, *, sharded: bool) -> PrecisionPlugin:
    """The plugin for ``precision``, told whether ``prepare`` shards the models (fp8's all-gather)."""
    plugin = make_plugin(precision, device, config)
    plugin.sharded = sharded
    return plugin


def _gone() -> None:
    """A reference to prepared objects no longer there."""
    return None


class CurrentPrecision:
    """The run's precision plugin, which the prepared models and optimizers read at each call:
    switching the run's precision is one assignment to :attr:`plugin`. Calling it returns it."""

    __slots__ = ("plugin",)

    def __init__(self, plugin: PrecisionPlugin) -> None:
        self.plugin = plugin

    def __call__(self) -> PrecisionPlugin:
        return self.plugin


class OptimizerSteps:
    """What a prepared optimizer's ``step()`` and ``zero_grad()`` do (the Accelerator's step):
    nothing on accumulation steps that don't sync; else the precision's step (unscale, inf/NaN
    check, step or skip, the scale's update), the diagnostics around it, the count of steps, and
    the fallback to another precision where the loss scale collapses.

    Args:
        current: the run's precision (switched here on a fallback).
        gradient_state: whether this micro-batch syncs.
        prepared: the Accelerator's ``PreparedObjects`` (held weakly: the optimizers hold this part).
        audit: the precision audit, shown the gradients before the first step.
        state: the Accelerator's ``state``, whose ``mixed_precision`` follows a fallback.
        precision_config: what the precision does beyond its name (``on_loss_scale_collapse``).
        device: the run's device.
        sharded: whether ``prepare`` shards the models (a fallback's plugin is told).
    """

    def __init__(self, *, current: CurrentPrecision, gradient_state: GradientState, prepared: Any,
                 audit: PrecisionAudit, state: AcceleratorState, precision_config: PrecisionConfig,
                 device: torch.device, sharded: bool) -> None:
        self.current, self.gradient_state, self.audit, self.state = current, gradient_state, audit, state
        self._prepared = weakref.ref(prepared)
        self.precision_config, self.device, self.sharded = precision_config, device, sharded
        #: The diagnostics' monitor, made by the first model prepared with diagnostics on.
        self.monitor: Monitor | None = None
        #: Steps taken, applied or skipped, counted by the first prepared optimizer.
        self.count = 0
        #: The precision switches of this run: ``{"step", "from", "to"}`` each.
        self.fallbacks: list[dict[str, Any]] = []

    def __getstate__(self) -> dict[str, Any]:  # (pickled and copied with the Accelerator: a weakref cannot be)
        state = self.__dict__.copy()
        state["_prepared"] = self._prepared()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        prepared = state.pop("_prepared")
        self.__dict__.update(state)
        self._prepared = _gone if prepared is None else weakref.ref(prepared)

    def _optimizers(self) -> list[AcceleratedOptimizer]:
        prepared = self._prepared()
        return [] if prepared is None else prepared.optimizers

    def step(self, wrapped: AcceleratedOptimizer, closure: Any) -> Any:
        """``wrapped.step(closure)``: the whole step, or nothing on accumulation steps that don't sync."""
        if not self.gradient_state.sync_gradients:  # (read directly: this runs on every step)
            return None
        optimizers = self._optimizers()
        first = bool(optimizers) and wrapped is optimizers[0]
        precision = self.current.plugin
        self.audit.observe_gradients(wrapped.optimizer)
        models = self._observe_before_step(wrapped, precision)
        out = None
        try:
            out = precision.optimizer_step(wrapped.optimizer, closure)
            if precision.steps is None:  # no inf/NaN check in this precision: the step was applied
                wrapped.mark_skipped(False)
        except LossScaleCollapse as error:
            self.on_collapse(error, wrapped)
        if wrapped.original_optimizer is not wrapped.optimizer:
            # A scheduler built on the user's optimizer checks that *it* stepped (torch's flag).
            wrapped.original_optimizer._opt_called = True
        if self.monitor is not None:
            self.monitor.after_step(self.count, models)
        self.count += first
        return out

    def zero_grad(self, wrapped: AcceleratedOptimizer, set_to_none: bool) -> None:
        """``wrapped.zero_grad()``: on accumulation steps the gradients keep adding up."""
        if self.gradient_state.sync_gradients:
            self.current.plugin.zero_grad(wrapped.optimizer, set_to_none=set_to_none)

    def _observe_before_step(self, wrapped: AcceleratedOptimizer,
                             precision: PrecisionPlugin) -> list[torch.nn.Module] | None:
        """Hand the diagnostics the gradients of the models this optimizer steps; returns those models."""
        if self.monitor is None:
            return None
        held = {id(p) for g in wrapped.optimizer.param_groups for p in g["params"]}
        models = [m for m in self.monitor.models if any(id(p) in held for p in m.parameters())]
        self.monitor.before_step(self.count, precision.grads_scaled_by(wrapped.optimizer), models)
        return models

    def on_collapse(self, error: LossScaleCollapse, wrapped: AcceleratedOptimizer | None = None) -> None:
        """A loss-scale collapse: raised again with the tracer's culprit, or the run falls back
        (``on_loss_scale_collapse``). Called from the ``except`` of the step that found it."""
        if wrapped is not None:
            wrapped.mark_skipped()
        blame = self.monitor.blame() if self.monitor is not None else \
            "turn on diagnostics (trace_overflow=True) to name the overflowing module"
        if self.precision_config.on_loss_scale_collapse == "raise":
            raise LossScaleCollapse(f"{error} Tracer: {blame}.") from None
        # The skipped steps changed neither the parameters nor the optimizer state: they are
        # the last applied state already. Drop the overflowing gradients and switch precision.
        target, why = fallback_target(self.current.plugin, self.device)
        before = self.current.plugin.policy.name
        optimizers = self._optimizers() or ([wrapped] if wrapped is not None else [])
        for o in optimizers:
            o.optimizer.zero_grad(set_to_none=True)
        self.switch(target, optimizers)
        self.fallbacks.append({"step": self.count, "from": before, "to": target})
        log_fallback(self.count, before, target, why, blame)

    def switch(self, name: str, optimizers: list[AcceleratedOptimizer] | None = None) -> None:
        """Run the rest of training in ``name``: one assignment, which every prepared model and
        optimizer reads at its next call (``optimizers``: those the new precision steps; default
        the prepared ones)."""
        self.current.plugin.release()
        # The loss scaler stays behind: the precisions a run falls back to need none.
        plugin = build_precision(name, self.device, self.precision_config.replace(loss_scaler=None),
                                 sharded=self.sharded)
        self.current.plugin = plugin
        self.state.mixed_precision = accelerate_word(plugin.policy)
        for o in self._optimizers() if optimizers is None else optimizers:
            plugin.track_optimizer(o.optimizer)
