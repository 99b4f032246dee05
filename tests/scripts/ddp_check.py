"""Run under `torchrun --nproc_per_node 2`: DDP training, sharding, gather_for_metrics, comm hooks, save_state.

Rank 0 writes OUT/result.json and OUT/ddp.safetensors.
"""

import json
import sys
from pathlib import Path

import safetensors.torch
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mixprec import Accelerator  # noqa: E402

from toys import Indexed, Regression  # noqa: E402

out = Path(sys.argv[1])
result = {}


def model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train(acc, shuffle, steps=None):
    model, opt = model_and_opt()
    dl = torch.utils.data.DataLoader(Regression(n=64), batch_size=4, shuffle=shuffle)
    model, opt, dl = acc.prepare(model, opt, dl)
    for i, (x, y) in enumerate(dl):
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        if steps is not None and i + 1 == steps:
            break
    return model, opt, dl


acc = Accelerator(mixed_precision="fp32", cpu=True)
result["num_processes"] = acc.num_processes
result["backend"] = torch.distributed.get_backend()
model, opt, dl = train(acc, shuffle=False)
params = acc.gather(flat(model)[None])  # one row per rank
result["ranks_identical"] = bool(torch.equal(params[0], params[1]))
result["batches_per_rank"] = len(dl)
if acc.is_main_process:
    safetensors.torch.save_model(acc.unwrap_model(model), str(out / "ddp.safetensors"))

# Shuffled: every sample seen exactly once per epoch, across the ranks.
torch.manual_seed(acc.process_index)  # different global RNG per rank: the shard order must not care
dl = acc.prepare(torch.utils.data.DataLoader(Indexed(64), batch_size=4, shuffle=True))
seen = torch.cat([acc.gather(b) for b in dl])
result["shuffled_each_once"] = sorted(seen.tolist()) == list(range(64))

# Uneven evaluation set: 21 samples, 4 per process per batch.
dl = acc.prepare(torch.utils.data.DataLoader(Indexed(21), batch_size=4))
evaluated = torch.cat([acc.gather_for_metrics(b) for b in dl])
result["gather_for_metrics"] = evaluated.tolist()
result["reduce_sum"] = acc.reduce(torch.tensor([acc.process_index + 1.0])).item()

for hook in ("fp16", "bf16"):
    hacc = Accelerator(mixed_precision="bf16", cpu=True, ddp_comm_hook=hook)
    m, _, _ = train(hacc, shuffle=True, steps=4)
    rows = hacc.gather(flat(m)[None])
    result[f"hook_{hook}"] = bool(torch.equal(rows[0], rows[1]) and torch.isfinite(rows).all())

# save_state under two processes: one folder, every rank's RNG state, loadable by both.
model, opt, dl = train(acc, shuffle=True, steps=3)
path = acc.save_state(out / "ckpt")
acc.wait_for_everyone()
acc.load_state(path)
result["ckpt_files"] = sorted(p.name for p in path.iterdir())
if acc.is_main_process:
    (out / "result.json").write_text(json.dumps(result))
acc.end_training()
