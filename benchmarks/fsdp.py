"""DDP against FSDP2 (Accelerator(fsdp_plugin=...)) with 2 gloo ranks on pycode, per precision.

Prints, per rank 0: its peak tensor memory (the most bytes of tensors alive at once over the
first two steps, optimizer state creation included, from torch.profiler's allocation events: the
CPU's counterpart of torch.cuda.max_memory_allocated), the bytes of training state it holds
(parameters + gradients + optimizer state, its local shards), its peak resident memory, and the
median step time of the steps after those two; then FSDP2's ratios to DDP in the same invocation. Both ranks share this machine's cores, so a step time is
the time of both ranks' work and of gloo over loopback, not of one device's compute.

    .venv/bin/python benchmarks/fsdp.py [--size small|mini] [--steps 12] [--precisions fp32,bf16]

(bf16 is emulated on a CPU without AVX512-BF16/AMX: there ``--steps 1`` keeps it to minutes.)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def worker(args) -> None:
    from torch.profiler import ProfilerActivity, profile

    from mixprec import Accelerator, FullyShardedDataParallelPlugin, get_task
    from mixprec.apps.bench import tensor_peak_bytes

    fsdp = FullyShardedDataParallelPlugin() if args.mode == "fsdp" else None
    acc = Accelerator(mixed_precision=args.precision, cpu=True, fsdp_plugin=fsdp)
    task = get_task("pycode", args.size)
    torch.manual_seed(0)
    model = task.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dl = torch.utils.data.DataLoader(task.train_dataset, batch_size=args.batch_size, shuffle=True,
                                     collate_fn=task.collate_fn, drop_last=True)
    model, opt, dl = acc.prepare(model, opt, dl)
    times, state_bytes = [], 0
    it = iter(dl)

    def step(i: int) -> None:
        nonlocal state_bytes
        acc.backward(model(**next(it)).loss)
        if i == 0:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
        opt.step()
        if i == 0:
            state = [t for s in opt.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
            state_bytes = local_bytes(model.parameters()) + local_bytes(grads) + local_bytes(state)
            del grads, state
        opt.zero_grad(set_to_none=True)
        acc.wait_for_everyone()

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for i in range(2):  # the first steps, measured for memory only (the profiler slows them)
            step(i)
    peak_tensor_bytes = tensor_peak_bytes(prof)
    for i in range(2, args.steps + 2):
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    if acc.is_main_process:
        Path(args.out).write_text(json.dumps({
            "state_bytes": state_bytes, "peak_tensor_bytes": peak_tensor_bytes, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "step_s": statistics.median(times)}))
    acc.end_training()


def launch(mode: str, precision: str, args) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "r.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(port), __file__, "--worker", "--mode", mode, "--precision", precision,
               "--size", args.size, "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--out", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            sys.exit(f"{mode}/{precision} failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=["small", "mini", "tiny"], default="small")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--precision", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    print(f"pycode {args.size}, 2 gloo ranks on this machine, batch {args.batch_size} per rank, "
          f"median of {args.steps} steps; rank 0's figures")
    print(f"{'precision':<10} {'mode':<5} {'peak tensor MiB':>16} {'state MiB':>10} {'peak RSS MiB':>13} "
          f"{'step ms':>9}")
    for precision in args.precisions.split(","):
        r = {mode: launch(mode, precision, args) for mode in ("ddp", "fsdp")}
        for mode, x in r.items():
            print(f"{precision:<10} {mode:<5} {x['peak_tensor_bytes'] / 2**20:>16.1f} {x['state_bytes'] / 2**20:>10.1f} "
                  f"{x['peak_rss_bytes'] / 2**20:>13.0f} {x['step_s'] * 1e3:>9.1f}")
        d, f = r["ddp"], r["fsdp"]
        print(f"{precision:<10} fsdp/ddp: peak tensor memory {f['peak_tensor_bytes'] / d['peak_tensor_bytes']:.2f}x, "
              f"state {f['state_bytes'] / d['state_bytes']:.2f}x, peak RSS "
              f"{f['peak_rss_bytes'] / d['peak_rss_bytes']:.2f}x, step time {f['step_s'] / d['step_s']:.2f}x")


if __name__ == "__main__":
    main()
