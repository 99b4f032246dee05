"""An optimizer's ``step()`` and ``zero_grad()`` as torch does them, less what nothing observes.

On a step of about a millisecond (a small model, or any model on a GPU, where the host must stay
ahead), torch's per-call wrapping costs as much as some of the work. Each function here does the
work torch does, to the bit, and leaves out only what no one can see at that moment.

:func:`step`:

- **Alike parameter groups stepped as one.** transformers' Trainer gives AdamW two groups, with
  and without weight decay, and by default (``weight_decay=0.0``) they are alike. torch steps
  each group on its own: its Python and a fused (or foreach) launch per group. For the duration
  of ``step()`` the optimizer is shown one group holding all their parameters. Every parameter
  gets the same update, bit for bit (the update is element-wise, the state is kept per
  parameter), and ``param_groups`` is the optimizer's own again when ``step()`` returns or
  raises. Only torch's own Adam and AdamW (not a subclass, which may read its groups in its own
  way), with group settings that are plain values (a tensor learning rate is left to torch).
- **The step function called directly.** torch wraps every optimizer class's ``step`` in a
  function that opens a profiler range and runs the step hooks; an LR scheduler wraps the
  instance's ``step`` again to note that it was called. Where no profiler is recording and no step
  hook is registered, the class's own step function is called, and the scheduler's note set.

:func:`zero_grad` (``set_to_none=True``): torch's ``Optimizer.zero_grad`` sets each parameter's
``.grad`` to ``None`` inside a ``torch._disable_dynamo`` wrapper and a profiler range; with no
profiler recording, it is done directly.

Both call torch as it is while compiling (dynamo would not trace torch's own calls), for an
optimizer whose method is not torch's (a class that overrides it, an instance that replaced it),
and whenever a hook or a profiler would see the difference.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

__all__ = ["step", "zero_grad"]

_MERGEABLE = (torch.optim.Adam, torch.optim.AdamW)
_TORCH_ZERO_GRAD = torch.optim.Optimizer.zero_grad


def step(optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
    """``optimizer.step(closure)``: alike parameter groups stepped as one, torch's step function
    called directly where nothing observes its wrapper (see the module)."""
    if _observed(optimizer) or torch.compiler.is_compiling():  # (a compiled step guards on the groups it saw)
        return optimizer.step(closure=closure) if closure is not None else optimizer.step()
    direct = _step_function(optimizer)
    call = optimizer.step if direct is None else direct.__get__(optimizer)
    groups = optimizer.param_groups
    if len(groups) < 2 or type(optimizer) not in _MERGEABLE or not _alike(groups):
        return call(closure=closure) if closure is not None else call()
    merged = dict(groups[0])
    merged["params"] = [p for g in groups for p in g["params"]]
    optimizer.param_groups = [merged]
    try:
        return call(closure=closure) if closure is not None else call()
    finally:
        optimizer.param_groups = groups


def zero_grad(optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    """``optimizer.zero_grad(set_to_none)``, the same work done directly where nothing can tell (see the module)."""
    if not set_to_none or type(optimizer).zero_grad is not _TORCH_ZERO_GRAD or "zero_grad" in vars(optimizer) \
            or torch.autograd._profiler_enabled() or torch.compiler.is_compiling():
        optimizer.zero_grad(set_to_none=set_to_none)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


def _step_function(optimizer: torch.optim.Optimizer) -> Any:
    """The class's step function inside torch's profiling-and-hooks wrapper, when the optimizer's
    ``step`` is that wrapper (or an LR scheduler's note around it: set here, as it would be);
    ``None`` when it is anything else."""
    wrapper = type(optimizer).step
    inner = getattr(wrapper, "__wrapped__", None)
    if inner is None or not getattr(wrapper, "hooked", False):
        return None
    own = vars(optimizer).get("step")
    if own is not None:
        if not getattr(own, "_wrapped_by_lr_sched", False):
            return None
        optimizer._opt_called = True  # what the scheduler's wrapper records (it warns if a schedule steps first)
    return inner


def _observed(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a step hook or a profiler would see the step's wrapper (or its groups)."""
    return bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
                or torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks
                or torch.autograd._profiler_enabled())


def _alike(groups: list[dict[str, Any]]) -> bool:
    first = groups[0]
    for g in groups[1:]:
        if g.keys() != first.keys():
            return False
        for k, v in g.items():
            if k == "params":
                continue
            w = first[k]
            if v is not w and (isinstance(v, torch.Tensor) or isinstance(w, torch.Tensor) or v != w):
                return False
    return True
