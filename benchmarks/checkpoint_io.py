"""save_state and load_state of a ~1.6 GB state against the durable floor and against Accelerate.

The state: 8 x Linear(4096, 4096) in fp32 and its AdamW state after one step (0.54 GB of weights,
1.07 GB of moments), in one process on the CPU. Three ways to write it and read it back:

- ``floor``: the least a durable checkpoint costs: safetensors for the weights and ``torch.save``
  for the optimizer, each file fsynced; loaded back with ``safetensors.torch.load_model`` and
  ``torch.load(weights_only=True)``. No checksum, no atomic commit.
- ``mixprec``: ``Accelerator.save_state`` / ``load_state`` (sha256 of every file computed while it
  is written and while it is read, every file fsynced, the folder committed atomically).
- ``accelerate``: Hugging Face Accelerate's ``save_state`` / ``load_state`` (not fsynced, no
  checksum), where it is installed.

Each job runs in a fresh process (nothing cached in Python) and starts after ``sync`` (no writeback
of the one before), the runners interleaved in rounds, their order rotating, so drift in the
machine's speed hits all alike; the figures are the medians over the rounds of each
runner's seconds and of the per-round ratios to the floor. ``--cold`` drops the page cache
before each load (needs root): the load then reads from the disk, as a resume after a restart
does; without it the files are still in memory from the save.

    .venv/bin/python benchmarks/checkpoint_io.py [--rounds 5] [--cold] [--layers 8] [--dim 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

RUNNERS = ("floor", "mixprec", "accelerate")


def build(layers: int, dim: int):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, dim)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def drop_page_cache() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as fh:
        fh.write("3\n")


def one_job(runner: str, where: Path, layers: int, dim: int, cold: bool) -> dict[str, float]:
    """Build the state, save it, (drop the page cache,) load it back; the two wall times."""
    import safetensors.torch
    import torch

    warnings.filterwarnings("ignore")
    model, opt = build(layers, dim)
    if runner == "floor":
        def save() -> None:
            where.mkdir(parents=True)
            safetensors.torch.save_file(model.state_dict(), str(where / "model.safetensors"))
            fd = os.open(where / "model.safetensors", os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            with open(where / "optimizer.bin", "wb") as fh:
                torch.save(opt.state_dict(), fh)
                fh.flush()
                os.fsync(fh.fileno())

        def load() -> None:
            safetensors.torch.load_model(model, str(where / "model.safetensors"))
            opt.load_state_dict(torch.load(where / "optimizer.bin", weights_only=True))
    else:
        if runner == "mixprec":
            from mixprec import Accelerator
        else:
            from accelerate import Accelerator
        acc = Accelerator(cpu=True)
        model, opt = acc.prepare(model, opt)

        def save() -> None:
            acc.save_state(str(where))

        def load() -> None:
            acc.load_state(str(where))
    t = time.perf_counter()
    save()
    saved = time.perf_counter() - t
    if cold:
        drop_page_cache()
    t = time.perf_counter()
    load()
    loaded = time.perf_counter() - t
    return {"save_s": saved, "load_s": loaded}


def available(runner: str) -> bool:
    if runner != "accelerate":
        return True
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each load (root)")
    ap.add_argument("--one", choices=RUNNERS, help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_job(args.one, Path(args.dir), args.layers, args.dim, args.cold)))
        return
    runners = [r for r in RUNNERS if available(r)]
    results: dict[str, list[dict[str, float]]] = {r: [] for r in runners}
    root = Path(tempfile.mkdtemp(prefix="mixprec-ckpt-bench-", dir=os.environ.get("BENCH_DIR")))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))}
    try:
        for r in range(args.rounds):
            for runner in runners[r % len(runners):] + runners[:r % len(runners)]:  # the order rotates
                where = root / f"{runner}-{r}"
                os.sync()  # the previous job's writeback finished: each starts from a quiet disk
                time.sleep(1)
                cmd = [sys.executable, __file__, "--one", runner, "--dir", str(where), "--layers", str(args.layers),
                       "--dim", str(args.dim)] + (["--cold"] if args.cold else [])
                out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
                results[runner].append(json.loads(out.strip().splitlines()[-1]))
                shutil.rmtree(where, ignore_errors=True)
                print(f"round {r} {runner:10s} save {results[runner][-1]['save_s']:.2f} s  "
                      f"load {results[runner][-1]['load_s']:.2f} s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gb = args.layers * (args.dim * args.dim + args.dim) * 4 * 3 / 1e9
    print(f"\n{gb:.2f} GB of state, {args.rounds} rounds, {'cold' if args.cold else 'warm'} page cache on load")
    print(f"{'runner':10s} {'save s':>8s} {'load s':>8s} {'save / floor':>13s} {'load / floor':>13s}")
    for runner in runners:
        ratios = {k: statistics.median(a[k] / b[k] for a, b in zip(results[runner], results["floor"]))
                  for k in ("save_s", "load_s")}
        med = {k: statistics.median(x[k] for x in results[runner]) for k in ("save_s", "load_s")}
        print(f"{runner:10s} {med['save_s']:8.2f} {med['load_s']:8.2f} {ratios['save_s']:12.2f}x "
              f"{ratios['load_s']:12.2f}x")


if __name__ == "__main__":
    main()
