"""Optimizers for bf16-true training that do not lose small updates to bf16 rounding.

With bf16 parameters, ``p += -lr * update`` rounds the sum to bf16's 8-bit mantissa: an update
smaller than half a unit in the last place of the weight (2**-7 near 1, 2**-6 near 2) is lost
entirely and training stalls. The optimizers here compute the update in fp32 and write it back
with one of two fixes:

* ``"kahan"``: a bf16 compensation buffer per parameter keeps what rounding dropped and adds it
  to the next update, so the small updates add up until they move the weight (+2 bytes/param).
* ``"stochastic"``: the fp32 result is rounded up or down at random, with the probability that
  makes the rounding unbiased, so small updates move the weight in expectation (no extra state).

``"none"`` rounds to nearest, as ``torch.optim.AdamW`` does on bf16 parameters (the control).

Why written here rather than wrapped: the bf16 AdamW of ``torch-optimi`` keeps its moments in
the parameters' dtype (bf16, where ``v * 0.999`` rounds back to ``v``), has no stochastic
rounding and overwrites ``p.grad`` as scratch space; ``torchao``'s is a private name (no public
bf16 AdamW, no SGD), compiles a kernel per parameter shape and draws its random bits from the
global RNG only. The losses and step times they and these optimizers reached, and how they were
measured, are in ``benchmarks/RESULTS.md`` ("Figures moved out of docstrings"). fp32 parameters
get torch's own AdamW update.
"""

from __future__ import annotations

import inspect
import math
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from itertools import chain
from typing import Any

import torch

from mixprec.precision.optim import fused_adamw


def _is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor, without importing ``torch.distributed.tensor`` (most of a second):
    where nothing imported it, no tensor can be one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


__all__ = ["AdamW", "SGD", "make_bf16_optimizer", "bf16_stochastic_round", "COMPENSATIONS", "OPTIMIZER_NAMES",
           "STATE_DTYPE_NAMES"]

COMPENSATIONS = ("kahan", "stochastic", "none")
# The moments' dtypes by the names configs use (Accelerator, TrainingArguments, mixprec bench).
STATE_DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "float32": torch.float32, "bfloat16": torch.bfloat16}
OPTIMIZER_NAMES = ("adamw", "sgd")
_LOW = (torch.bfloat16, torch.float16)
_STATE_DTYPES = (torch.float32, torch.bfloat16)
# 0xFFFF0000 as a signed int32: keeps an fp32 value's sign, exponent and the 7 bits bf16 keeps.
_BF16_MASK = -65536


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _validate_common(lr: Any, weight_decay: Any, compensation: Any, state_dtype: Any) -> None:
    _check(isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr >= 0,
           f"lr must be a non-negative number, got {lr!r}; pass a learning rate >= 0 (e.g. lr=1e-3)")
    _check(isinstance(weight_decay, (int, float)) and weight_decay >= 0,
           f"weight_decay must be >= 0, got {weight_decay!r}; use 0 to turn weight decay off")
    _check(compensation in COMPENSATIONS,
           f"unknown compensation {compensation!r}; use one of {', '.join(map(repr, COMPENSATIONS))}")
    _check(state_dtype in _STATE_DTYPES,
           f"state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype!r}; "
           "use torch.float32 (the default) unless the optimizer state must be halved")


