"""What skip_nonfinite_steps costs: the same Accelerator loop on pycode's small GPT, with and without
the inf/NaN guard, per precision, interleaved in rounds in one invocation (fused AdamW: no host sync).

    .venv/bin/python benchmarks/nonfinite_guard.py [--steps 12] [--rounds 3] [--precisions bf16,fp32]
"""

from __future__ import annotations

import argparse
import warnings

import torch

from mixprec import Accelerator, PrecisionPerformanceWarning
from mixprec.tasks import collate

from _common import GPT_SMALL, gpt_job, interleave, median_after_warmup, timed_steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="steps per round and variant")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--precisions", default="bf16,fp32")
    args = ap.parse_args()
    warnings.simplefilter("ignore", PrecisionPerformanceWarning)
    factory, data = gpt_job(GPT_SMALL)
    runs = {}
    for prec in args.precisions.split(","):
        for guard in (False, True):
            torch.manual_seed(0)
            acc = Accelerator(mixed_precision=prec, cpu=True, skip_nonfinite_steps=guard)
            model = factory()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
            g = torch.Generator().manual_seed(0)
            dl = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True, collate_fn=collate,
                                             generator=g)
            model, opt, dl = acc.prepare(model, opt, dl)

            def step(batch, acc=acc, model=model, opt=opt):
                acc.backward(model(**batch).loss)
                opt.step()
                opt.zero_grad(set_to_none=True)

            runs[f"{prec} {'guard' if guard else 'no guard'}"] = (
                lambda dl=dl, step=step: timed_steps(dl, args.steps, step))
    med = {k: median_after_warmup(v) for k, v in interleave(runs, args.rounds).items()}
    print(f"pycode small GPT ({GPT_SMALL.n_layer} layers x {GPT_SMALL.n_embd}), batch {args.batch_size}, fused AdamW, "
          f"{args.rounds} rounds x {args.steps} steps, {torch.get_num_threads()} threads")
    for k, v in med.items():
        print(f"  {k:<16} {v * 1e3:8.2f} ms/step")
    for prec in args.precisions.split(","):
        print(f"  {prec}: guard / no guard step time = {med[f'{prec} guard'] / med[f'{prec} no guard']:.3f}")


if __name__ == "__main__":
    main()
