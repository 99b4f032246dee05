"""AdamW's step over transformers' two parameter groups (with and without weight decay, alike at
the default ``weight_decay=0.0``): torch group by group against mixprec's step of alike groups as
one (``mixprec.precision.grouped_step``), on the parameters of the benchmarks' two jobs, interleaved.

Prints the median time of one ``step()`` each way and the difference; the weights and the optimizer
state come out the same bit for bit (tests/precision/test_grouped_step.py).

    .venv/bin/python benchmarks/grouped_step.py [--steps 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mixprec.precision import grouped_step

from _common import GPT_SMALL, digits_job, gpt_job


def two_groups(model: torch.nn.Module) -> list[dict]:
    """transformers' Trainer's groups: biases and norms without weight decay, the rest with it (0.0 here)."""
    named = list(model.named_parameters())
    no_decay = [p for n, p in named if n.endswith("bias") or p.dim() < 2]
    decay = [p for n, p in named if not (n.endswith("bias") or p.dim() < 2)]
    return [{"params": decay, "weight_decay": 0.0}, {"params": no_decay, "weight_decay": 0.0}]


def timed(step, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fused AdamW")
    for name, (factory, _) in (("MLP on digits", digits_job()), ("GPT 2x128", gpt_job(GPT_SMALL))):
        torch.manual_seed(0)
        model = factory()
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        opt = torch.optim.AdamW(two_groups(model), lr=1e-4, fused=True)
        ways = {"torch, group by group": opt.step, "mixprec, alike groups as one": lambda o=opt: grouped_step.step(o)}
        times = {k: [] for k in ways}
        for _ in range(args.rounds):
            for k, step in ways.items():
                times[k] += timed(step, args.steps)[10:]
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        n = sum(p.numel() for p in model.parameters())
        print(f"{name} ({n:,} parameters in {len(list(model.parameters()))} tensors):")
        for k, v in med.items():
            print(f"  {k:<30} {v:7.1f} us/step")
        base = med["torch, group by group"]
        print(f"  saved {base - med['mixprec, alike groups as one']:+.1f} us/step")


if __name__ == "__main__":
    main()
