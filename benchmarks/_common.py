"""Shared pieces of the benchmarks: the jobs, a timer, and how results are printed."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from mixprec.tasks import GPT, GPTConfig, collate
from mixprec.tasks.digits import DigitsDataset, DigitsMLP
from mixprec.tasks.pycode import ByteBlockDataset, load_pycode_bytes

GPT_SMALL = GPTConfig(block_size=128, n_layer=2, n_head=4, n_embd=128)
GPT_MINI = GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=256)


def gpt_job(config: GPTConfig = GPT_SMALL, max_bytes: int = 400_000):
    """A byte-level GPT on the standard library's source: (model factory, dataset)."""
    data = ByteBlockDataset(load_pycode_bytes("train", max_bytes=max_bytes), config.block_size)
    return (lambda: GPT(config)), data


def digits_job():
    """An MLP on scikit-learn's bundled digits: (model factory, dataset)."""
    return (lambda: DigitsMLP(hidden_size=128)), DigitsDataset("train")


def timed_steps(dl, steps: int, step: Callable[[object], None]) -> list[float]:
    """Run ``step(batch)`` ``steps`` times over ``dl`` (restarting it when it runs out); per-step seconds."""
    times, it = [], iter(dl)
    t0 = time.perf_counter()
    for _ in range(steps):
        batch = next(it, None)
        if batch is None:
            it = iter(dl)
            batch = next(it)
        step(batch)
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    return times


def hand_runner(model, data, batch_size, dtype, *, clip=None, fused=True, seed=0) -> Callable[[int], list[float]]:
    """The hand-written torch.autocast loop, the baseline: its optimizer and loader are built once, and
    each call of the returned ``run(steps)`` goes on training where the last one stopped (per-step seconds).

    Runners compared in one invocation must live alike: an optimizer built afresh each round is
    faster than one that lives on, on a CPU, because AdamW's moments of weights whose gradient is
    always zero (the digits' blank pixels) decay into subnormal floats after some hundreds of steps.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    g = torch.Generator().manual_seed(seed)
    dl = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=True, collate_fn=collate, generator=g)

    def step(batch):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = model(**batch).loss
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return lambda steps: timed_steps(dl, steps, step)


def hand_loop(model, data, batch_size, dtype, steps, **kwargs) -> list[float]:
    """One run of the hand-written loop from a fresh optimizer and loader; per-step seconds."""
    return hand_runner(model, data, batch_size, dtype, **kwargs)(steps)


def median_after_warmup(times: list[float], warmup: int = 3) -> float:
    return statistics.median(times[warmup:] if len(times) > warmup + 2 else times)


def interleave(runs: dict[str, Callable[[], list[float]]], rounds: int) -> dict[str, list[float]]:
    """Call each run once per round, in turn, so drift in the machine's speed hits all alike; every
    other round in the reverse order, so that no run always follows the same one (what ran just
    before, a bf16 run on AMX say, can slow the next run's first steps)."""
    out: dict[str, list[float]] = {k: [] for k in runs}
    names = list(runs)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            out[name] += runs[name]()
    return out
