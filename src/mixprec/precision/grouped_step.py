"""One optimizer step over parameter groups that differ only in their parameters.

transformers' Trainer gives AdamW two groups, with and without weight decay, and by default
(``weight_decay=0.0``) they are alike. torch steps each group on its own: its Python and a fused
(or foreach) launch per group. :func:`step` steps such alike groups as one, by presenting the
optimizer one group that holds all their parameters for the duration of ``step()``: every
parameter gets the same update, bit for bit (the update is element-wise, and the state is kept per
parameter), and ``param_groups`` is the optimizer's own again when ``step()`` returns or raises.

Only torch's own Adam and AdamW (not a subclass, which may read its groups in its own way),
without step hooks (which would see the one group), with group settings that are plain values
(a tensor learning rate is left to torch).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

__all__ = ["step"]

_MERGEABLE = (torch.optim.Adam, torch.optim.AdamW)


def step(optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
    """``optimizer.step(closure)``, with alike parameter groups stepped as one (see the module)."""
    groups = optimizer.param_groups
    if len(groups) < 2 or type(optimizer) not in _MERGEABLE or not _alike(groups) or _hooked(optimizer) \
            or torch.compiler.is_compiling():  # (a compiled step guards on the groups it saw)
        return optimizer.step(closure) if closure is not None else optimizer.step()
    merged = dict(groups[0])
    merged["params"] = [p for g in groups for p in g["params"]]
    optimizer.param_groups = [merged]
    try:
        return optimizer.step(closure) if closure is not None else optimizer.step()
    finally:
        optimizer.param_groups = groups


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


def _hooked(optimizer: torch.optim.Optimizer) -> bool:
    return bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
                or torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks)
