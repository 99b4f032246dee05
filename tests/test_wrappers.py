"""mixprec.accelerator.wrappers on their own: the precision around forward, and the wrappers' way back out."""

from __future__ import annotations

import torch

from mixprec.accelerator.wrappers import patch_forward, unpatch_forward, unwrap
from mixprec.models import original_forward
from mixprec.precision import make_plugin


class Recording(torch.nn.Linear):
    """A Linear that records the dtype its own forward computed (before any output conversion)."""

    def forward(self, x):
        y = super().forward(x)
        self.inside = y.dtype
        return y


def test_a_patched_forward_runs_in_the_plugin_read_at_call_time_and_unpatches_cleanly():
    model = Recording(4, 2)
    own = model.forward
    current = {"plugin": make_plugin("bf16", "cpu")}
    patch_forward(model, lambda: current["plugin"])
    assert original_forward(model) == own
    out = model(torch.randn(3, 4))
    # autocast around the user's forward, and the output returned in fp32 (as Accelerate's prepared model does)
    assert model.inside == torch.bfloat16 and out.dtype == torch.float32
    current["plugin"] = make_plugin("fp32", "cpu")  # a fallback is one assignment
    assert model(torch.randn(3, 4)).dtype == torch.float32 and model.inside == torch.float32
    assert unpatch_forward(model) is model and model(torch.randn(3, 4)).dtype == torch.float32
    assert original_forward(model) == own


def test_unwrap_goes_through_data_parallel_and_compile_wrappers():
    inner = torch.nn.Linear(4, 2)
    assert unwrap(inner) is inner
    assert unwrap(torch.nn.DataParallel(inner)) is inner
    assert unwrap(torch.compile(torch.nn.DataParallel(inner))) is inner
