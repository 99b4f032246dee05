"""Print the batches prepared DataLoaders give each process for three epochs, under Accelerate or
mixprec, one line per mode (for test_accelerate_dropin.py):

    python -m torch.distributed.run --nproc_per_node 2 batch_order.py accelerate|mixprec MODE[,MODE...]

Modes: plain, seedable, uneven, split (shuffled, sharded); dispatch, dispatch_split (shuffled,
dispatched from process 0); iterable (an IterableDataset, dispatched by default).
"""

import json
import os
import sys

import torch
from torch.utils.data import DataLoader, IterableDataset

lib, modes = sys.argv[1], sys.argv[2].split(",")
if lib == "mixprec":
    import mixprec as mod
else:
    import accelerate as mod

CONFIGS = {"plain": {}, "seedable": {"use_seedable_sampler": True}, "uneven": {"even_batches": False},
           "split": {"split_batches": True}, "dispatch": {"dispatch_batches": True},
           "dispatch_split": {"dispatch_batches": True, "split_batches": True}, "iterable": {}}


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(11))


acc = None
for mode in modes:
    torch.manual_seed(42)
    acc = mod.Accelerator(cpu=True, dataloader_config=mod.DataLoaderConfiguration(**CONFIGS[mode]))
    split = "split" in mode
    if mode == "iterable":
        loader = DataLoader(Stream(), batch_size=3)
    else:
        loader = DataLoader(list(range(11)), batch_size=4 if split else 3, shuffle=True)
    dl = acc.prepare(loader)
    orders, gathered = [], []
    for _ in range(3):
        epoch, seen = [], []
        for b in dl:
            epoch.append(b.tolist())
            if mode != "uneven":  # there some processes have a batch fewer: nothing to gather with
                seen += acc.gather_for_metrics(b).tolist()
        orders.append(epoch)
        gathered.append(sorted(seen))
    record = {"mode": mode, "orders": orders, "gathered": gathered, "rng_after": torch.rand(1).item(),
              "is_dataloader": isinstance(dl, DataLoader)}
    if mode != "iterable":
        record["len"] = len(dl)
    os.write(1, f"ORDER {acc.process_index} {json.dumps(record)}\n".encode())  # one write: a shared stdout
    acc.wait_for_everyone()
acc.wait_for_everyone()  # all done before any tears its process group down
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
