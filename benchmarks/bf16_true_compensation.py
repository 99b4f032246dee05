"""What the compensated update buys bf16-true: validation loss after a fixed number of steps.

The same GPT, data order and AdamW hyperparameters in fp32, in bf16-mixed, and in bf16-true with
the plain (uncompensated) update, Kahan compensation and stochastic rounding (with fp32 moments,
and with bf16 moments, which halve the optimizer state), all through
mixprec.Accelerator in one invocation (each run interleaved by chunks of steps). Prints the
validation loss of each against fp32's and the mean step time against fp32's.

    .venv/bin/python benchmarks/bf16_true_compensation.py [--steps 300] [--size mini]
"""

from __future__ import annotations

import argparse
import math

import torch

from mixprec import Accelerator
from mixprec.tasks import ByteBlockDataset, collate
from mixprec.tasks.pycode import load_pycode_bytes

from _common import GPT_MINI, GPT_SMALL, gpt_job, interleave, timed_steps

# name: (precision, compensation, dtype of the compensated optimizer's moments)
VARIANTS = {"fp32": ("fp32", "none", "fp32"), "bf16-mixed": ("bf16-mixed", "none", "fp32"),
            "bf16-true, plain update": ("bf16-true", "none", "fp32"),
            "bf16-true, Kahan": ("bf16-true", "kahan", "fp32"),
            "bf16-true, stochastic rounding": ("bf16-true", "stochastic", "fp32"),
            "bf16-true, Kahan, bf16 moments": ("bf16-true", "kahan", "bf16"),
            "bf16-true, stochastic, bf16 moments": ("bf16-true", "stochastic", "bf16")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--chunk", type=int, default=50, help="steps per variant per round")
    ap.add_argument("--size", choices=["small", "mini"], default="mini")
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()
    config = GPT_MINI if args.size == "mini" else GPT_SMALL
    factory, data = gpt_job(config, max_bytes=2_000_000)
    val = ByteBlockDataset(load_pycode_bytes("validation", max_bytes=60_000), config.block_size)
    runs, accs = {}, {}
    for name, (precision, compensation, moments) in VARIANTS.items():
        acc = Accelerator(mixed_precision=precision, cpu=True, bf16_true_compensation=compensation,
                          bf16_true_state_dtype=moments)
        torch.manual_seed(0)
        model = factory()
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        dl = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, collate_fn=collate,
                                         generator=torch.Generator().manual_seed(0))
        model, opt, dl = acc.prepare(model, opt, dl)
        accs[name] = (acc, model)
        it_dl = dl

        def step(batch, acc=acc, model=model, opt=opt):
            acc.backward(model(**batch).loss)
            opt.step()
            opt.zero_grad(set_to_none=True)

        runs[name] = lambda it_dl=it_dl, step=step: timed_steps(it_dl, args.chunk, step)
    times = interleave(runs, max(1, args.steps // args.chunk))
    losses = {}
    for name, (acc, model) in accs.items():
        model.eval()
        with torch.no_grad():
            vl = torch.utils.data.DataLoader(val, batch_size=32, collate_fn=collate)
            total = [float(model(**{k: v.to(acc.device) for k, v in b.items()}).loss) for b in vl]
        losses[name] = sum(total) / len(total)
    mean = {k: sum(v) / len(v) for k, v in times.items()}
    print(f"GPT {config.n_layer}x{config.n_embd}, batch 8, AdamW lr {args.lr}, {args.steps} steps per variant, "
          f"{torch.get_num_threads()} threads")
    print(f"  {'variant':<36} {'val loss':>9} {'vs fp32':>8} {'bits/byte':>9} {'ms/step':>8} {'speed-up':>8}")
    for name in VARIANTS:
        print(f"  {name:<36} {losses[name]:>9.4f} {losses[name] / losses['fp32'] - 1:>+8.2%} "
              f"{losses[name] / math.log(2):>9.3f} {mean[name] * 1e3:>8.1f} {mean['fp32'] / mean[name]:>7.2f}x")


if __name__ == "__main__":
    main()
