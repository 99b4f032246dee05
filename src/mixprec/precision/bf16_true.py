"""bf16-true: parameters, gradients and activations in bf16, normalisation layers kept fp32, float
inputs cast to bf16, and the user's fresh ``torch.optim.AdamW`` / ``SGD`` swapped for its
compensated twin (:mod:`mixprec.precision.optim`) so that updates smaller than bf16's resolution
of the weights are not lost. No autocast, no loss scaler; the inf/NaN guard
(``skip_nonfinite_steps``) is a component the plugin holds
(:class:`~mixprec.precision.scaled_steps.ScaledSteps` with a scaler pinned to 1).

Which layers stay fp32: normalisation layers are where bf16 hurts most: their gains sit near 1
and scale every activation that passes (bf16's spacing there is 2**-7), and their statistics
(mean, variance, running averages) are sums over many elements that bf16's 8-bit mantissa rounds
badly. They hold a tiny share of the parameters, so keeping them fp32 costs next to nothing; the
same holds for embeddings, which some recipes keep fp32 too (opt in with ``embeddings=True``).

:func:`cast_for_bf16_true` casts the rest of the model to bf16 and wraps each kept module in
hooks that give it fp32 inputs and hand bf16 outputs on, so the model still runs end to end on
bf16 activations. A kept module that saves its fp32 input for backward (a LayerNorm does) has
it stored as the bf16 original and cast up again in backward: exact, and it saves the memory of
an fp32 copy per kept module (the figure measured on pycode ``small`` is in
``benchmarks/RESULTS.md``, "Figures moved out of docstrings").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec.data import send_to_device
from mixprec.nested import tree_map
from mixprec.precision.base import PrecisionPlugin
from mixprec.precision.optim.compensated import compensated_for_bf16

__all__ = ["BF16TruePrecision", "cast_for_bf16_true", "fp32_modules_rule"]

# _NormBase is the common base of BatchNorm1d/2d/3d, SyncBatchNorm, InstanceNorm* and their
# Lazy variants; torch exposes no public base class for them.
_NORMS: tuple[type[nn.Module], ...] = tuple(
    t for t in (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, getattr(nn, "RMSNorm", None))
    if t is not None
)
# Norm layers of libraries mixprec does not depend on (Hugging Face's LlamaRMSNorm, T5LayerNorm,
# apex's FusedLayerNorm), recognised by name rather than imported.
_NORM_NAME_SUFFIXES = ("LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm")
_HANDLES = "_mixprec_bf16_true_hooks"


def fp32_modules_rule(module: nn.Module, *, embeddings: bool = False) -> bool:
    """Whether ``module``'s parameters should stay fp32 in bf16-true training.

    True for normalisation layers (``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.BatchNorm*``,
    ``nn.SyncBatchNorm``, ``nn.InstanceNorm*``, ``nn.RMSNorm``, and classes of other libraries
    whose names end in ``LayerNorm``/``RMSNorm``/``GroupNorm``/``BatchNorm``), and, with
    ``embeddings=True``, for ``nn.Embedding`` and ``nn.EmbeddingBag``.

    Args:
        module: the module to decide for (only the module itself, not its children).
        embeddings: keep embedding tables fp32 as well.

    Example:
        >>> fp32_modules_rule(nn.LayerNorm(8)), fp32_modules_rule(nn.Linear(8, 8))
        (True, False)
        >>> keep = functools.partial(fp32_modules_rule, embeddings=True)
        >>> keep(nn.Embedding(10, 8))
        True
    """
    if isinstance(module, _NORMS) or type(module).__name__.endswith(_NORM_NAME_SUFFIXES):
        return True
    return embeddings and isinstance(module, (nn.Embedding, nn.EmbeddingBag))


def _map_floats(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``fn`` applied to every floating tensor in it (any container :mod:`mixprec.nested` walks)."""
    return tree_map(lambda t: fn(t) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, value)


class _SaveLow:
    """Saved-tensor hooks for one call of a kept module: an fp32 copy that its pre-hook made of a
    16-bit input, when the module saves it for backward (a LayerNorm saves its input), is stored
    as that 16-bit original and cast up again in backward. Exact (the copy was cast up from it),
    and the module's saved input then costs 2 bytes per element instead of 4 plus the 2 that the
    previous layer already keeps."""

    def __init__(self) -> None:
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (fp32 copy, 16-bit original)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def up(self, t: torch.Tensor) -> torch.Tensor:
        hi = t.to(torch.float32)
        if t.dtype in (torch.bfloat16, torch.float16):
            self.copies.append((hi, t))
        return hi

    def pack(self, t: torch.Tensor) -> tuple[torch.Tensor, bool]:
        for hi, low in self.copies:
            if t is hi or (t.dtype == hi.dtype and t.data_ptr() == hi.data_ptr() and t.shape == hi.shape
                           and t.stride() == hi.stride()):
                return low, True
        return t, False

    @staticmethod
    def unpack(packed: tuple[torch.Tensor, bool]) -> torch.Tensor:
        t, cast_up = packed
        return t.to(torch.float32) if cast_up else t


_SAVING = "_mixprec_bf16_true_saving"


