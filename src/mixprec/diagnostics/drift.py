"""How far a batch's loss under mixed precision drifts from the same loss in fp32.

:func:`precision_drift` runs one batch twice without gradients, once in fp32 and once under the
given autocast, and compares the losses. It must leave the training run exactly as it was: the
model's modes, buffers and parameters, and every RNG stream (so dropout draws later in the run
are the ones a run without drift checks would make). It runs in eval mode, so batch-norm
running statistics are not updated and dropout is off.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable
from typing import Any

import torch

from mixprec.models import extract_loss
from mixprec.nested import tree_map

__all__ = ["precision_drift"]


def precision_drift(
    model: torch.nn.Module,
    batch: Any,
    compute_loss: Callable[[torch.nn.Module, Any], Any],
    autocast: contextlib.AbstractContextManager | Callable[[], contextlib.AbstractContextManager],
) -> dict[str, float]:
    """The loss of one batch in fp32 and under ``autocast``, and their relative difference. Syncs once.

    Both passes run in ``torch.no_grad()`` and eval mode, from the same RNG state, inside
    ``torch.random.fork_rng``: on return the model's train/eval flags and the CPU (and the
    model's CUDA devices') RNG states are what they were, so a training run that calls this
    stays bit-for-bit the run that does not. The fp32 pass disables autocast and uses the
    parameters as they are; when some are not float32 (bf16-true training) it runs on a float32
    copy of the model (a full copy: memory), with floating batch tensors cast to float32.

    Args:
        model: the model, as trained.
        batch: what ``compute_loss`` takes.
        compute_loss: ``compute_loss(model, batch)`` returning the loss: a scalar tensor, a number,
            or an output with ``.loss`` / ``["loss"]``.
        autocast: the mixed-precision context, e.g. ``torch.autocast("cpu", dtype=torch.bfloat16)``,
            or a callable returning one (``accelerator.autocast``).

    Returns:
        ``{"loss_fp32", "loss_mixed", "rel_diff"}``, with ``rel_diff = |mixed - fp32| / |fp32|``.

    Raises:
        RuntimeError: when called inside an autocast region: casts made there under ``no_grad``
            would land in autocast's weight cache and reach the training forward without their
            gradient history. Call it outside ``with autocast``.

    Example:
        >>> model = torch.nn.Linear(8, 1)
        >>> x, y = torch.randn(16, 8), torch.randn(16, 1)
        >>> out = precision_drift(model, (x, y), lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
        ...                       torch.autocast("cpu", dtype=torch.bfloat16))
        >>> out["rel_diff"] < 0.1
        True
    """
    tensors = list(model.parameters()) + list(model.buffers())
    device_types = {t.device.type for t in tensors} or {"cpu"}
    for dt in sorted(device_types):
        if _autocast_available(dt) and torch.is_autocast_enabled(dt):
            raise RuntimeError(
                f"precision_drift() was called inside an autocast region for {dt!r}; call it outside "
                "`with autocast(...)` (between steps): its no_grad casts would otherwise be cached and "
                "reused by the training forward without their gradient history"
            )
    needs_copy = any(t.is_floating_point() and t.dtype != torch.float32 for t in tensors)
    modes = [(m, m.training) for m in model.modules()]
    fork_devices, fork_type = _rng_devices(tensors)
    try:
        with torch.random.fork_rng(devices=fork_devices, device_type=fork_type), torch.no_grad():
            model.eval()
            with torch.random.fork_rng(devices=fork_devices, device_type=fork_type):  # same draws for both
                loss_fp32 = _fp32_loss(model, batch, compute_loss, device_types, needs_copy)
            with _enter(autocast):
                loss_mixed = _loss_tensor(compute_loss(model, batch))
            both = torch.stack([loss_fp32.to(loss_mixed.device), loss_mixed]).cpu().tolist()
    finally:
        for m, training in modes:
            m.training = training
    ref, mixed = both
    if ref == 0.0:
        rel = 0.0 if mixed == 0.0 else math.inf
    else:
        rel = abs(mixed - ref) / abs(ref)
    return {"loss_fp32": ref, "loss_mixed": mixed, "rel_diff": rel}


def _fp32_loss(model, batch, compute_loss, device_types, needs_copy) -> torch.Tensor:
    with contextlib.ExitStack() as stack:
        for dt in sorted(device_types):
            if _autocast_available(dt):
                stack.enter_context(torch.autocast(dt, enabled=False))
        if needs_copy:
            # The copy keeps the model's hooks: an OverflowTracer sees this pass as well.
            return _loss_tensor(compute_loss(copy.deepcopy(model).float(), _to_float32(batch)))
        return _loss_tensor(compute_loss(model, batch))


def _enter(autocast: Any) -> contextlib.AbstractContextManager:
    if hasattr(autocast, "__enter__"):
        return autocast
    if callable(autocast):
        return autocast()
    raise TypeError(
        f"autocast must be a context manager (torch.autocast(...)) or a callable returning one, "
        f"got {type(autocast).__name__}"
    )


def _loss_tensor(out: Any) -> torch.Tensor:
    """The loss in ``out`` as a 0-d float32 tensor: a number, a one-element tensor, or a model
    output holding one (found as everywhere else, by :func:`mixprec.models.extract_loss`)."""
    loss = out if isinstance(out, (torch.Tensor, int, float)) else extract_loss(out)
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        return torch.tensor(float(loss))
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            "compute_loss(model, batch) must return a scalar loss: a one-element tensor, a number, or an "
            f"output with .loss or ['loss']; got {type(out).__name__}"
        )
    return loss.detach().float().reshape(())


def _to_float32(batch: Any) -> Any:
    return tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, batch)


def _rng_devices(tensors: list[torch.Tensor]) -> tuple[list[int], str]:
    """The accelerator devices whose RNG ``fork_rng`` must save (the CPU's is always saved)."""
    for dt in ("cuda", "xpu", "mps"):
        indices = {t.device.index for t in tensors if t.device.type == dt}
        if indices:
            module = getattr(torch, dt)
            current = module.current_device() if hasattr(module, "current_device") else 0
            return sorted(current if i is None else i for i in indices), dt
    return [], "cuda"


def _autocast_available(device_type: str) -> bool:
    check = getattr(torch.amp, "is_autocast_available", None)
    return check(device_type) if check is not None else device_type in ("cpu", "cuda")
