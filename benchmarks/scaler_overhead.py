"""Per-step cost of mixprec.LossScaler against torch.amp.GradScaler, in one run.

Both scalers drive the same fp16-autocast training step of the same model, interleaved in
rounds so that drift in the machine's speed hits both alike. Prints the median step time of
each and their ratio. On CUDA it also counts host-device syncs per step with
torch.cuda.set_sync_debug_mode("warn"); on the CPU there is no device to sync with (see the
note printed at the end).

    .venv/bin/python benchmarks/scaler_overhead.py [--steps 200] [--rounds 5] [--fused]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from mixprec import LossScaler


def make(device, fused):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 10)
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused, foreach=None if fused else True)
    return model, opt


def step(model, opt, scaler, x, y, device):
    with torch.autocast(device.type, dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def time_steps(model, opt, scaler, device, n):
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(64, 256, generator=g).to(device)
    y = torch.randint(0, 10, (64,), generator=g).to(device)
    times = []
    for _ in range(n):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(model, opt, scaler, x, y, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def count_syncs(model, opt, scaler, device, n=5):
    if device.type != "cuda":
        return None
    x = torch.randn(64, 256, device=device)
    y = torch.randint(0, 10, (64,), device=device)
    step(model, opt, scaler, x, y, device)  # warm-up creates the scale lazily
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(n):
                step(model, opt, scaler, x, y, device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fused", action="store_true", help="fused AdamW (the sync-free path)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    runs = {
        "torch.amp.GradScaler": lambda: torch.amp.GradScaler(device.type),
        "mixprec.LossScaler": lambda: LossScaler(device.type),
        "mixprec.LossScaler(hysteresis=2, bounds)": lambda: LossScaler(
            device.type, hysteresis=2, min_scale=1.0, max_scale=2.0**24),
    }
    setups = {name: (make(device, args.fused), factory()) for name, factory in runs.items()}
    times = {name: [] for name in runs}
    for (model, opt), scaler in setups.values():
        time_steps(model, opt, scaler, device, 20)  # warm-up
    for _ in range(args.rounds):
        for name, ((model, opt), scaler) in setups.items():
            times[name] += time_steps(model, opt, scaler, device, args.steps // args.rounds)
    base = statistics.median(times["torch.amp.GradScaler"])
    print(f"device={device} fused={args.fused} steps={args.steps} (median step time, ratio to GradScaler)")
    for name, t in times.items():
        med = statistics.median(t)
        syncs = count_syncs(*setups[name][0], runs[name](), device)
        sync_txt = "" if syncs is None else f"  syncs/step={syncs:g}"
        print(f"  {name:<44} {med * 1e3:8.3f} ms  x{med / base:6.3f}{sync_txt}")
    if device.type == "cpu":
        print("syncs: not countable on the CPU. By the code: LossScaler.update() keeps scale, tracker, hysteresis "
              "and counters on the device (torch.where / _amp_update_scale_, no .item()); the only reads are "
              "GradScaler's own found-inf .item() for non-fused optimizers (absent with --fused) and, when "
              "max_consecutive_skips is set, one read of the skip counter.")


if __name__ == "__main__":
    main()
