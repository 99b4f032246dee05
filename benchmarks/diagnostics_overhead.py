"""Overhead of mixprec's gradient statistics, sampled every 1, 10 and 100 steps, on a small GPT.

The same training loop through mixprec.Accelerator with diagnostics off and with
gradient_stats_every=N, interleaved in rounds in one invocation. The figure is the mean step
time (a sampled step's cost is spread over the N steps; a median would hide it) as a ratio to
the run without diagnostics. Target: below 3% at every 10 steps.

    .venv/bin/python benchmarks/diagnostics_overhead.py [--steps 50] [--rounds 6] [--precision bf16]
"""

from __future__ import annotations

import argparse

import torch

from mixprec import Accelerator
from mixprec.tasks import collate

from _common import GPT_MINI, GPT_SMALL, gpt_job, interleave, timed_steps


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50, help="steps per round and variant")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--size", choices=["small", "mini"], default="mini")
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    config = GPT_MINI if args.size == "mini" else GPT_SMALL
    factory, data = gpt_job(config)
    runs = {}
    for every in (0, 1, 10, 100):
        torch.manual_seed(0)
        acc = Accelerator(mixed_precision=args.precision, cpu=True, diagnostics={"gradient_stats_every": every})
        model = factory()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        dl = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True, collate_fn=collate,
                                         generator=torch.Generator().manual_seed(0))
        model, opt, dl = acc.prepare(model, opt, dl)
        def run(acc=acc, model=model, opt=opt, dl=dl):
            def step(batch):
                acc.backward(model(**batch).loss)
                opt.step()
                opt.zero_grad(set_to_none=True)

            seconds = sum(timed_steps(dl, args.steps, step))
            if acc.monitor is not None:
                acc.monitor.stats.clear()  # what a log line would read; keeps memory flat
            return [seconds / args.steps]

        runs["off" if every == 0 else f"every {every}"] = run
    for r in runs.values():  # warm-up
        r()
    times = interleave(runs, args.rounds)
    mean = {k: sum(v) / len(v) for k, v in times.items()}
    n = sum(p.numel() for p in factory().parameters())
    print(f"GPT {config.n_layer}x{config.n_embd} ({n / 1e6:.1f}M parameters), batch {args.batch_size}, "
          f"{args.precision}, {args.rounds} rounds x {args.steps} steps, {torch.get_num_threads()} threads")
    for k, v in mean.items():
        print(f"  gradient stats {k:<10} {v * 1e3:8.2f} ms/step   x{v / mean['off']:.3f}")


if __name__ == "__main__":
    main()
