"""torchao float8 training of a Linear stack against bf16 autocast: step time, same process.

A transformer-block-shaped MLP stack (d -> 4d -> d, several layers), compiled, forward and backward
with an AdamW step; each contestant timed with CUDA events after warm-up, interleaved in rounds.
Run on a CUDA device of compute capability 8.9+ (fp8 kernels); elsewhere it says so and exits.

    python benchmarks/fp8_linear_probe.py [--dim 4096] [--tokens 16384] [--layers 4]
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
from torch import nn


def build(dim: int, layers: int) -> nn.Module:
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(dim, 4 * dim, bias=False), nn.GELU(), nn.Linear(4 * dim, dim, bias=False)]
    return nn.Sequential(*blocks)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("needs CUDA with compute capability 8.9+; none here")
        return 0
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    base = build(a.dim, a.layers).cuda()
    x = torch.randn(a.tokens, a.dim, device="cuda")
    contestants = {}
    for name in ["bf16-mixed", "tensorwise", "rowwise", "rowwise_with_gw_hp"]:
        m = copy.deepcopy(base)
        if name != "bf16-mixed":
            convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(name))
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
        fn = torch.compile(m)
        contestants[name] = (fn, opt)

    def step(fn, opt):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(x)
        loss = y.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for fn, opt in contestants.values():
        for _ in range(3):
            step(fn, opt)
    torch.cuda.synchronize()
    times = {n: [] for n in contestants}
    for _ in range(a.rounds):
        for name, (fn, opt) in contestants.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(a.steps):
                step(fn, opt)
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / a.steps)
    flops = 6 * a.tokens * a.layers * 2 * a.dim * 4 * a.dim
    ref = statistics.median(times["bf16-mixed"])
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: {a.layers} x (Linear {a.dim}->{4 * a.dim}->{a.dim}), "
          f"{a.tokens} tokens, compiled, AdamW fused; median of {a.rounds} rounds x {a.steps} steps")
    print(f"{'contestant':<20}{'ms/step':>10}{'TFLOP/s':>10}{'speed-up':>10}")
    for name, t in times.items():
        ms = statistics.median(t)
        print(f"{name:<20}{ms:>10.2f}{flops / ms / 1e9:>10.0f}{ref / ms:>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
