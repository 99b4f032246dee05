"""The save of a checkpoint by transformers' Trainer under the switch, against stock transformers and
against the durable floor (issue 47).

The state: a GPT-2 (``--layers`` blocks of width 768, a vocabulary of 8192) after one AdamW step,
in fp32 on the CPU: ``--layers 6`` makes a checkpoint of about 590 MB (the weights, the optimizer's
moments, the schedule, the RNG, the trainer state). Three ways to write it, each timed around one
call of ``Trainer._save_checkpoint`` or its equivalent:

- ``stock``: transformers' own save, without the switch (no fsync, no checksum, no atomic commit:
  not durable, so it can be faster than the floor);
- ``switch``: the same Trainer's save under ``mixprec.patch_transformers()``: the same files into a
  staging folder, each fsynced and hashed (sha256), the manifest, the rename;
- ``floor``: the least a durable copy of the same bytes costs: stock's save, then each of its
  files fsynced, and the folder (no staging, no checksum, no manifest, no rename).

Each job starts after ``os.sync()`` (no writeback of the one before), the jobs interleaved in rounds
with their order rotating; the figures are the medians of the seconds and of the per-round ratios
to the floor.

    .venv/bin/python benchmarks/engine_checkpoint_save.py [--rounds 5] [--layers 6] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import transformers

import mixprec

JOBS = ("stock", "switch", "floor")


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        ids = torch.arange(16) * (i + 1) % 8192
        return {"input_ids": ids, "labels": ids}


def trainer(out: Path, layers: int) -> transformers.Trainer:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=8192, n_positions=16, n_embd=768, n_layer=layers, n_head=12)
    args = transformers.TrainingArguments(str(out), max_steps=1, per_device_train_batch_size=4, save_strategy="no",
                                          report_to="none", disable_tqdm=True, use_cpu=True)
    t = transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=Rows())
    t.train()  # one step: the optimizer's moments exist
    return t


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def save(t: transformers.Trainer, out: Path, step: int) -> Path:
    t.args.output_dir = str(out)
    t.state.global_step = step
    t._save_checkpoint(t.model, None)
    return out / f"checkpoint-{step}"


def fsync_all(folder: Path) -> None:
    """Each file of ``folder`` fsynced, then the folder itself."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    fd = os.open(folder, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder on the disk of the cwd)")
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    root = Path(tempfile.mkdtemp(prefix="engine-save-", dir=a.dir or "."))
    try:
        stock = trainer(root / "stock-train", a.layers)
        with mixprec.patch_transformers():
            switch = trainer(root / "switch-train", a.layers)
        first = save(stock, root / "sample", 1)
        files = [p.name for p in sorted(first.iterdir()) if p.is_file()]
        size = folder_bytes(first)
        shutil.rmtree(root / "sample")
        print(f"checkpoint: {size / 1e6:.0f} MB in {len(files)} files ({', '.join(files)}); torch {torch.__version__}, "
              f"transformers {transformers.__version__}, {torch.get_num_threads()} threads")
        seconds = {j: [] for j in JOBS}
        ratios = {j: [] for j in JOBS}
        for r in range(a.rounds):
            order = JOBS[r % 3:] + JOBS[:r % 3]
            this = {}
            for job in order:
                out = root / f"{job}-{r}"
                os.sync()
                t0 = time.perf_counter()
                # the switch's Trainer carries its hooks: the save itself is the same call
                folder = save(switch if job == "switch" else stock, out, 1)
                if job == "floor":
                    fsync_all(folder)
                this[job] = time.perf_counter() - t0
                assert folder_bytes(out / "checkpoint-1") >= size, job
                shutil.rmtree(out)
            for job in JOBS:
                seconds[job].append(this[job])
                ratios[job].append(this[job] / this["floor"])
            print(f"round {r + 1}: " + ", ".join(f"{j} {this[j]:.2f} s" for j in order), flush=True)
        print("\n| job | seconds (median) | against the floor (median of the rounds) |\n|---|---|---|")
        for job in JOBS:
            print(f"| {job} | {statistics.median(seconds[job]):.2f} | {statistics.median(ratios[job]):.2f}x |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