def _as(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    # .to() returns the tensor itself when it already has the dtype: fp32 state is updated in place.
    return [t.to(dtype) for t in tensors]


def _random_low_bits(n: int, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """``n`` uniform random integers in [0, 2**16) as int32."""
    # One 64-bit draw gives four 16-bit fields: half the time of drawing n int32s on the CPU.
    words = torch.randint(-(2**63), 2**63 - 1, ((n + 3) // 4,), dtype=torch.int64, device=device,
                          generator=generator)
    return words.view(torch.int16)[:n].to(torch.int32).bitwise_and_(0xFFFF)


def _stochastic_round_(flat: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Round a contiguous 1-D fp32 tensor to bf16 stochastically, using it as scratch space."""
    bits = flat.view(torch.int32)
    # Adding 16 uniform random bits below bf16's mantissa carries into the kept bits with
    # probability (dropped bits) / 2**16: rounding away from zero exactly that often is unbiased.
    # inf and torch's canonical NaN have zero low bits, so they pass through unchanged.
    bits.add_(_random_low_bits(bits.numel(), bits.device, generator)).bitwise_and_(_BF16_MASK)
    return flat.to(torch.bfloat16)  # exact: the dropped bits are zero now


def bf16_stochastic_round(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round ``x`` to bf16 up or down at random, so that the result equals ``x`` in expectation.

    Args:
        x: a float32 tensor (not modified).
        generator: the source of the random bits, on ``x``'s device; ``None`` uses torch's
            default generator for that device.

    Example:
        >>> x = torch.full((10000,), 1.0 + 2**-10)  # an eighth of the way from 1 to the next bf16
        >>> abs(bf16_stochastic_round(x).float().mean().item() - x[0].item()) < 2**-12
        True
    """
    _check(x.dtype == torch.float32, f"bf16_stochastic_round takes a float32 tensor, got {x.dtype}; "
                                     "call x.float() first")
    return _stochastic_round_(x.reshape(-1).clone(), generator).view(x.shape)


class _CompensatedOptimizer(torch.optim.Optimizer):
    """Shared machinery: buckets by (device, dtype), the compensated write-back, state dicts."""

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], generator: torch.Generator | None) -> None:
        _check(generator is None or isinstance(generator, torch.Generator),
               f"generator must be a torch.Generator or None, got {type(generator).__name__}; "
               "pass torch.Generator(device=...).manual_seed(seed)")
        self._generator = generator
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._validate_group(self.param_groups[-1])  # user-given group dicts are checked as well

    def _validate_group(self, group: dict[str, Any]) -> None:
        _validate_common(group["lr"], group["weight_decay"], group["compensation"], group["state_dtype"])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Apply one update to every parameter that has a gradient; returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise ValueError(f"{type(self).__name__} does not support sparse gradients; "
                                         "use torch.optim.SparseAdam for sparse embeddings")
                    buckets.setdefault((p.device, p.dtype), []).append(p)
            for (device, dtype), params in buckets.items():
                if any(_is_dtensor(p) for p in params):
                    with self._on_local_shards(params) as local:
                        self._step_bucket(group, local, device, dtype)
                else:
                    self._step_bucket(group, params, device, dtype)
        return loss

    @contextmanager
    def _on_local_shards(self, params: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
        """Step sharded (FSDP2, DTensor) parameters on their local shards.

        The update is elementwise, so each rank updates its own shard alone: the step runs on
        plain views of the local shards (gradients, moments and compensation buffers likewise)
        and writes through them in place. State created during the step is wrapped back into
        DTensors placed as their parameter is, so ``get_state_dict`` / DCP reshard it.
        """
        from torch.distributed.tensor import DTensor

        local, given = [], []
        for p in params:
            if not isinstance(p, DTensor):
                local.append(p)
                given.append(None)
                continue
            shard = p.to_local()
            lp = shard.view_as(shard)  # a new view object: .grad and state attach to it
            lp.grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            views = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in self.state[p].items()}
            self.state[lp] = dict(views)
            local.append(lp)
            given.append(views)
        try:
            yield local
        finally:
            for p, lp, views in zip(params, local, given):
                if views is None:
                    continue
                for key, value in self.state.pop(lp).items():
                    if views.get(key) is value:
                        continue  # the state's own object (a DTensor's shard), updated in place
                    if torch.is_tensor(value) and key != "step" and value.shape == lp.shape:
                        value = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False,
                                                   shape=p.shape, stride=p.stride())
                    self.state[p][key] = value
                lp.grad = None

    def _step_bucket(self, group: dict[str, Any], params: list[torch.Tensor], device: torch.device,
                     dtype: torch.dtype) -> None:
        compute = torch.promote_types(dtype, torch.float32)  # fp32, or fp64 for fp64 parameters
        g32 = _as([p.grad for p in params], compute)
        if dtype not in _LOW:
            # fp32 parameters lose nothing that compensation could keep: update them in place.
            self._update(group, params, params, g32, compute)
            return
        how = group["compensation"]
        self._check_low_bucket(how, device, dtype)
        gen = self._generator
        # The weights' fp32 values, in one flat buffer that stochastic rounding works on whole
        # (one draw of random bits per bucket, in the parameters' order: reproducible).
        numels = [p.numel() for p in params]
        flat = torch.empty(sum(numels), dtype=compute, device=device)
        w32 = [c.view(p.shape) for c, p in zip(flat.split(numels), params)]
        torch._foreach_copy_(w32, params)
        comps = []
        if how == "kahan":
            comps = [self._kahan_comp(p) for p in params]
            # p + comp is the weight's full-precision value: what earlier roundings dropped is back.
            torch._foreach_add_(w32, comps)
        self._update(group, params, w32, g32, compute)
        if how == "kahan":
            torch._foreach_copy_(params, w32)  # p = round(w)
            torch._foreach_sub_(w32, params)  # w - p: exactly what this rounding dropped
            torch._foreach_copy_(comps, w32)
        elif how == "stochastic":
            rounded = _stochastic_round_(flat, gen).split(numels)
            torch._foreach_copy_(params, [r.view(p.shape) for r, p in zip(rounded, params)])
        else:
            torch._foreach_copy_(params, w32)  # round to nearest: updates below half an ulp are lost

    def _check_low_bucket(self, how: str, device: torch.device, dtype: torch.dtype) -> None:
        if how == "stochastic" and dtype != torch.bfloat16:
            raise ValueError(f"stochastic rounding is implemented for bfloat16 parameters, got {dtype}; "
                             "use compensation='kahan' for float16 parameters")
        gen = self._generator
        if how == "stochastic" and gen is not None and gen.device.type != device.type:
            raise ValueError(f"the generator is on {gen.device} but the parameters are on {device}; "
                             f"pass torch.Generator(device={str(device)!r})")

    def _kahan_comp(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "kahan_comp" not in state:
            state["kahan_comp"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["kahan_comp"]

    def _update(self, group: dict[str, Any], params: list[torch.Tensor], w32: list[torch.Tensor],
                g32: list[torch.Tensor], compute: torch.dtype) -> None:
        """Apply one step to ``w32``, the weights in ``compute`` precision (``params`` themselves
        for fp32 parameters), in place."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state (moments, compensation buffers, the generator's state).

        Holds only tensors and plain values, so ``torch.load(weights_only=True)`` reads it.
        """
        sd = super().state_dict()
        if self._generator is not None:
            sd["generator_state"] = self._generator.get_state()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output, keeping each state tensor's saved dtype.

        ``generator_state`` is restored into this optimizer's generator when it has one.
        """
        state_dict = dict(state_dict)
        gen_state = state_dict.pop("generator_state", None)
        super().load_state_dict(state_dict)
        # torch casts every floating state tensor to its parameter's dtype, which would round
        # fp32 moments of bf16 parameters to bf16: put back the tensors as they were saved.
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        mine = chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, mine):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if isinstance(value, torch.Tensor) and key != "step":
                    self.state[p][key] = value.to(device=p.device)
        if gen_state is not None and self._generator is not None:
            self._generator.set_state(gen_state)


class AdamW(_CompensatedOptimizer):
    """AdamW (torch's formulation, decoupled weight decay) with a compensated bf16 write-back.

    The moments live in ``state_dtype`` and the update is computed in fp32 whatever the
    parameters' dtype; fp32 parameters get torch's AdamW (no compensation is needed there).

    Args:
        params: parameters or parameter-group dicts, as for any ``torch.optim.Optimizer``.
        lr: learning rate (>= 0).
        betas: the moments' decay rates, each in [0, 1).
        eps: added to the denominator (>= 0).
        weight_decay: decoupled weight decay, ``p -= lr * weight_decay * p`` (>= 0).
        compensation: ``"kahan"``, ``"stochastic"`` or ``"none"`` (see the module docstring).
        state_dtype: ``torch.float32`` (default) or ``torch.bfloat16`` for the moments. bf16
            halves the state but ``v * beta2`` with ``beta2`` near 1 rounds back to ``v`` there.
        generator: random bits for ``"stochastic"``, on the parameters' device (saved in the
            state dict); ``None`` uses torch's default generator.
        fused: the update of bf16/fp16 weights as one compiled kernel per parameter
            (:mod:`mixprec.precision.optim.fused_adamw`: weight, gradient, moments and compensation read and
            written once) instead of ``torch._foreach_*`` ops. ``None`` (default) picks it on the
            CPU for buckets of at least 4M elements and, if compiling fails, falls back to the
            foreach update for this optimizer only, with a warning (``fused_failure`` then says
            why; other optimizers in the process still try); ``True`` forces it (a failure to compile raises); ``False`` never. Under
            ``torch.compile`` or a Python torch-function/dispatch mode (a FLOP or sync counter)
            the foreach update runs: the same update, op by op.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        >>> opt = AdamW([w], lr=1e-4, compensation="kahan")
        >>> w.grad = torch.ones_like(w); opt.step()
        >>> opt.state[w]["kahan_comp"].dtype
        torch.bfloat16
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, compensation: str = "kahan",
                 state_dtype: torch.dtype = torch.float32, generator: torch.Generator | None = None,
                 fused: bool | None = None) -> None:
        _check(fused in (None, True, False), f"fused must be None, True or False, got {fused!r}; "
                                             "None picks the fused update where it pays off")
        self.fused = fused
        #: Why compiling the fused update failed for this optimizer (it then uses the foreach update
        #: for the rest of its life; other optimizers still try), or ``None``.
        self.fused_failure: str | None = None
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        compensation=compensation, state_dtype=state_dtype)
        super().__init__(params, defaults, generator)

    def _use_fused(self, params: list[torch.Tensor], device: torch.device, dtype: torch.dtype) -> bool:
        if self.fused is False or dtype not in _LOW or torch.compiler.is_compiling():
            return False
        if torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack():
            # Under a Python torch-function or dispatch mode (a FLOP or sync counter, a tracer) the
            # compiled kernel cannot run: the foreach update computes the same, op by op.
            return False
        if not all(p.is_contiguous() for p in params):
            if self.fused:
                raise ValueError("AdamW(fused=True) updates contiguous parameters only; "
                                 "make them contiguous (p.data = p.data.contiguous()) or pass fused=None")
            return False
        if self.fused:
            return True
        # Auto: on the CPU, where it was measured faster, and for buckets large enough that the
        # one-time compile pays off within a short run.
        return (device.type == "cpu" and self.fused_failure is None
                and sum(p.numel() for p in params) >= fused_adamw.AUTO_MIN_NUMEL)

    def _step_bucket(self, group: dict[str, Any], params: list[torch.Tensor], device: torch.device,
                     dtype: torch.dtype) -> None:
        if not self._use_fused(params, device, dtype):
            super()._step_bucket(group, params, device, dtype)
            return
        how = group["compensation"]
        self._check_low_bucket(how, device, dtype)
        beta1, beta2 = group["betas"]
        lr, eps = group["lr"], group["eps"]
        fresh = [p for p in params if "step" not in self.state[p]]
        self._init_state(group, params)
        comps: list[torch.Tensor | None] = [None] * len(params)
        if how == "kahan":
            comps = [self._kahan_comp(p) for p in params]
        hypers = []
        for p in params:
            n = self.state[p]["step"].item() + 1
            c2 = math.sqrt(1 - beta2**n)
            hypers.append(torch.tensor([1 - lr * group["weight_decay"], 1 - beta1, beta2, 1 - beta2, eps * c2,
                                        -lr * c2 / (1 - beta1**n)], dtype=torch.float32, device=device))
        if how == "stochastic":
            seeds = list(torch.randint(0, 2**31 - 1, (len(params),), device=device, generator=self._generator,
                                       dtype=torch.int64))
        else:
            seeds = [torch.zeros((), dtype=torch.int64, device=device)] * len(params)
        state = [self.state[p] for p in params]
        failure = fused_adamw.step(how, params, [p.grad for p in params], [s["exp_avg"] for s in state],
                                   [s["exp_avg_sq"] for s in state], comps, hypers, seeds, required=bool(self.fused))
        if failure is not None:
            self.fused_failure = failure
            warnings.warn("mixprec.precision.optim.AdamW: compiling the fused bf16 update failed, so this optimizer uses the "
                          "foreach update from now on (other optimizers still try the fused one; fused=False skips "
                          f"it): {failure.splitlines()[0][:200]}", RuntimeWarning, stacklevel=4)
            for p in fresh:  # leave the state as the foreach update expects to find it
                self.state[p].clear()
            super()._step_bucket(group, params, device, dtype)
            return
        torch._foreach_add_([s["step"] for s in state], 1.0)

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)
        betas = group["betas"]
        _check(isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas),
               f"betas must be two numbers in [0, 1), got {betas!r}; e.g. betas=(0.9, 0.999)")
        _check(group["eps"] >= 0, f"eps must be >= 0, got {group['eps']!r}; e.g. eps=1e-8")

    def _update(self, group: dict[str, Any], params: list[torch.Tensor], w32: list[torch.Tensor],
                g32: list[torch.Tensor], compute: torch.dtype) -> None:
        beta1, beta2 = group["betas"]
        lr, sdt = group["lr"], group["state_dtype"]
        self._init_state(group, params)
        steps = [self.state[p]["step"] for p in params]
        exp_avgs = [self.state[p]["exp_avg"] for p in params]
        exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
        torch._foreach_add_(steps, 1.0)
        if group["weight_decay"]:
            torch._foreach_mul_(w32, 1 - lr * group["weight_decay"])  # decoupled, as torch's AdamW
        # The moments are updated where they live; each op computes in fp32 and, for bf16 state,
        # rounds once on the way back (fp32 copies and back measured much slower: benchmarks/RESULTS.md).
        torch._foreach_lerp_(exp_avgs, _as(g32, sdt), 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, g32, g32, 1 - beta2)
        # Per-parameter bias corrections (parameters may have joined at different steps), folded
        # into eps and the step size so that one pass divides: m/(sqrt(v)/c2 + eps) = c2*m/(sqrt(v) + eps*c2).
        counts = [s.item() for s in steps]
        c2 = [math.sqrt(1 - beta2**n) for n in counts]
        if sdt == compute:
            denom = torch._foreach_sqrt(exp_avg_sqs)
        else:
            denom = _as(exp_avg_sqs, compute)  # fresh fp32 copies: take the root in place
            torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, [group["eps"] * c for c in c2])
        torch._foreach_addcdiv_(w32, exp_avgs, denom, [-lr * c / (1 - beta1**n) for c, n in zip(c2, counts)])


    def _init_state(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        sdt = group["state_dtype"]
        for p in params:
            state = self.state[p]
            if "step" not in state:
                # "step" as a CPU tensor, as torch's AdamW keeps it: reading it never syncs a device.
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, dtype=sdt, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=sdt, memory_format=torch.preserve_format)


