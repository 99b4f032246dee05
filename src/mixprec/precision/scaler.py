"""Dynamic loss scaling with hysteresis, bounds, collapse detection and accounting.

:class:`LossScaler` is a :class:`torch.amp.GradScaler` (same constructor, same methods, same
kernels: ``_amp_foreach_non_finite_check_and_unscale_`` for the finite check and unscale,
``_amp_update_scale_`` for the scale update) with what GradScaler lacks for long fp16 runs.

The update rule, per ``update()`` (one "iteration", whatever the number of optimizers):

* no inf/NaN found: the growth tracker counts up; when it reaches ``growth_interval`` the scale
  is multiplied by ``growth_factor`` (capped at ``max_scale``), the tracker restarts and the
  hysteresis counter is refilled to ``hysteresis``;
* inf/NaN found: the tracker restarts; if the hysteresis counter is above 1 it is decremented
  and the scale kept (DeepSpeed's ``hysteresis``: overflows tolerated before backing off),
  else the scale is multiplied by ``backoff_factor`` (floored at ``min_scale``).

With ``hysteresis=1`` and no bounds this is exactly GradScaler's rule.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import torch
from torch.amp import GradScaler
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

__all__ = ["LossScaler", "LossScaleCollapse"]


class LossScaleCollapse(RuntimeError):
    """Too many optimizer steps in a row were skipped for inf/NaN gradients."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


