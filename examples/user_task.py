"""A user's own model and data for `mixprec train`, as module:factory pairs.

    PYTHONPATH=examples mixprec train examples/user-task.toml
"""

import torch


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))

    def forward(self, x, y=None):
        pred = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(pred.float(), y), "pred": pred} if y is not None else {"pred": pred}


def model():
    torch.manual_seed(0)
    return Regressor()


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh()
    samples = [{"x": x[i], "y": y[i]} for i in range(len(x))]
    return {"train": samples[:448], "validation": samples[448:]}
