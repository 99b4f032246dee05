"""Print the batches a prepared shuffled DataLoader gives each process for three epochs, under
Accelerate or mixprec (for test_accelerate_dropin.py):

    python -m torch.distributed.run --nproc_per_node 2 batch_order.py accelerate|mixprec plain|seedable|uneven|split
"""

import json
import os
import sys

import torch
from torch.utils.data import DataLoader

lib, mode = sys.argv[1], sys.argv[2]
if lib == "mixprec":
    import mixprec as mod
else:
    import accelerate as mod

torch.manual_seed(42)
config = {"plain": {}, "seedable": {"use_seedable_sampler": True}, "uneven": {"even_batches": False},
          "split": {"split_batches": True}}[mode]
acc = mod.Accelerator(cpu=True, dataloader_config=mod.DataLoaderConfiguration(**config))
dl = acc.prepare(DataLoader(list(range(11)), batch_size=4 if mode == "split" else 3, shuffle=True))
orders = [[b.tolist() for b in dl] for _ in range(3)]
line = f"ORDER {acc.process_index} " + json.dumps({"orders": orders, "rng_after": torch.rand(1).item()}) + "\n"
os.write(1, line.encode())  # one write: the processes share the launcher's stdout
acc.wait_for_everyone()  # both done before either tears its process group down
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
