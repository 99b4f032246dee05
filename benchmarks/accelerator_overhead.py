"""The same training loop, hand-written with torch.autocast and through mixprec.Accelerator: a small
GPT on the standard library's source (``--size small|mini``) and an MLP on scikit-learn's digits
(batch 32, about a millisecond a step: the Accelerator's own per-step cost shows there).

fp32 and bf16, interleaved in rounds in one invocation. Prints the median step time of each,
mixprec's ratio to the hand-written loop (target: 0.98x its throughput or better), the fixed cost
per step in microseconds (mixprec's median step time less the loop's), and bf16's speed-up over fp32.

    .venv/bin/python benchmarks/accelerator_overhead.py [--steps 30] [--rounds 4] [--size small|mini] [--jobs gpt,mlp]
"""

from __future__ import annotations

import argparse

import torch

from mixprec import Accelerator
from mixprec.tasks import collate

from _common import (
    GPT_MINI,
    GPT_SMALL,
    digits_job,
    gpt_job,
    hand_runner,
    interleave,
    median_after_warmup,
    timed_steps,
)


def accelerator_loop(acc, model, opt, dl, steps):
    def step(batch):
        acc.backward(model(**batch).loss)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed_steps(dl, steps, step)


def compare(name, factory, data, batch_size, steps, rounds):
    """Both loops, fp32 and bf16, interleaved; prints the table for one job."""
    runs = {}
    for prec, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        torch.manual_seed(0)
        hand = hand_runner(factory(), data, batch_size, dtype)  # lives across the rounds, as the Accelerator's
        runs[f"hand-written {prec}"] = (lambda h=hand: h(steps))
        torch.manual_seed(0)
        acc = Accelerator(mixed_precision=prec, cpu=True)
        model = factory()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        g = torch.Generator().manual_seed(0)
        dl = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=True, collate_fn=collate, generator=g)
        model, opt, dl = acc.prepare(model, opt, dl)
        runs[f"mixprec.Accelerator {prec}"] = (lambda a=acc, m=model, o=opt, d=dl: accelerator_loop(a, m, o, d, steps))
    med = {k: median_after_warmup(v) for k, v in interleave(runs, rounds).items()}
    print(f"{name}, batch {batch_size}, fused AdamW, {rounds} rounds x {steps} steps, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    for k, v in med.items():
        print(f"  {k:<28} {v * 1e3:8.3f} ms/step")
    for prec in ("fp32", "bf16"):
        ours, loop = med[f"mixprec.Accelerator {prec}"], med[f"hand-written {prec}"]
        print(f"  {prec}: mixprec throughput {loop / ours:.3f}x the hand-written loop's; fixed cost "
              f"{(ours - loop) * 1e6:+.0f} us/step")
    print(f"  bf16 speed-up over fp32: hand-written {med['hand-written fp32'] / med['hand-written bf16']:.2f}x, "
          f"mixprec {med['mixprec.Accelerator fp32'] / med['mixprec.Accelerator bf16']:.2f}x")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="steps per round and variant")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8, help="the GPT's batch size (the MLP's is 32)")
    ap.add_argument("--size", choices=["small", "mini"], default="small")
    ap.add_argument("--jobs", default="gpt,mlp")
    args = ap.parse_args()
    jobs = args.jobs.split(",")
    if "gpt" in jobs:
        config = GPT_SMALL if args.size == "small" else GPT_MINI
        factory, data = gpt_job(config)
        compare(f"GPT {config.n_layer} layers x {config.n_embd}, block {config.block_size}", factory, data,
                args.batch_size, args.steps, args.rounds)
    if "mlp" in jobs:
        factory, data = digits_job()
        compare("MLP on digits", factory, data, 32, args.steps * 10, args.rounds)


if __name__ == "__main__":
    main()
