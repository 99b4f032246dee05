"""fp8 against bf16-mixed on the width-2048 GPT (benchmarks/gpt_wide.py), compiled, three ways in one
process: mixprec's Accelerator, and torchao's recipe written by hand (convert_to_float8_training,
torch.compile, bf16 autocast) -- to tell mixprec's cost from fp8's own. CUDA only.

    PYTHONPATH=src:benchmarks python benchmarks/fp8_gpt_check.py
"""

from __future__ import annotations

import statistics
import sys

import torch

import gpt_wide
from mixprec import Accelerator


def batches(n: int, bs: int = 16):
    data = gpt_wide.build_data()["train"]
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        idx = torch.randint(len(data), (bs,), generator=g).tolist()
        yield torch.utils.data.default_collate([data[i] for i in idx])


def timed(step, n_warm: int = 3, n: int = 10) -> float:
    it = batches(n_warm + n)
    for _ in range(n_warm):
        step(next(it))
    torch.cuda.synchronize()
    times = []
    for b in it:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        step(b)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def with_mixprec(precision: str) -> float:
    torch.manual_seed(0)
    acc = Accelerator(mixed_precision=precision, compile=True)
    model = gpt_wide.build_model()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))

    def step(b):
        b = {k: v.to(acc.device) for k, v in b.items()}
        acc.backward(model(**b).loss)
        opt.step()
        opt.zero_grad()
    ms = timed(step)
    if precision == "fp8":
        print("  ", acc.precision_report().line(), flush=True)
    return ms


def by_hand(fp8: bool) -> float:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from mixprec.precision.fp8 import float8_layer_choice

    torch.manual_seed(0)
    model = gpt_wide.build_model().cuda()
    if fp8:
        chosen = {n for n, why in float8_layer_choice(model).items() if why is None}
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                                   module_filter_fn=lambda m, fqn: fqn in chosen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    compiled = torch.compile(model)

    def step(b):
        b = {k: v.cuda() for k, v in b.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return timed(step)


if __name__ == "__main__":
    which = sys.argv[1:] or ["hand", "mixprec"]
    if "hand" in which:
        b, f = by_hand(False), by_hand(True)
        print(f"by hand:  bf16-mixed {b:.1f} ms, fp8 {f:.1f} ms, fp8 speed-up {b / f:.2f}x", flush=True)
    if "mixprec" in which:
        b, f = with_mixprec("bf16-mixed"), with_mixprec("fp8")
        print(f"mixprec:  bf16-mixed {b:.1f} ms, fp8 {f:.1f} ms, fp8 speed-up {b / f:.2f}x", flush=True)
