"""Optimizers and learning-rate schedules by name: built by transformers' own ``get_scheduler`` and
``Trainer.get_optimizer_cls_and_kwargs`` when transformers is installed (the same rates and
updates, not a re-derivation), by mixprec for the basic ones without it."""

from __future__ import annotations

import math
import re
from typing import Any

import torch

__all__ = ["METRIC_DRIVEN", "SCHEDULER_TYPES", "build_optimizer", "decay_parameter_names", "get_scheduler",
           "optimizer_names"]


class _Schedule:
    """Without transformers: a multiplier of the base learning rate per step (transformers' formulas
    for the four basic types); a plain object, so LambdaLR saves its state."""

    def __init__(self, kind: str, warmup: int, total: int) -> None:
        self.kind, self.warmup, self.total = kind, warmup, max(total, 1)

    def __call__(self, step: int) -> float:
        if self.kind == "constant":
            return 1.0
        if step < self.warmup:
            return step / max(1, self.warmup)
        if self.kind == "constant_with_warmup":
            return 1.0
        progress = (step - self.warmup) / max(1, self.total - self.warmup)
        if self.kind == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))  # cosine


#: Hugging Face's ``lr_scheduler_type`` names (``transformers.SchedulerType``).
SCHEDULER_TYPES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                   "inverse_sqrt", "reduce_lr_on_plateau", "cosine_with_min_lr", "cosine_warmup_with_min_lr",
                   "warmup_stable_decay", "greedy")
#: The schedules stepped with the evaluation metric (at each evaluation), not after each optimizer step.
METRIC_DRIVEN = ("reduce_lr_on_plateau", "greedy")
_WITHOUT_TRANSFORMERS = ("linear", "cosine", "constant", "constant_with_warmup")


def get_scheduler(name: str, optimizer: torch.optim.Optimizer, num_warmup_steps: int = 0,
                  num_training_steps: int = 1, scheduler_specific_kwargs: dict[str, Any] | None = None) -> Any:
    """The schedule ``lr_scheduler_type`` names over ``num_training_steps``: Hugging Face's own
    (``transformers.get_scheduler``, every type, ``scheduler_specific_kwargs`` being
    ``lr_scheduler_kwargs``) when transformers is installed, so the learning rate at every step is
    transformers'; without it, ``linear``, ``cosine``, ``constant`` and ``constant_with_warmup``.

    Example:
        >>> opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0)
        >>> s = get_scheduler("linear", opt, num_warmup_steps=2, num_training_steps=10)
        >>> s.get_last_lr()
        [0.0]
    """
    if name not in SCHEDULER_TYPES:
        raise ValueError(f"unknown lr_scheduler_type {name!r}; choose one of: {', '.join(SCHEDULER_TYPES)}")
    try:
        import transformers
    except ImportError:
        if name not in _WITHOUT_TRANSFORMERS or scheduler_specific_kwargs:
            raise ImportError(f"lr_scheduler_type={name!r}" + (" with lr_scheduler_kwargs" if scheduler_specific_kwargs
                              else "") + " is built by transformers' get_scheduler: pip install transformers "
                              "(or mixprec[hf])") from None
        return torch.optim.lr_scheduler.LambdaLR(optimizer, _Schedule(name, num_warmup_steps, num_training_steps))
    return transformers.get_scheduler(name, optimizer, num_warmup_steps=num_warmup_steps,
                                      num_training_steps=num_training_steps,
                                      scheduler_specific_kwargs=dict(scheduler_specific_kwargs or {}))


def optimizer_names(name: str | None = None) -> tuple[str, ...]:
    """The ``optim`` names taken: Hugging Face's (``transformers.training_args.OptimizerNames``) when
    transformers is installed, else the three mixprec builds by itself. Given ``name``, one of
    those three: they alone (transformers is not imported to check a name mixprec knows: its
    import takes seconds and loads peft and torchao)."""
    if name in _OWN_OPTIMIZERS:
        return _OWN_OPTIMIZERS
    try:
        from transformers.training_args import OptimizerNames
    except ImportError:
        return _OWN_OPTIMIZERS
    return tuple(o.value for o in OptimizerNames)


_OWN_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd")


#: transformers' ``Trainer.get_decay_parameter_names``: the name patterns that take a parameter out of
#: weight decay (tests/compat/test_optimizer_groups.py holds the two rules equal on transformers'
#: own models).
_NO_DECAY_NAME = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def decay_parameter_names(model: torch.nn.Module) -> list[str]:
    """The parameters weight decay applies to, by Hugging Face's rule (``Trainer.get_decay_parameter_names``):
    all but those inside a ``torch.nn.LayerNorm``, biases, and parameters whose name says norm.

    The rule itself rather than transformers' method: importing transformers' ``Trainer`` costs a
    process seconds (it imports datasets, peft and torchao where they are installed)."""
    in_norms = {name for prefix, module in model.named_modules() if isinstance(module, torch.nn.LayerNorm)
                for name, _ in module.named_parameters(prefix=prefix)}
    return [n for n, _ in model.named_parameters() if n not in in_norms and not _NO_DECAY_NAME.search(n.lower())]


def build_optimizer(args: Any, model: torch.nn.Module, cls_and_kwargs: tuple[type, dict[str, Any]] | None = None,
                    decay: list[str] | None = None) -> torch.optim.Optimizer:
    """The optimizer ``args.optim`` names (with ``args.optim_args``), or ``cls_and_kwargs``, over the
    trainable parameters in Hugging Face's two groups: ``args.weight_decay`` on the parameters named
    in ``decay`` (default: :func:`decay_parameter_names`), none on the others. Every name transformers knows is built by
    transformers' own ``Trainer.get_optimizer_cls_and_kwargs`` (an optimizer from a package that is
    not installed is its error, naming the package); AdamW and SGD without ``optim_args`` take
    torch's fused kernels where the parameters allow."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # Always transformers' two groups (even with weight_decay=0, as transformers builds them): a
    # checkpoint's optimizer.pt is then transformers' file as it is, not a second, regrouped copy.
    decay = set(decay_parameter_names(model) if decay is None else decay)
    groups = [{"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    params = [p for _, p in named]
    if cls_and_kwargs is not None:
        cls, kwargs = cls_and_kwargs
        return cls(groups, **{"lr": args.learning_rate, **kwargs})
    if args.optim in _OWN_OPTIMIZERS and not args.optim_args:
        # The fast path, where it is safe: torch's fused kernels (one launch for all parameters,
        # and the loss scaler's sync-free path) give the same update as the per-parameter loop,
        # to rounding; on these CPUs a fused AdamW step is ~1.5x faster than the default one.
        fused = args.optim == "adamw_torch_fused" or _fused_supported(params)
        if args.optim == "sgd":
            return torch.optim.SGD(groups, lr=args.learning_rate, fused=fused or None)
        return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                 eps=args.adam_epsilon, fused=fused or None)
    try:
        from transformers import Trainer
    except ImportError:
        raise ImportError(f"optim={args.optim!r}" + (" with optim_args" if args.optim_args else "") + " is built by "
                          "transformers' Trainer.get_optimizer_cls_and_kwargs: pip install transformers (or "
                          "mixprec[hf]); without it optim takes " + ", ".join(_OWN_OPTIMIZERS)) from None
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    return cls(groups, **kwargs)


def _fused_supported(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused optimizer kernels take these parameters (floating, on CPU or CUDA, dense)."""
    return bool(params) and all(p.is_floating_point() and not p.is_sparse and p.device.type in ("cpu", "cuda")
                                for p in params)
