"""One generated kernel per parameter for :class:`mixprec.precision.optim.AdamW` on bf16/fp16 weights.

The foreach update reads and writes every parameter-sized tensor about twenty times per step
(each ``torch._foreach_*`` op is its own loop on the CPU, and the fp32 copies of the weights go
in and out of a scratch buffer). Written as one elementwise function and compiled by
``torch.compile`` (Inductor), the same update reads the weight, gradient, moments and
compensation once and writes them once, several times faster than the foreach update on the CPU
(the step times, and their command, are in ``benchmarks/RESULTS.md``, "Figures moved out of
docstrings").

Why generated rather than written by hand: a C++/CUDA extension would have to be built at install
time for every platform, while Inductor already turns the function into vectorised C++ (CPU) or
Triton (CUDA) code, once per process (a few seconds, then cached on disk). The parameters are
passed flattened, with ``dynamic=True``, so one compiled kernel serves every parameter size.

Two things Inductor would otherwise get wrong, and how they are kept right:

* ``float(bf16(w))`` folds back to ``w``, which would make the Kahan residual ``w - float(bf16(w))``
  zero: ``emulate_precision_casts`` makes Inductor round where the code rounds.
* Random bits for stochastic rounding cannot come from a ``torch.Generator`` inside a compiled
  function: each call hashes (element index, a 31-bit seed drawn from the optimizer's generator)
  with a counter-based integer hash instead, so runs stay reproducible under a seed.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from typing import Any

import torch

# Below this many elements in one (device, dtype) bucket the per-process compile (a few seconds)
# does not pay for itself within a short run (the measured saving per element is in benchmarks/RESULTS.md).
AUTO_MIN_NUMEL = 1 << 22

_lock = threading.Lock()
_kernels: dict[tuple[str, torch.dtype, torch.dtype, torch.dtype], Callable[..., None]] = {}

# A counter-based hash (the "lowbias32" mixer's structure with multipliers below 2**31, so that
# every product fits in int64): 32 well-mixed bits per (index, seed).
_M32 = 0xFFFFFFFF


def _hash_bits(n: torch.Tensor | int, seed: torch.Tensor, device: torch.device) -> torch.Tensor:
    x = (torch.arange(n, device=device, dtype=torch.int64) + seed * 0x9E3779B1) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x46CA68B5) & _M32
    return x ^ (x >> 16)


def _update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, c: torch.Tensor,
            hyper: torch.Tensor, seed: torch.Tensor, how: str) -> None:
    # hyper: [1 - lr*weight_decay, 1 - beta1, beta2, 1 - beta2, eps * c2, -lr * c2 / (1 - beta1**t)]
    decay, w1, b2, w2, eps, step_size = hyper.unbind()
    w = p.float()
    if how == "kahan":
        w = w + c.float()
    w = w * decay
    g32 = g.float()
    m32 = torch.lerp(m.float(), g32, w1)
    v32 = v.float() * b2 + g32 * g32 * w2
    m.copy_(m32)
    v.copy_(v32)
    w = w + step_size * m32 / (v32.sqrt() + eps)
    if how == "stochastic":
        bits = w.view(torch.int32) + (_hash_bits(w.numel(), seed, w.device) & 0xFFFF).to(torch.int32)
        w = (bits & -65536).view(torch.float32)  # exact in bf16 now: the dropped bits are zero
    low = w.to(p.dtype)
    p.copy_(low)
    if how == "kahan":
        c.copy_((w - low.float()).to(c.dtype))  # what this rounding dropped, for the next step


def _kernel_for(key: tuple[str, torch.dtype, torch.dtype, torch.dtype]) -> Callable[..., None]:
    how = key[0]

    def kernel(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, c: torch.Tensor,
               hyper: torch.Tensor, seed: torch.Tensor) -> None:
        _update(p, g, m, v, c, hyper, seed, how)

    # Dynamo keeps its compiled variants (and its limit of 8 of them) per code object: a code
    # object of its own per variant keeps the dtypes a process uses from crowding each other out.
    name = "mixprec_adamw_" + "_".join(str(k).replace("torch.", "") for k in key)
    kernel = types.FunctionType(kernel.__code__.replace(co_name=name), kernel.__globals__, name, None,
                                kernel.__closure__)
    return torch.compile(kernel, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True})


def step(how: str, params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
         exp_avg_sqs: list[torch.Tensor], comps: list[torch.Tensor | None], hypers: list[torch.Tensor],
         seeds: list[torch.Tensor], *, required: bool) -> str | None:
    """Update every parameter with the compiled kernel and return ``None``; or, if it cannot be
    compiled here and ``required`` is False, return why (nothing changed: the caller decides what
    to do, for its own optimizer only). Raises with the compiler's error when ``required``."""
    first = True
    unused = torch.empty(0, dtype=params[0].dtype, device=params[0].device) if params else None
    for p, g, m, v, c, hyper, seed in zip(params, grads, exp_avgs, exp_avg_sqs, comps, hypers, seeds):
        key = (how, p.dtype, g.dtype, m.dtype)
        with _lock:
            kernel = _kernels.get(key)
            if kernel is None:
                kernel = _kernels[key] = _kernel_for(key)
        args: Any = (p.view(-1), g.reshape(-1), m.view(-1), v.view(-1), unused if c is None else c.view(-1),
                     hyper, seed)
        if not first:
            kernel(*args)
            continue
        try:
            kernel(*args)  # the first call compiles; a failure here has changed nothing yet
        except Exception as exc:  # noqa: BLE001 - any compiler failure means "use the foreach update"
            with _lock:  # a later optimizer compiles afresh rather than calling a kernel that failed
                if _kernels.get(key) is kernel:
                    del _kernels[key]
            if required:
                raise RuntimeError(f"AdamW(fused=True) could not compile its update kernel here ({exc}); "
                                   "pass fused=None (falls back to the foreach update) or fused=False") from exc
            return f"{type(exc).__name__}: {exc}"
        first = False
    return None
