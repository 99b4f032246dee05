"""AdamW's ``step()`` and ``zero_grad()`` as torch calls them against mixprec's
(``mixprec.precision.optimizer_calls``: transformers' two parameter groups, alike at the default
``weight_decay=0.0``, stepped as one; torch's step function called without its profiling wrapper,
with an LR scheduler's note set; the gradients set to ``None`` directly), on the parameters of the
benchmarks' two jobs, interleaved, with a ``LambdaLR`` schedule on the optimizer as the Trainer has.

Prints the median time of one ``step()`` plus ``zero_grad()`` each way and the difference; the
weights and the optimizer state come out the same bit for bit (tests/precision/test_optimizer_calls.py).

    .venv/bin/python benchmarks/optimizer_calls.py [--steps 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mixprec.precision import optimizer_calls

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
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fused AdamW, step() + zero_grad()")
    for name, (factory, _) in (("MLP on digits", digits_job()), ("GPT 2x128", gpt_job(GPT_SMALL))):
        torch.manual_seed(0)
        model = factory()
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        opt = torch.optim.AdamW(two_groups(model), lr=1e-4, fused=True)
        torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)  # (wraps the optimizer's step, as in the Trainer)
        grads = [p.grad for p in model.parameters()]

        def torch_calls(o=opt, model=model, grads=grads):
            o.step()
            o.zero_grad(set_to_none=True)
            for p, g in zip(model.parameters(), grads):  # (the same gradients again: not timed apart)
                p.grad = g

        def mixprec_calls(o=opt, model=model, grads=grads):
            optimizer_calls.step(o)
            optimizer_calls.zero_grad(o)
            for p, g in zip(model.parameters(), grads):
                p.grad = g

        ways = {"torch": torch_calls, "mixprec": mixprec_calls}
        times = {k: [] for k in ways}
        for _ in range(args.rounds):
            for k, step in ways.items():
                times[k] += timed(step, args.steps)[10:]
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        n = sum(p.numel() for p in model.parameters())
        print(f"{name} ({n:,} parameters in {len(list(model.parameters()))} tensors):")
        for k, v in med.items():
            print(f"  {k:<30} {v:7.1f} us/step")
        print(f"  saved {med['torch'] - med['mixprec']:+.1f} us/step")


if __name__ == "__main__":
    main()
