"""The optimizer step alone: mixprec's compensated AdamW on bf16 weights against torch's AdamW.

The parameters of a pycode GPT (``--size small``: 25.4M parameters in 8 layers) with random
gradients; each optimizer steps them in turn, interleaved in rounds, and the median step time is
printed against torch's fused AdamW on the same weights in fp32 (what bf16-mixed and fp32 use).

Rows: torch's fused AdamW on fp32 weights (the baseline) and on bf16 weights (plain bf16-true,
moments in bf16, small updates lost); mixprec.precision.optim.AdamW with Kahan compensation, its foreach
update (``fused=False``) and its compiled one (``fused=True``; the first step compiles, in the
warm-up), with fp32 and with bf16 moments; and stochastic rounding, compiled.

    .venv/bin/python benchmarks/bf16_optimizer_step.py [--size small] [--steps 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mixprec.precision.bf16_true import cast_for_bf16_true
from mixprec.precision.optim import AdamW
from mixprec.tasks import GPT, PYCODE_SIZES

from _common import interleave


def build(size: str, bf16: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(PYCODE_SIZES[size])
    if bf16:
        cast_for_bf16_true(model)  # as the Accelerator does: norms stay fp32
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=list(PYCODE_SIZES), default="small")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per row per round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    bf16_moments = dict(state_dtype=torch.bfloat16)
    rows = {
        "torch AdamW fused, fp32 weights": (False, lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True)),
        "torch AdamW fused, bf16 weights": (True, lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True)),
        "mixprec Kahan, foreach": (True, lambda p: AdamW(p, lr=1e-4, fused=False)),
        "mixprec Kahan, compiled": (True, lambda p: AdamW(p, lr=1e-4, fused=True)),
        "mixprec Kahan, foreach, bf16 moments": (True, lambda p: AdamW(p, lr=1e-4, fused=False, **bf16_moments)),
        "mixprec Kahan, compiled, bf16 moments": (True, lambda p: AdamW(p, lr=1e-4, fused=True, **bf16_moments)),
        "mixprec stochastic, compiled": (True, lambda p: AdamW(p, lr=1e-4, fused=True, compensation="stochastic")),
    }
    runs = {}
    for name, (bf16, make) in rows.items():
        opt = make(build(args.size, bf16))
        opt.step()  # state made, kernel compiled

        def run(opt=opt):
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t0)
            return times

        runs[name] = run
    times = {k: statistics.median(v) for k, v in interleave(runs, args.rounds).items()}
    base = times["torch AdamW fused, fp32 weights"]
    n = sum(p.numel() for p in build(args.size, False))
    print(f"pycode {args.size}: {n / 1e6:.1f}M parameters, {torch.get_num_threads()} threads, "
          f"median of {args.steps} x {args.rounds} steps")
    for name, t in times.items():
        print(f"  {name:<40} {t * 1e3:8.1f} ms  x{t / base:5.2f} of torch's fused fp32 step")


if __name__ == "__main__":
    main()
