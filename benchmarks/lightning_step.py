"""Steps per second of Lightning's Trainer under ``MixprecPrecision("bf16-mixed")`` against the same
Trainer under Lightning's own ``precision="bf16-mixed"`` (issue 48).

The same LightningModule, data, batch size and optimizer (fused AdamW, lr 1e-3) in both; only the
precision plugin differs. Two jobs: an MLP on scikit-learn's digits (batch 32: the per-step overhead
shows) and a small GPT on the standard library's source (batch 8). The two runners are interleaved
in rounds (every other round in the reverse order), each round a fresh ``Trainer.fit`` of
``--steps`` steps; a step's time is the interval between consecutive ``on_train_batch_end`` calls
(data loading included), the first 5 of each fit left out as warm-up. Printed per job: each
runner's median step time, and mixprec's throughput against Lightning's (Lightning's median step
time over mixprec's), overall and the median of the per-round ratios.

    .venv/bin/python benchmarks/lightning_step.py [--steps 80] [--rounds 6] [--jobs mlp gpt]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import lightning as L
import torch

from mixprec.lightning import MixprecPrecision
from mixprec.tasks import collate

from _common import digits_job, gpt_job

WARMUP = 5


class Step(L.LightningModule):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)


class Stamps(L.Callback):
    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_end(self, *args) -> None:
        self.stamps.append(time.perf_counter())


def fit(make_model, data, batch_size: int, steps: int, how: dict) -> list[float]:
    """One fit of ``steps`` steps; the step intervals after the warm-up, in seconds."""
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=True, collate_fn=collate,
                                         generator=torch.Generator().manual_seed(0))
    stamps = Stamps()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[stamps],
                        **{k: v() if callable(v) else v for k, v in how.items()})
    trainer.fit(Step(make_model()), loader)
    gaps = [b - a for a, b in zip(stamps.stamps, stamps.stamps[1:])]
    return gaps[WARMUP:]


RUNNERS = {"lightning": {"precision": "bf16-mixed"},
           "mixprec": {"plugins": lambda: [MixprecPrecision("bf16-mixed", device="cpu")]}}
JOBS = {"mlp": (digits_job, 32), "gpt": (gpt_job, 8)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("mixprec").setLevel(logging.ERROR)
    print(f"torch {torch.__version__}, lightning {L.__version__}, {torch.get_num_threads()} threads, "
          f"{args.steps} steps x {args.rounds} rounds")
    for job in args.jobs:
        factory, batch_size = JOBS[job]
        make_model, data = factory()
        rounds: dict[str, list[float]] = {name: [] for name in RUNNERS}
        times: dict[str, list[float]] = {name: [] for name in RUNNERS}
        names = list(RUNNERS)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else reversed(names):
                gaps = fit(make_model, data, batch_size, args.steps, RUNNERS[name])
                times[name] += gaps
                rounds[name].append(statistics.median(gaps))
        theirs, ours = (statistics.median(times[n]) for n in ("lightning", "mixprec"))
        per_round = statistics.median(a / b for a, b in zip(rounds["lightning"], rounds["mixprec"]))
        print(f"{job}: lightning bf16-mixed {theirs * 1e3:.3f} ms/step, MixprecPrecision bf16-mixed "
              f"{ours * 1e3:.3f} ms/step; mixprec's throughput {theirs / ours:.3f}x Lightning's "
              f"(per-round median {per_round:.3f}x; {ours * 1e6 - theirs * 1e6:+.0f} us a step)")


if __name__ == "__main__":
    main()
