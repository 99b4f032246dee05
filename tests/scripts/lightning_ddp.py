"""Lightning's DDP (its own launcher: this script is started once and starts its second rank) and
ModelParallelStrategy (FSDP2) on 2 gloo processes, under MixprecPrecision and under Lightning's own
precision; each rank writes what it saw to OUT/<rank>.json (tests/integrations/test_lightning_ddp.py).

Usage: python lightning_ddp.py OUT
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.fabric import Fabric
from lightning.pytorch.strategies import ModelParallelStrategy

from mixprec.lightning import MixprecPrecision

warnings.simplefilter("ignore")
torch.set_num_threads(1)
OUT = Path(sys.argv[1])


def batches(overflow_at: int | None = None) -> torch.utils.data.DataLoader:
    """16 samples in batches of 4 per rank (rank r gets samples r, r + 2, ...); sample
    ``overflow_at`` is so large that its gradients overflow fp16 (on one rank only)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    if overflow_at is not None:
        x[overflow_at] *= 1e6
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


class Net(L.LightningModule):
    def __init__(self, sharded: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 1))
        self.sharded = sharded

    def configure_model(self) -> None:
        if self.sharded:  # FSDP2 under ModelParallelStrategy, with the plugin's policy
            from torch.distributed.fsdp import fully_shard

            policy = self.trainer.precision_plugin.sharding_policy()
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"], mp_policy=policy)

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit(overflow_at=None, sharded=False, **how) -> dict:
    model = Net(sharded)
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if sharded else "ddp"
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **how)
    trainer.fit(model, batches(overflow_at))
    plugin = trainer.precision_plugin
    scaler = getattr(plugin, "scaler", None)
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return {"weights": [p.detach().float().flatten().tolist() for p in params],
            "precision": trainer.precision, "scale": scaler.get_scale() if scaler is not None else None,
            "skipped": scaler.skipped_steps if scaler is not None else None,
            "optimizer": type(trainer.optimizers[0]).__module__,
            "report": plugin.precision_report().line() if isinstance(plugin, MixprecPrecision) else ""}


def fabric_fp16() -> dict:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[MixprecPrecision("fp16-mixed")])
    fabric.launch()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = fabric.setup_dataloaders(batches(overflow_at=1))
    for x, y in loader:
        fabric.backward(torch.nn.functional.mse_loss(model(x).float(), y))
        optimizer.step()
        optimizer.zero_grad()
    plugin = fabric._precision
    return {"weights": [p.detach().flatten().tolist() for p in net.parameters()], "scale": plugin.scaler.get_scale(),
            "skipped": plugin.scaler.skipped_steps}


results = {
    "lightning_bf16": fit(precision="bf16-mixed"),
    "mixprec_bf16": fit(plugins=[MixprecPrecision("bf16-mixed")]),
    "mixprec_fp16": fit(overflow_at=1, plugins=[MixprecPrecision("fp16-mixed")]),
    "mixprec_bf16_true": fit(plugins=[MixprecPrecision("bf16-true")]),
    "fabric_fp16": fabric_fp16(),
    "sharded_bf16": fit(sharded=True, plugins=[MixprecPrecision("bf16-mixed")]),
    "sharded_fp16": fit(overflow_at=1, sharded=True, plugins=[MixprecPrecision("fp16-mixed")]),
}
rank = torch.distributed.get_rank()
(OUT / f"{rank}.json").write_text(json.dumps(results))