class LossScaler(GradScaler):
    """A dynamic loss scaler with GradScaler's API, plus hysteresis, bounds and accounting.

    Nothing here syncs the host with the device per step: the scale, growth tracker,
    hysteresis counter, found-inf flags and skip counters are device tensors. Reading them
    (``get_scale``, ``skipped_steps``, ``last_step_applied`` ...) syncs, and says so. Two
    exceptions, both GradScaler's own: an optimizer without a fused, scale-aware ``step`` (torch's
    ``fused=True`` Adam/AdamW/SGD have one) needs one read of the found-inf flag to decide whether
    to call ``step()``; and ``max_consecutive_skips``, when set, reads the skip counter once per
    ``update()``. What a read tells is kept on the host: after the found-inf read, neither
    ``last_step_applied`` nor the skip-counter check reads again; after the skip-counter read,
    ``last_step_applied`` does not.

    Args:
        device: device type of the gradients (``"cuda"``, ``"cpu"``, ...). ``None`` (the default)
            means CUDA when available, else the CPU; GradScaler instead defaults to ``"cuda"`` and
            silently disables itself without CUDA, which this class refuses to do.
        init_scale: initial scale.
        growth_factor: factor (> 1) the scale grows by after ``growth_interval`` good steps.
        backoff_factor: factor (in (0, 1)) the scale shrinks by on an overflow.
        growth_interval: consecutive good steps before the scale grows.
        enabled: ``False`` makes every method a no-op (``step`` just calls ``optimizer.step()``).
        hysteresis: overflows tolerated before the scale backs off (1 = back off on each).
        min_scale: floor for the scale (``None``: no floor).
        max_scale: ceiling for the scale (``None``: no ceiling).
        max_consecutive_skips: raise :class:`LossScaleCollapse` after this many skipped steps in
            a row (``None``: never).
        history_size: how many (scale, skipped) pairs ``scale_history`` keeps.

    Example:
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = LossScaler("cpu", init_scale=1024.0)
        >>> with torch.autocast("cpu", dtype=torch.float16):
        ...     loss = model(torch.randn(8, 4)).float().pow(2).mean()
        >>> scaler.scale(loss).backward()
        >>> scaler.step(opt); scaler.update()
        >>> scaler.last_step_applied
        True
    """

    def __init__(
        self,
        device: str | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        max_consecutive_skips: int | None = None,
        history_size: int = 10_000,
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device).type
        if device == "cuda" and enabled and not torch.cuda.is_available():
            raise ValueError(
                "LossScaler(device='cuda') but CUDA is not available; pass device='cpu' "
                "(fp16 autocast and loss scaling work on the CPU) or leave device unset"
            )
        _check(isinstance(enabled, bool), f"enabled must be True or False, got {enabled!r}")
        _check(_finite_pos(init_scale), f"init_scale must be a finite number > 0, got {init_scale!r}")
        _check(_finite_pos(growth_factor) and growth_factor > 1.0,
               f"growth_factor must be > 1.0 (2.0 doubles the scale), got {growth_factor!r}")
        _check(_finite_pos(backoff_factor) and backoff_factor < 1.0,
               f"backoff_factor must be in (0, 1) (0.5 halves the scale), got {backoff_factor!r}")
        _check(_pos_int(growth_interval), f"growth_interval must be an int >= 1, got {growth_interval!r}")
        _check(_pos_int(hysteresis), f"hysteresis must be an int >= 1 (1 = back off on every overflow), got {hysteresis!r}")
        _check(min_scale is None or _finite_pos(min_scale), f"min_scale must be None or a number > 0, got {min_scale!r}")
        _check(max_scale is None or _finite_pos(max_scale), f"max_scale must be None or a number > 0, got {max_scale!r}")
        if min_scale is not None and max_scale is not None:
            _check(min_scale <= max_scale, f"min_scale ({min_scale}) must be <= max_scale ({max_scale})")
        if min_scale is not None:
            _check(init_scale >= min_scale, f"init_scale ({init_scale}) is below min_scale ({min_scale}); raise init_scale")
        if max_scale is not None:
            _check(init_scale <= max_scale, f"init_scale ({init_scale}) is above max_scale ({max_scale}); lower init_scale")
        _check(max_consecutive_skips is None or _pos_int(max_consecutive_skips),
               f"max_consecutive_skips must be None or an int >= 1, got {max_consecutive_skips!r}")
        _check(_pos_int(history_size), f"history_size must be an int >= 1, got {history_size!r}")
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        self._hysteresis = hysteresis
        self._min_scale = min_scale
        self._max_scale = max_scale
        self._max_consecutive_skips = max_consecutive_skips
        self._history_size = history_size
        self._total_steps = 0
        # Device-side state, created with the scale on the first scale() call.
        self._hysteresis_counter: torch.Tensor | None = None
        self._skipped: torch.Tensor | None = None
        self._consecutive: torch.Tensor | None = None
        self._last_found_inf: torch.Tensor | None = None
        # What host reads already told, so that nothing is read twice: None = unknown on the host.
        self._last_overflow_on_host: bool | None = None
        self._consecutive_on_host: int | None = None  # set with the counters
        self._history: collections.deque[torch.Tensor] = collections.deque(maxlen=history_size)
        self._pending_counters: dict[str, int] = {}

    # -- state on the device -------------------------------------------------------------
    def _init_counters(self, dev: torch.device) -> None:
        # Created beside GradScaler's scale, on the first scale() (or update(), for a scale made
        # some other way), from what load_state_dict left pending.
        pending = self._pending_counters
        self._hysteresis_counter = torch.full((), pending.get("hysteresis_counter", self._hysteresis),
                                              dtype=torch.int32, device=dev)
        self._skipped = torch.full((), pending.get("skipped_steps", 0), dtype=torch.int64, device=dev)
        self._consecutive = torch.full((), pending.get("consecutive_skips", 0), dtype=torch.int64, device=dev)
        self._consecutive_on_host = pending.get("consecutive_skips", 0)
        self._pending_counters = {}
        # A history loaded or unpickled before the scale existed was made on the CPU: on the scale's
        # device, beside what update() adds to it (scale_history stacks them all).
        self._history = collections.deque((h.to(dev) for h in self._history), maxlen=self._history_size)

    def scale(self, outputs: Any) -> Any:
        """Multiply ``outputs`` (a tensor or nested tensors) by the scale; GradScaler's ``scale``. No sync."""
        out = super().scale(outputs)
        if self._enabled and self._skipped is None and self._scale is not None:
            self._init_counters(self._scale.device)
        return out

    def get_scale_tensor(self) -> torch.Tensor:
        """The scale as a device tensor (GradScaler's ``get_scale`` reads it into a float; this does not sync)."""
        if self._scale is None:
            return torch.full((), self._init_scale, dtype=torch.float32, device=self._device)
        return self._scale

    def skipped_steps_tensor(self) -> torch.Tensor:
        """:attr:`skipped_steps` as a 0-dim device tensor (int64), for a log that reads it later. No sync."""
        if self._skipped is None:
            return torch.full((), self._pending_counters.get("skipped_steps", 0), dtype=torch.int64,
                              device=self.get_scale_tensor().device)
        return self._skipped

    # -- where each optimizer stands in this iteration (no sync) --------------------------
    def is_unscaled(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s gradients were unscaled (``unscale_`` or ``step``) since the last ``update()``."""
        state = self._per_optimizer_states.get(id(optimizer))
        return state is not None and state["stage"] is not OptState.READY

    def has_stepped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``step(optimizer)`` was called since the last ``update()``."""
        state = self._per_optimizer_states.get(id(optimizer))
        return state is not None and state["stage"] is OptState.STEPPED

    def found_inf(self, optimizer: torch.optim.Optimizer) -> tuple[torch.Tensor | None, bool | None]:
        """``optimizer``'s inf/NaN check since the last ``update()``: a device flag (> 0 when found;
        ``None`` before its check) and, where a read already told it, the host's answer. No sync."""
        state = self._per_optimizer_states.get(id(optimizer))
        flags = list(state["found_inf_per_device"].values()) if state is not None else []
        if not flags:
            return None, None
        flag = flags[0] if len(flags) == 1 else torch.stack([f.to(flags[0].device) for f in flags]).sum()
        return flag, state.get("found_inf_on_host")

    def _maybe_opt_step(self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any],
                        *args: Any, **kwargs: Any) -> Any:
        # GradScaler's step-or-skip for an optimizer without a fused step: its one read of the
        # found-inf flag (a sync), whose answer is kept for update() and found_inf(). A private
        # hook of torch's: test_scaler's contract test names the torch version if it changes.
        found = sum(v.item() for v in optimizer_state["found_inf_per_device"].values())
        optimizer_state["found_inf_on_host"] = bool(found)
        return None if found else optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale from this iteration's inf/NaN checks (see the module docstring for the rule).

        Call once per iteration, after ``step()`` for every optimizer. No host-device sync, unless
        ``max_consecutive_skips`` is set: one read of the skip counter, none where every optimizer's
        ``step()`` already read its found-inf flag (optimizers without a fused step).

        Raises:
            LossScaleCollapse: after ``max_consecutive_skips`` skipped steps in a row.
        """
        if not self._enabled:
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        if self._skipped is None:
            self._init_counters(scale.device)
        if new_scale is not None:
            super().update(new_scale)
            return
        checked = [state for state in self._per_optimizer_states.values() if state["found_inf_per_device"]]
        found_infs = [f.to(device=scale.device, non_blocking=True)
                      for state in checked for f in state["found_inf_per_device"].values()]
        # Known without a sync where every optimizer's step already read its flag (none fused).
        on_host = [state.get("found_inf_on_host") for state in checked]
        overflow_on_host = any(on_host) if on_host and None not in on_host else None
        if not found_infs:
            raise RuntimeError(
                "update() found no inf/NaN checks for this iteration; call scaler.step(optimizer) "
                "(or scaler.unscale_(optimizer)) before scaler.update()"
            )
        # One optimizer on one device (the common case) needs no reduction: its flag is 0 or 1.
        found = found_infs[0] if len(found_infs) == 1 else torch.stack(found_infs).sum().clamp_(max=1.0)
        overflow = found > 0
        found_for_kernel = found
        if self._hysteresis > 1:  # a Python constant: hysteresis=1 costs nothing here
            tolerated = overflow & (self._hysteresis_counter > 1)
            # A tolerated overflow must restart the growth tracker without backing off. The
            # kernel only backs off on found_inf, and grows when tracker + 1 == interval, so
            # start the tracker at -1 there: it lands on 0 with the scale unchanged.
            tracker.copy_(torch.where(tolerated, torch.full_like(tracker, -1), tracker))
            found_for_kernel = found * (~tolerated)
        torch._amp_update_scale_(
            scale, tracker, found_for_kernel, self._growth_factor, self._backoff_factor, self._growth_interval
        )
        if self._min_scale is not None or self._max_scale is not None:
            scale.clamp_(min=self._min_scale, max=self._max_scale)
        if self._hysteresis > 1:
            grew = (~overflow) & (tracker == 0)
            counter = self._hysteresis_counter
            refill = torch.full_like(counter, self._hysteresis)
            counter.copy_(torch.where(tolerated, counter - 1, torch.where(grew, refill, counter)))
        # In place and allocation-free: these run every step.
        self._skipped.add_(overflow)
        self._consecutive.add_(1).mul_(overflow)
        self._last_found_inf = overflow
        self._last_overflow_on_host = overflow_on_host
        if self._consecutive_on_host is not None:
            self._consecutive_on_host = None if overflow_on_host is None else \
                (self._consecutive_on_host + 1 if overflow_on_host else 0)
        self._history.append(torch.stack([scale, found.reshape(())]))  # stack copies: a snapshot
        self._total_steps += 1
        self._per_optimizer_states = collections.defaultdict(_refresh_per_optimizer_state)
        if self._max_consecutive_skips is not None:
            n = self._consecutive_on_host
            if n is None:
                n = self._consecutive_on_host = int(self._consecutive.item())
                self._last_overflow_on_host = n > 0  # the run of skips includes this step iff it overflowed
            if n >= self._max_consecutive_skips:
                raise LossScaleCollapse(
                    f"the loss scale collapsed: {n} optimizer steps in a row were skipped because the "
                    f"gradients held inf/NaN, and the scale has fallen to {scale.item():g}. The model "
                    "overflows fp16 even at a small scale. Fixes: train in bf16-mixed (fp32's range, no "
                    "loss scaling needed), lower the learning rate, or find the overflowing layer with "
                    "mixprec.diagnostics (trace_overflow=True)."
                )

    # -- accounting (each read syncs) --------------------------------------------------
    @property
    def last_step_applied(self) -> bool:
        """Whether the last iteration's optimizer step was applied (no inf/NaN). Syncs, unless a
        read in that iteration already told (an optimizer without a fused step, or the
        ``max_consecutive_skips`` check).

        Right for fused optimizers too: it is read from the same found-inf flags the fused
        kernels use to skip, not inferred from a change of scale. ``True`` before any step and
        when disabled.
        """
        if not self._enabled:
            return True
        if self._last_overflow_on_host is not None:  # told by a read, or restored with the state
            return not self._last_overflow_on_host
        return self._last_found_inf is None or not bool(self._last_found_inf.item())

    @property
    def total_steps(self) -> int:
        """Iterations seen by ``update()`` (applied and skipped). No sync."""
        return self._total_steps

    @property
    def skipped_steps(self) -> int:
        """Iterations whose step was skipped for inf/NaN. Syncs."""
        return self._read(self._skipped, "skipped_steps")

    @property
    def consecutive_skips(self) -> int:
        """Skipped iterations in a row, up to the last one. Syncs."""
        return self._read(self._consecutive, "consecutive_skips")

    @property
    def hysteresis_counter(self) -> int:
        """Overflows still tolerated before the next backoff. Syncs."""
        if self._hysteresis_counter is None:
            return self._pending_counters.get("hysteresis_counter", self._hysteresis)
        return int(self._hysteresis_counter.item())

    @property
    def scale_history(self) -> list[tuple[float, bool]]:
        """(scale after the update, whether that step was skipped) for the last ``history_size`` updates. Syncs."""
        if not self._history:
            return []
        rows = torch.stack(list(self._history)).cpu().tolist()
        return [(s, bool(f)) for s, f in rows]

    def _read(self, t: torch.Tensor | None, key: str) -> int:
        if not self._enabled:
            return 0
        return self._pending_counters.get(key, 0) if t is None else int(t.item())

    # -- checkpointing -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """GradScaler's state plus hysteresis, bounds, counters and history. Syncs."""
        if not self._enabled:
            return {}
        state = super().state_dict()
        state.update(
            hysteresis=self._hysteresis,
            hysteresis_counter=self.hysteresis_counter,
            min_scale=self._min_scale,
            max_scale=self._max_scale,
            max_consecutive_skips=self._max_consecutive_skips,
            total_steps=self._total_steps,
            skipped_steps=self.skipped_steps,
            consecutive_skips=self.consecutive_skips,
            last_step_applied=self.last_step_applied,
            scale_history=[list(r) for r in self.scale_history],
        )
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore every piece of state saved by :meth:`state_dict` (a GradScaler's dict works too)."""
        if not self._enabled:
            return
        super().load_state_dict(state_dict)
        self._hysteresis = int(state_dict.get("hysteresis", self._hysteresis))
        self._min_scale = state_dict.get("min_scale", self._min_scale)
        self._max_scale = state_dict.get("max_scale", self._max_scale)
        self._max_consecutive_skips = state_dict.get("max_consecutive_skips", self._max_consecutive_skips)
        self._total_steps = int(state_dict.get("total_steps", 0))
        counters = {
            "hysteresis_counter": int(state_dict.get("hysteresis_counter", self._hysteresis)),
            "skipped_steps": int(state_dict.get("skipped_steps", 0)),
            "consecutive_skips": int(state_dict.get("consecutive_skips", 0)),
        }
        self._consecutive_on_host = counters["consecutive_skips"]
        if self._scale is None:
            self._pending_counters = counters
        else:
            self._hysteresis_counter.fill_(counters["hysteresis_counter"])
            self._skipped.fill_(counters["skipped_steps"])
            self._consecutive.fill_(counters["consecutive_skips"])
        dev = self._scale.device if self._scale is not None else torch.device("cpu")
        self._history = collections.deque(
            (torch.tensor([float(s), float(f)], device=dev) for s, f in state_dict.get("scale_history", [])),
            maxlen=self._history_size,
        )
        applied = state_dict.get("last_step_applied")
        self._last_found_inf = None  # (the host's answer is the one read until the next update())
        self._last_overflow_on_host = None if applied is None else not applied

    def __getstate__(self) -> dict[str, Any]:
        # As GradScaler's: no device tensor is pickled; what they hold goes as host values (as in
        # state_dict), rebuilt on the scale's device when the unpickled scaler makes its scale.
        state = super().__getstate__()
        if self._enabled:
            state["_pending_counters"] = {
                "hysteresis_counter": self.hysteresis_counter,
                "skipped_steps": self.skipped_steps,
                "consecutive_skips": self.consecutive_skips,
            }
            state["_hysteresis_counter"] = state["_skipped"] = state["_consecutive"] = None
            state["_last_found_inf"] = None
            state["_last_overflow_on_host"] = not self.last_step_applied  # (False before any step)
            state["_history"] = collections.deque((torch.tensor([s, float(f)]) for s, f in self.scale_history),
                                                  maxlen=self._history_size)
        return state

    def __repr__(self) -> str:
        if not self._enabled:
            return "LossScaler(enabled=False)"
        return (
            f"LossScaler(device={self._device!r}, growth_factor={self._growth_factor}, "
            f"backoff_factor={self._backoff_factor}, growth_interval={self._growth_interval}, "
            f"hysteresis={self._hysteresis}, min_scale={self._min_scale}, max_scale={self._max_scale})"
        )


def _finite_pos(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _pos_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1
