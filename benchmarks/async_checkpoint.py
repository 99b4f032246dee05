"""How long save_state blocks the training loop: synchronous against async_save=True, in one invocation.

A GPT of pycode's ``small`` size with its AdamW state, in one process; each round saves once each
way (the asynchronous one is waited for before the next round, outside the timed part). Prints
the median blocked seconds of each and their ratio; the asynchronous save blocks for the copy of
the state to CPU memory only.

    .venv/bin/python benchmarks/async_checkpoint.py [--rounds 3] [--size small|mini]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from mixprec import Accelerator, get_task


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", choices=["small", "mini", "tiny"], default="small")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    task = get_task("pycode", args.size)
    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model = task.build_model()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    batch = task.collate_fn([task.train_dataset[i] for i in range(4)])
    acc.backward(model(**batch).loss)
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    times: dict[str, list[float]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.rounds + 1):  # the first round warms up
            for kind in ("sync", "async"):
                t0 = time.perf_counter()
                acc.save_state(Path(d) / f"{kind}_{r}", async_save=kind == "async")
                blocked = time.perf_counter() - t0
                acc.wait_for_checkpoint()
                if r:
                    times[kind].append(blocked)
    s, a = statistics.median(times["sync"]), statistics.median(times["async"])
    print(f"pycode {args.size}: {n / 1e6:.1f}M parameters + AdamW state, median of {args.rounds} saves")
    print(f"save_state blocks: sync {s:.3f} s, async_save {a:.3f} s; async/sync {a / s:.2f}x")


if __name__ == "__main__":
    main()
