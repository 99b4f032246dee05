"""The loss scaler's whole lifecycle over a run's optimizers: a component a precision plugin holds
where it scales the loss (fp16; bf16-mixed may opt in) or guards against inf/NaN steps (any
precision with ``skip_nonfinite_steps``: a scaler whose scale is pinned to 1).

The step, top to bottom: :meth:`backward` scales the loss; :meth:`unscale_gradients` divides an
optimizer's gradients by the scale they carry, once; :meth:`clip_gradients` unscales, then clips;
:meth:`optimizer_step` steps or skips on inf/NaN; :meth:`_close_iteration` updates the scale.

One iteration, one update, whatever the number of optimizers (torch's "multiple models, losses
and optimizers" recipe): the scale is updated once every prepared optimizer has stepped (or been
skipped) since the last update, so a second optimizer is never unscaled by a scale its gradients
were not made with. An optimizer that steps again before the others did (a critic stepped k
times per generator step) closes the iteration first, as torch requires; gradients that other
optimizers still hold then carry the old scale, and are multiplied by new/old (a power of two:
exact) before they are unscaled or added to, so they too are unscaled by the scale they carry.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from mixprec.precision import optimizer_calls
from mixprec.precision.scaler import LossScaler

__all__ = ["ScaledSteps"]


class ScaledSteps:
    """Scale, unscale once, step or skip, update once per iteration, for every tracked optimizer.

    Args:
        scaler: the (enabled) loss scaler; its scale pinned to 1 makes this an inf/NaN guard.

    Example:
        >>> steps = ScaledSteps(LossScaler("cpu", init_scale=1024.0))
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> steps.track_optimizer(opt)
        >>> steps.backward(model(torch.randn(8, 4)).pow(2).mean()); _ = steps.optimizer_step(opt)
        >>> steps.step_was_skipped(opt), steps.scaler.get_scale()
        (False, 1024.0)
    """

    def __init__(self, scaler: LossScaler) -> None:
        self._scaler = scaler
        self._optimizers: dict[int, torch.optim.Optimizer] = {}  # id -> optimizer, in prepare order
        self._stepped: set[int] = set()  # stepped (or skipped) since the last update
        self._fresh: set[int] = set()  # got gradients from a backward since their last step or zero_grad
        self._carried: dict[int, torch.Tensor | None] = {}  # scale their gradients carry (None: unscaled)
        self._flags: dict[int, list[Any]] = {}  # id -> [device found-inf flag, host answer or None]
        self._skips: dict[int, torch.Tensor] = {}  # id -> skipped steps (device)
        self._hooks: list[Any] = []
        self._owner: dict[int, int] = {}  # id(parameter) -> id(optimizer), with several optimizers

    @property
    def scaler(self) -> LossScaler:
        return self._scaler

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers tracked, in the order they were prepared."""
        return list(self._optimizers.values())

    def track_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizers.setdefault(id(optimizer), optimizer)
        if len(self._optimizers) == 2:
            # With one optimizer every step closes the iteration; with several, knowing which
            # hold fresh scaled gradients takes a hook per parameter (a set insert is all it does)
            # and which a loss reaches, a map from parameter to optimizer.
            for opt in self._optimizers.values():
                self._watch(opt)
        elif len(self._optimizers) > 2:
            self._watch(optimizer)

    def _watch(self, optimizer: torch.optim.Optimizer) -> None:
        mark = functools.partial(_mark_fresh, self._fresh, id(optimizer))
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        self._hooks += [p.register_post_accumulate_grad_hook(mark) for p in params]
        self._owner.update((id(p), id(optimizer)) for p in params)

    # -- 1. scale and backward ---------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.scale_loss(loss).backward(**kwargs)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the scale, for a backward that the caller runs (a trainer that calls its
        model's own ``backward``); everything :meth:`backward` does before it, once per loss."""
        if self._stepped and self._starts_new_iteration(loss):
            self._close_iteration()  # before scaling: the new gradients get the updated scale
        for i in list(self._carried):  # new gradients are about to add to them: same scale first
            self._bring_to_scale(self._optimizers[i])
        return self._scaler.scale(loss)

    def _starts_new_iteration(self, loss: torch.Tensor) -> bool:
        """Whether ``loss`` reaches only optimizers that already stepped since the last update (a
        critic's next step), not one still to step (a GAN's generator loss after the critic's
        step). A walk of the autograd graph, made only while an iteration is half stepped."""
        reaches_stepped, seen, todo = False, set(), [loss.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            owner = self._owner.get(id(getattr(node, "variable", None)))
            if owner is not None:
                if owner not in self._stepped:
                    return False
                reaches_stepped = True
            todo.extend(n for n, _ in node.next_functions)
        return reaches_stepped

    # -- 2. unscale, once per iteration ---------------------------------------------------------
    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        self._begin_step(optimizer)
        if not self._scaler.is_unscaled(optimizer):
            self._scaler.unscale_(optimizer)

    # -- 3. clip: the base class unscales through unscale_gradients, then clips -----------

    # -- 4. step or skip ---------------------------------------------------------------------
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any = None, **kwargs: Any) -> Any:
        if closure is not None:
            raise ValueError("closures are not supported with a loss scaler (torch.amp.GradScaler has the same limit)")
        self._optimizers.setdefault(id(optimizer), optimizer)
        self._begin_step(optimizer)
        out = self._scaler.step(optimizer, **kwargs)  # unscales (unless done), checks for inf/NaN, steps or skips
        flag, on_host = self._scaler.found_inf(optimizer)
        self._flags[id(optimizer)] = [flag, on_host]
        if flag is not None:
            skips = self._skips.get(id(optimizer))
            self._skips[id(optimizer)] = flag.to(torch.int64) if skips is None else skips.add_(flag.to(torch.int64))
        self._stepped.add(id(optimizer))
        self._fresh.discard(id(optimizer))
        if self._stepped.issuperset(self._optimizers):
            self._close_iteration()
        return out

    # -- 5. update the scale, once per iteration ----------------------------------------------
    def _close_iteration(self) -> None:
        """``update()``; gradients still held (fresh, or unscaled and not stepped) keep the scale
        they carry, to be brought to the new one when next used. Raises LossScaleCollapse."""
        scaler = self._scaler
        held = [i for i, o in self._optimizers.items() if i not in self._carried and (
            i in self._fresh or (scaler.is_unscaled(o) and not scaler.has_stepped(o)))]
        old = scaler.get_scale_tensor().clone() if held else None
        # Unscaled and not stepped (fresh from the backward before the unscale, or not): true values.
        # Fresh after a step: scaled again, by ``old``.
        unscaled = {i for i in held if scaler.is_unscaled(self._optimizers[i])
                    and not scaler.has_stepped(self._optimizers[i])}
        self._stepped.clear()
        for i in held:
            self._carried[i] = None if i in unscaled else old
        scaler.update()

    def _begin_step(self, optimizer: torch.optim.Optimizer) -> None:
        # A second unscale or step of this optimizer since the last update starts a new iteration.
        if id(optimizer) in self._stepped:
            self._close_iteration()
        self._bring_to_scale(optimizer)

    def _bring_to_scale(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) not in self._carried:
            return
        carried = self._carried.pop(id(optimizer))
        now = self._scaler.get_scale_tensor()
        factor = now if carried is None else now / carried
        for g in optimizer.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.grad.mul_(factor.to(p.grad.device))

    def finish_iteration(self) -> None:
        if self._stepped:
            self._close_iteration()

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        optimizer_calls.zero_grad(optimizer, set_to_none)
        self._carried.pop(id(optimizer), None)
        self._fresh.discard(id(optimizer))

    # -- what happened ------------------------------------------------------------------------
    def step_was_skipped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s last step was skipped. Syncs, unless its step already read the flag."""
        flag = self._flags.get(id(optimizer))
        if flag is None or flag[0] is None:
            return False
        if flag[1] is None and len(self._optimizers) == 1:
            # Its iteration's own answer: known on the host after a collapse check's read.
            flag[1] = not self._scaler.last_step_applied
        if flag[1] is None:
            flag[1] = bool(flag[0].item())
        return flag[1]

    def skip_flag(self, optimizer: torch.optim.Optimizer) -> bool | torch.Tensor:
        """``optimizer``'s last found-inf flag as the host knows it (a read already made), else the
        device tensor itself. No sync."""
        flag = self._flags.get(id(optimizer))
        if flag is None or flag[0] is None:
            return False
        return flag[1] if flag[1] is not None else flag[0]

    def skipped_steps(self, optimizer: torch.optim.Optimizer) -> int:
        """``optimizer``'s skipped steps. Syncs."""
        skips = self._skips.get(id(optimizer))
        return 0 if skips is None else int(skips.item())

    def grads_scaled_by(self, optimizer: torch.optim.Optimizer) -> Any:
        if self._scaler.is_unscaled(optimizer):
            return None
        return self._scaler

    def release(self) -> None:
        """Remove the parameter hooks (when the run switches to another precision)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def forget_optimizers(self) -> None:
        self.release()
        for table in (self._optimizers, self._stepped, self._fresh, self._carried, self._flags, self._skips, self._owner):
            table.clear()


def _mark_fresh(fresh: set[int], key: int, param: torch.Tensor) -> None:
    fresh.add(key)
