"""What a run falls back to when its fp16 loss scale collapses, and the one log line that says so."""

from __future__ import annotations

import logging

import torch

from mixprec.hardware import detect_capability
from mixprec.precision import PrecisionPlugin

__all__ = ["fallback_target", "log_fallback"]

_log = logging.getLogger("mixprec")


def fallback_target(plugin: PrecisionPlugin, device: torch.device) -> tuple[str, str]:
    """The precision ``plugin`` falls back to on ``device``, and why, in words.

    Raises:
        ValueError: when the precision has nothing to fall back to.
    """
    native = detect_capability(device).is_native("bf16-mixed")
    target = plugin.fallback_precision(native)
    if target is None:
        raise ValueError(f"{plugin.policy.name} has no precision to fall back to")
    why = "bf16 is native here, with fp32's range" if native else "this device has no native bf16"
    return target, why


def log_fallback(step: int, before: str, target: str, why: str, blame: str) -> None:
    """Say, in one log line, that the run switched from ``before`` to ``target`` at ``step``."""
    _log.warning(
        "mixprec: the fp16 loss scale collapsed at step %d; switching this run from %s to %s (%s) and "
        "continuing from the last applied step; %s.", step, before, target, why, blame)
