"""What transformers' Trainer and the libraries on it rely on in Accelerate's objects, recorded under
Accelerate or mixprec (for tests/compat/test_accelerate_contract.py), in one process or under torchrun:

    python accelerate_contract.py accelerate|mixprec OUT_DIR
    python -m torch.distributed.run --nproc_per_node 2 accelerate_contract.py accelerate|mixprec OUT_DIR

Each process writes OUT_DIR/<rank>.json with:

* ``gather``: ``gather_for_metrics`` over a short last batch (a map dataset and an IterableDataset):
  the predictions, and a loss repeated to the batch size as transformers' evaluation loop repeats it;
* ``again``: what a second ``prepare`` of objects prepared already holds after ``free_memory``
  (transformers' second ``train()``), and the weights after a step with them;
* ``skip``: the batches of a resumed epoch through Accelerate's free function ``skip_first_batches``,
  with ``set_epoch`` as transformers' Trainer calls it (default and seedable samplers);
* ``epochs``: three epochs of training (shuffled, dropout) each followed by an evaluation (not
  shuffled): the batches, the gathered predictions, the weights and the global RNG after them.
"""

import json
import os
import sys

import torch
from accelerate import skip_first_batches  # the free function transformers' Trainer calls, on either
from torch.utils.data import DataLoader, IterableDataset

lib, out = sys.argv[1], sys.argv[2]
if lib == "mixprec":
    import mixprec as mod
else:
    import accelerate as mod


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(10, dtype=torch.float32).reshape(10, 1))


def accelerator(**dataloader):
    return mod.Accelerator(cpu=True, dataloader_config=mod.DataLoaderConfiguration(**dataloader))


def gather_case(acc, loader, batch_size):
    dl = acc.prepare(loader)
    preds, losses = [], []
    for batch in dl:
        x = batch if torch.is_tensor(batch) else batch[0]
        preds += acc.gather_for_metrics(x.reshape(-1) * 2).tolist()
        losses += acc.gather_for_metrics(x.mean().reshape(1).repeat(batch_size)).tolist()
    return {"preds": preds, "losses": losses}


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))


def weights(model):
    return [round(float(v), 6) for p in model.parameters() for v in p.detach().reshape(-1)]


record = {}
acc = accelerator()
record["gather"] = {
    "map": gather_case(acc, DataLoader(torch.arange(10, dtype=torch.float32).reshape(10, 1), batch_size=4), 4),
    "iterable": gather_case(acc, DataLoader(Stream(), batch_size=4), 4),
}

# free_memory, then prepare again what was prepared (transformers' Trainer, second train())
acc = accelerator()
model = net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.StepLR(opt, 1)
model, opt, sched = acc.prepare(model, opt, sched)
acc.free_memory()
again = acc.prepare(model, opt, sched)
model.eval()
acc.backward(model(torch.ones(4, 1)).pow(2).mean())
opt.step()
sched.step()
record["again"] = {"same": all(a is b for a, b in zip(again, (model, opt, sched))),
                   "held": [len(acc._models), len(acc._optimizers), len(acc._schedulers)],
                   "weights": weights(model), "lr": sched.get_last_lr()}

# a resumed epoch through skip_first_batches, as transformers' Trainer makes it
record["skip"] = {}
for name, config in (("default", {}), ("seedable", {"use_seedable_sampler": True})):
    torch.manual_seed(7)
    acc = accelerator(**config)
    dl = acc.prepare(DataLoader(list(range(24)), batch_size=3, shuffle=True))
    for _epoch in range(2):
        for _ in dl:
            pass
    resumed = skip_first_batches(dl, 1)
    if hasattr(resumed, "set_epoch"):
        resumed.set_epoch(2)
    inner = getattr(getattr(resumed, "batch_sampler", None), "batch_sampler", None)
    if hasattr(inner, "set_epoch"):
        inner.set_epoch(2)
    record["skip"][name] = [[int(i) for i in b] for b in resumed]

# three epochs of training and evaluation: the global RNG stream epoch after epoch
torch.manual_seed(11)
acc = accelerator()
model = net()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data = torch.linspace(-1, 1, 22).reshape(22, 1)
train = DataLoader(torch.utils.data.TensorDataset(data), batch_size=4, shuffle=True)
evaluation = DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)
model, opt, train, evaluation = acc.prepare(model, opt, train, evaluation)
epochs = []
for _ in range(3):
    model.train()
    seen = []
    for (x,) in train:
        seen.append([round(float(v), 4) for v in x.reshape(-1)])
        acc.backward((model(x) - x.sin()).pow(2).mean())
        opt.step()
        opt.zero_grad()
    model.eval()
    preds = []
    with torch.no_grad():
        for (x,) in evaluation:
            preds += [round(float(v), 6) for v in acc.gather_for_metrics(model(x).reshape(-1))]
    epochs.append({"batches": seen, "preds": preds})
record["epochs"] = {"epochs": epochs, "weights": weights(model), "rng_after": torch.rand(1).item()}

acc.wait_for_everyone()
with open(os.path.join(out, f"{acc.process_index}.json"), "w") as f:
    json.dump(record, f)
acc.wait_for_everyone()
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
