"""What happens when the fp16 loss scale collapses: raise, or switch the run to a safer precision."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .hardware import detect_capability
from .precision import resolve_precision
from .scaler import LossScaleCollapse

if TYPE_CHECKING:  # pragma: no cover
    from .accelerator import Accelerator

__all__ = ["on_loss_scale_collapse", "switch_precision"]

_log = logging.getLogger("mixprec")


def on_loss_scale_collapse(acc: Accelerator, error: LossScaleCollapse) -> None:
    """Raise ``error`` (with the tracer's culprit), or fall back as ``acc.on_loss_scale_collapse`` says."""
    blame = acc.monitor.blame() if acc.monitor is not None else \
        "turn on diagnostics (trace_overflow=True) to name the overflowing module"
    if acc.on_loss_scale_collapse == "raise":
        raise LossScaleCollapse(f"{error} Tracer: {blame}.") from None
    # The skipped steps changed neither the parameters nor the optimizer state: they are
    # the last applied state already. Drop the overflowing gradients and switch precision.
    native = detect_capability(acc.device).is_native("bf16-mixed")
    target = "bf16-mixed" if native else "fp32"
    before = acc.policy.name
    for o in acc._optimizers:
        o.optimizer.zero_grad(set_to_none=True)
    switch_precision(acc, target)
    acc.precision_fallbacks.append({"step": acc.optimizer_steps, "from": before, "to": target})
    _log.warning(
        "mixprec: the fp16 loss scale collapsed at step %d; switching this run from %s to %s (%s) and "
        "continuing from the last applied step; %s.", acc.optimizer_steps, before, target,
        "bf16 is native here, with fp32's range" if native else "this device has no native bf16", blame)


def switch_precision(acc: Accelerator, name: str) -> None:
    """Run the rest of training in ``name`` (the models' forwards follow; no loss scaler)."""
    acc.policy = resolve_precision(name, acc.device)
    acc.scaler = None
    for m in acc._models:
        inner = acc.unwrap_model(m)
        if hasattr(inner, "_mixprec_autocast"):
            _, device, cast = inner._mixprec_autocast
            inner._mixprec_autocast = (acc.policy, device, cast)