class SGD(_CompensatedOptimizer):
    """SGD with momentum (torch's formulation) with a compensated bf16 write-back.

    As ``torch.optim.SGD``: ``weight_decay`` is an L2 term added to the gradient, the momentum
    buffer starts as the first gradient, and ``nesterov`` needs ``momentum > 0, dampening == 0``.

    Args:
        params: parameters or parameter-group dicts.
        lr: learning rate (>= 0).
        momentum: in [0, 1); 0 keeps no buffer.
        dampening: in [0, 1].
        weight_decay: L2 penalty (>= 0).
        nesterov: Nesterov momentum.
        compensation: ``"kahan"``, ``"stochastic"`` or ``"none"``.
        state_dtype: dtype of the momentum buffer, ``torch.float32`` (default) or ``torch.bfloat16``.
        generator: random bits for ``"stochastic"``, on the parameters' device.

    Example:
        >>> w = torch.nn.Parameter(torch.full((4,), 2.0, dtype=torch.bfloat16))
        >>> opt = SGD([w], lr=1e-4, momentum=0.9)
        >>> for _ in range(200):
        ...     w.grad = torch.ones_like(w); opt.step()
        >>> bool((w < 2.0).all())  # 200 updates of <= 1e-3, each lost to rounding without Kahan
        True
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, compensation: str = "kahan",
                 state_dtype: torch.dtype = torch.float32, generator: torch.Generator | None = None) -> None:
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, compensation=compensation, state_dtype=state_dtype)
        super().__init__(params, defaults, generator)

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)
        mom, damp = group["momentum"], group["dampening"]
        _check(0.0 <= mom < 1.0, f"momentum must be in [0, 1), got {mom!r}; e.g. momentum=0.9")
        _check(0.0 <= damp <= 1.0, f"dampening must be in [0, 1], got {damp!r}; use 0 for none")
        _check(not group["nesterov"] or (mom > 0 and damp == 0),
               "nesterov=True needs momentum > 0 and dampening == 0; set them so, or nesterov=False")

    def _update(self, group: dict[str, Any], params: list[torch.Tensor], w32: list[torch.Tensor],
                g32: list[torch.Tensor], compute: torch.dtype) -> None:
        mom, lr = group["momentum"], group["lr"]
        if group["weight_decay"]:
            g32 = torch._foreach_add(g32, w32, alpha=group["weight_decay"])  # a copy: p.grad stays as it was
        if mom == 0:
            torch._foreach_add_(w32, g32, alpha=-lr)
            return
        olds, old_grads, direction = [], [], []
        for p, g in zip(params, g32):
            state = self.state[p]
            if "momentum_buffer" not in state:  # first step: the buffer is the gradient, as in torch
                state["momentum_buffer"] = g.to(group["state_dtype"], copy=True)
                direction.append(g)
            else:
                olds.append(state["momentum_buffer"])
                old_grads.append(g)
                direction.append(state["momentum_buffer"])
        if olds:
            torch._foreach_mul_(olds, mom)
            torch._foreach_add_(olds, old_grads, alpha=1 - group["dampening"])
        if group["nesterov"]:
            torch._foreach_add_(w32, g32, alpha=-lr)
            torch._foreach_add_(w32, direction, alpha=-lr * mom)
        else:
            torch._foreach_add_(w32, direction, alpha=-lr)


_CLASSES: dict[str, type[_CompensatedOptimizer]] = {"adamw": AdamW, "sgd": SGD}


def make_bf16_optimizer(params: Iterable[Any], name: str = "adamw", compensation: str = "kahan",
                        state_dtype: torch.dtype = torch.float32, generator: torch.Generator | None = None,
                        **hyperparams: Any) -> AdamW | SGD:
    """An optimizer for bf16 parameters whose small updates are not lost to rounding.

    Args:
        params: parameters or parameter-group dicts.
        name: ``"adamw"`` (:class:`AdamW`) or ``"sgd"`` (:class:`SGD`, momentum and all).
        compensation: ``"kahan"`` (a bf16 buffer keeps the rounding error; deterministic),
            ``"stochastic"`` (unbiased random rounding; no extra memory) or ``"none"``.
        state_dtype: dtype of the moment / momentum buffers.
        generator: random bits for stochastic rounding, on the parameters' device.
        **hyperparams: the chosen optimizer's own (``lr``, ``betas``, ``momentum``, ...).

    Raises:
        ValueError: for an unknown name, compensation or hyperparameter, or a value out of
            range, saying what to pass instead.

    Example:
        >>> model = torch.nn.Linear(4, 4).to(torch.bfloat16)
        >>> opt = make_bf16_optimizer(model.parameters(), name="sgd", lr=1e-3, momentum=0.9)
        >>> type(opt).__name__
        'SGD'
    """
    key = str(name).lower()
    _check(key in _CLASSES, f"unknown optimizer name {name!r}; use one of {', '.join(map(repr, OPTIMIZER_NAMES))}")
    cls = _CLASSES[key]
    accepted = [n for n in inspect.signature(cls.__init__).parameters
                if n not in ("self", "params", "compensation", "state_dtype", "generator")]
    unknown = sorted(set(hyperparams) - set(accepted))
    _check(not unknown, f"{cls.__name__} has no hyperparameter(s) {', '.join(unknown)}; "
                        f"it takes {', '.join(accepted)}")
    return cls(params, compensation=compensation, state_dtype=state_dtype, generator=generator, **hyperparams)


def compensated_for_bf16(optimizer: torch.optim.Optimizer, compensation: str = "kahan",
                         state_dtype: torch.dtype = torch.float32) -> torch.optim.Optimizer:
    """The compensated twin of a fresh ``torch.optim.AdamW`` or ``SGD`` (anything else is returned as is),
    with its moments (momentum buffer) in ``state_dtype``; AdamW's twin picks its fused update itself.

    The twin takes over the original's parameter-group dicts themselves, so an LR scheduler built
    on the original still sets the learning rate the twin uses. An optimizer that has already
    stepped (it holds state) is returned as is: its moments would be lost.
    """
    kinds = {torch.optim.AdamW: (AdamW, ("lr", "betas", "eps", "weight_decay")),
             torch.optim.SGD: (SGD, ("lr", "momentum", "dampening", "weight_decay", "nesterov"))}
    if type(optimizer) not in kinds or optimizer.state:
        return optimizer
    cls, keys = kinds[type(optimizer)]
    if any(g.get("maximize") or g.get("amsgrad") for g in optimizer.param_groups):
        return optimizer  # options the compensated update does not have: keep torch's
    defaults = {k: optimizer.defaults[k] for k in keys}
    return cls(optimizer.param_groups, compensation=compensation, state_dtype=state_dtype, **defaults)