def _hooks_free() -> bool:
    """Whether no other saved-tensor hooks are active (activation checkpointing and offloading
    install theirs: ours would hide this module's saved tensors from them, so we stand aside)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is None


def _to_fp32_inputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and _hooks_free()):
        up = functools.partial(torch.Tensor.to, dtype=torch.float32)
        return _map_floats(args, up), _map_floats(kwargs, up)
    saving = _SaveLow()
    args, kwargs = _map_floats(args, saving.up), _map_floats(kwargs, saving.up)
    if saving.copies:
        saving.hooks.__enter__()
        module.__dict__.setdefault(_SAVING, []).append(saving)
    return args, kwargs


def _to_dtype_outputs(dtype: torch.dtype, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
    stack = module.__dict__.get(_SAVING)
    if stack:  # always_call: popped even when the forward raised
        saving = stack.pop()
        saving.hooks.__exit__(None, None, None)
        saving.copies.clear()  # the fp32 copies go now, not when the collector finds the hooks' cycle
    return _map_floats(output, functools.partial(torch.Tensor.to, dtype=dtype))


def cast_for_bf16_true(model: nn.Module, keep_fp32: Callable[[nn.Module], bool] = fp32_modules_rule,
                       dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Cast ``model`` to ``dtype`` in place, except the modules ``keep_fp32`` picks (and all
    their children), which stay fp32 and run on fp32 inputs; returns ``model``.

    Each kept module gets a forward pre-hook that casts its floating inputs to fp32 and a
    forward hook that casts its floating outputs to ``dtype``, so activations between layers
    stay ``dtype``. Calling it again on the same model adds no second set of hooks. Cast the
    model before building its optimizer (the optimizer then sees each parameter's final dtype;
    :mod:`mixprec.precision.optim`'s optimizers compensate the bf16 ones and update the fp32 ones plainly).

    Args:
        model: the model to cast (in place, like ``model.to``).
        keep_fp32: decides per module whether it stays fp32 (default :func:`fp32_modules_rule`;
            ``functools.partial(fp32_modules_rule, embeddings=True)`` keeps embeddings too).
        dtype: the low-precision dtype for everything else (``torch.bfloat16``).

    Raises:
        ValueError: for a ``dtype`` that is not a 16-bit floating type.

    Example:
        >>> model = cast_for_bf16_true(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2)))
        >>> [p.dtype for p in model[1].parameters()], model[0].weight.dtype
        ([torch.float32, torch.float32], torch.bfloat16)
        >>> model(torch.randn(3, 8, dtype=torch.bfloat16)).dtype
        torch.bfloat16
    """
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"cast_for_bf16_true casts to a 16-bit float dtype, got {dtype}; "
                         "pass dtype=torch.bfloat16 (or torch.float16)")

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    def keep(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float32) if t.is_floating_point() else t

    def visit(module: nn.Module) -> None:
        if keep_fp32(module):
            module._apply(keep)  # the whole subtree, in case it had been cast before
            if not hasattr(module, _HANDLES):
                setattr(module, _HANDLES, (
                    module.register_forward_pre_hook(_to_fp32_inputs, with_kwargs=True),
                    module.register_forward_hook(functools.partial(_to_dtype_outputs, dtype), with_kwargs=True,
                                                always_call=True),
                ))
            return
        # Only this module's own parameters and buffers; its children decide for themselves.
        module._apply(cast, recurse=False)
        for child in module.children():
            visit(child)

    visit(model)
    return model


class BF16TruePrecision(PrecisionPlugin):
    """bf16 storage and compute, fp32-kept norms, a compensated optimizer update.

    With ``skip_nonfinite_steps`` the plugin holds the inf/NaN guard (the loss scaler's check and
    skip at a scale pinned to 1: nothing is scaled). A skipped step leaves the weights, the
    moments, the Kahan buffers and the step count as they were; it is counted in
    ``skipped_steps``, and ``max_consecutive_skips`` applies. That costs one host sync per step:
    the compensated optimizer has no fused, scale-aware ``step`` (torch's ``fused=True``
    optimizers take the found-inf flag on the device), so deciding whether to call ``step()``
    reads the flag once, as ``torch.amp.GradScaler`` does for any optimizer without one. On the
    CPU that read is no device synchronisation at all.

    Args:
        policy: the resolved bf16-true policy.
        device: the device the run trains on.
        config: a :class:`~mixprec.precision.PrecisionConfig`: ``bf16_true_compensation``
            (default Kahan), ``bf16_true_state_dtype`` (default fp32 moments), the guard; a loss
            scaler is refused without the guard (bf16 has fp32's range).

    Example:
        >>> from mixprec.precision import make_plugin
        >>> plugin = make_plugin("bf16-true", "cpu")
        >>> model = plugin.convert_module(torch.nn.Linear(4, 1))
        >>> opt = plugin.convert_optimizer(torch.optim.AdamW(model.parameters()))
        >>> model.weight.dtype, type(opt).__module__
        (torch.bfloat16, 'mixprec.precision.optim.compensated')
    """

    variant_field = "bf16_true_compensation"  # mixprec bench compares its compensations side by side

    @property
    def optimizer_state_dtype(self) -> torch.dtype | None:
        """The compensated optimizer's ``state_dtype``; without compensation torch's own optimizer
        keeps the moments in the parameters' bf16."""
        c = self.config
        return c.bf16_true_state_dtype if c.bf16_true_compensation != "none" else self.policy.param_dtype

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        # bf16 everywhere but normalisation layers, whose statistics stay fp32.
        return cast_for_bf16_true(module, dtype=self.policy.param_dtype)

    @property
    def input_dtype(self) -> torch.dtype:
        return self.policy.param_dtype

    def convert_input(self, data: Any) -> Any:
        return send_to_device(data, self.device, float_dtype=self.policy.param_dtype)

    def convert_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        c = self.config
        if c.bf16_true_compensation == "none":
            return optimizer
        return compensated_for_bf16(optimizer, c.bf16_true_compensation, c.bf16_true_state_dtype)
