"""What the Lightning tests share: a quiet CPU Trainer, a small regression LightningModule that records
its losses and weights step by step, its data, and the same model trained by torch's own recipe."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch

ROWS, WIDTH = 32, 8


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Lightning's info lines and the warnings these small runs draw (fp16 on a CPU is slow, a
    dataloader has no workers...) kept out of the test's output."""
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric", "mixprec")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def data(overflow_at: int | None = None, rows: int = ROWS, seed: int = 0) -> torch.utils.data.TensorDataset:
    """``rows`` samples (x, y); sample ``overflow_at`` scaled by 1e6, so that its gradients overflow fp16."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(rows, WIDTH, generator=g), torch.randn(rows, 1, generator=g)
    if overflow_at is not None:
        x[overflow_at] *= 1e6
    return torch.utils.data.TensorDataset(x, y)


def loader(overflow_at: int | None = None, rows: int = ROWS, batch_size: int = 8) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(data(overflow_at, rows), batch_size=batch_size)


def net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x).float(), y)


class Regression(L.LightningModule):
    """``net()`` trained on mean squared error; ``losses`` and ``weights`` are recorded at the end
    of every training batch (``weights``: one flat fp32 copy of all parameters)."""

    def __init__(self, optimizer: Callable[..., torch.optim.Optimizer] | None = None,
                 scheduler: Callable[[torch.optim.Optimizer], Any] | None = None, model: torch.nn.Module | None = None):
        super().__init__()
        self.net = model if model is not None else net()
        self.make_optimizer = optimizer or (lambda params: torch.optim.SGD(params, lr=0.05))
        self.make_scheduler = scheduler
        self.losses: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = loss_of(self.net, *batch)
        self.losses.append(loss.detach().clone())
        return loss

    def on_train_batch_end(self, *args: Any) -> None:
        self.weights.append(flat(self.net))

    def configure_optimizers(self) -> Any:
        optimizer = self.make_optimizer(self.parameters())
        if self.make_scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.make_scheduler(optimizer), "interval": "step"}}


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in module.parameters()])


def trainer(**kwargs: Any) -> L.Trainer:
    """A CPU Trainer without logger, checkpoints, progress bar or summary, unless asked for."""
    options = dict(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(**{**options, **kwargs})


def fit(module: L.LightningModule | None = None, data_loader: Any = None, ckpt_path: Any = None,
        **kwargs: Any) -> tuple[L.Trainer, Any]:
    """``module`` (a fresh :class:`Regression`) fitted on ``data_loader`` (:func:`loader`) by :func:`trainer`."""
    module = module if module is not None else Regression()
    with quiet():
        t = trainer(**kwargs)
        t.fit(module, data_loader if data_loader is not None else loader(), ckpt_path=ckpt_path)
    return t, module


def torch_fp16_recipe(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Any,
                      scaler: torch.amp.GradScaler, clip: float | None = None) -> list[torch.Tensor]:
    """torch's own fp16 recipe on the CPU, step by step: the weights after each step."""
    weights = []
    for x, y in batches:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_of(model, x, y)
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()
        weights.append(flat(model))
    return weights
