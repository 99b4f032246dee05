"""Two processes train one Linear on their own data with LocalSGD (mixprec's, or Accelerate's
driven by mixprec's Accelerator) and print the weights after each step (for
test_accelerate_dropin.py):

    python -m torch.distributed.run --nproc_per_node 2 local_sgd_two.py mixprec|accelerate
"""

import json
import os
import sys

import torch

from mixprec import Accelerator

if sys.argv[1] == "mixprec":
    from mixprec import LocalSGD
else:
    from accelerate.local_sgd import LocalSGD

torch.manual_seed(0)
acc = Accelerator(cpu=True)
model = torch.nn.Linear(3, 1)
model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
# The prepared (DDP) model passes what it does not have through to the model.
assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
assert model.in_features == 3 and model.weight is model.module.weight
gen = torch.Generator().manual_seed(1 + acc.process_index)  # each process its own data
weights = []
with LocalSGD(accelerator=acc, model=model, local_sgd_steps=2) as local_sgd:
    for _ in range(5):
        x = torch.randn(4, 3, generator=gen)
        acc.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
        local_sgd.step()
        weights.append(model.module.weight.detach().flatten().tolist())
weights.append(model.module.weight.detach().flatten().tolist())  # after the block's closing average
os.write(1, (f"WEIGHTS {acc.process_index} " + json.dumps(weights) + "\n").encode())
acc.wait_for_everyone()
torch.distributed.destroy_process_group()
