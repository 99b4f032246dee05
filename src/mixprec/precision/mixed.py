"""Mixed precision: the forward under ``torch.autocast`` in fp16 or bf16, fp32 parameters, and the
loss scaler where the precision needs one (fp16; bf16 may opt in). The scaler's whole lifecycle
over the run's optimizers (scale, unscale once, step or skip, update once per iteration) is the
:class:`~mixprec.precision.scaled_steps.ScaledSteps` the base plugin holds.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.nested import tree_map
from mixprec.precision.base import PrecisionPlugin

__all__ = ["MixedPrecision"]


def _up(t: Any) -> Any:
    return t.float() if isinstance(t, torch.Tensor) and t.dtype in _HALF else t


_HALF = (torch.float16, torch.bfloat16)


class MixedPrecision(PrecisionPlugin):
    """fp16-mixed or bf16-mixed: autocast forward, fp32 parameters, an optional loss scaler.

    Args:
        policy: the resolved policy (its ``compute_dtype`` is autocast's).
        device: the device the run trains on.
        config: a :class:`~mixprec.precision.PrecisionConfig`; its ``loss_scaler`` (a
            :class:`~mixprec.LossScaler` or a dict of its arguments): fp16 gets a default one
            when ``None``; bf16 gets none unless asked.

    Example:
        >>> from mixprec.precision import make_plugin
        >>> plugin = make_plugin("fp16", "cpu", loss_scaler={"init_scale": 1024.0})
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> plugin.track_optimizer(opt)
        >>> with plugin.forward_context():
        ...     loss = model(torch.randn(8, 4)).float().pow(2).mean()
        >>> plugin.backward(loss); plugin.optimizer_step(opt)
        >>> plugin.step_was_skipped(opt), plugin.scaler.get_scale()
        (False, 1024.0)
    """

    accepts_loss_scaler = True

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Bring the weights a half-precision model was loaded with to what this precision runs,
        in place (``.data``: the same Parameter objects, so optimizers built on them still hold
        them); fp32 weights, and weights in autocast's own dtype, stay as they are. Lossless: fp32
        holds every fp16 and bf16 value.

        - Trainable fp16 parameters where gradients are unscaled (a loss scaler): fp32, mixed
          precision's master weights. torch's GradScaler refuses fp16 gradients ("Attempting to
          unscale FP16 gradients"), so a script passing them could not train; with a frozen fp16
          base, these are the few weights peft trains beside its adapters (``modules_to_save``).
        - On the CPU, weights in the *other* 16-bit float than autocast's (a frozen fp16 base under
          bf16 autocast, a bf16 one under fp16): fp32. CPU autocast leaves layer norms and the
          other non-matmul operators in their inputs' dtype, and their kernels refuse fp16 weights
          beside bf16 or fp32 activations ("mixed dtype (CPU)"); CUDA autocast runs them in fp32.
        """
        other = {torch.float16, torch.bfloat16} - {self.policy.compute_dtype} if self.device.type == "cpu" else set()
        scaled = self.scaler is not None and self.scaler.is_enabled()
        for m in module.modules():
            for p in m.parameters(recurse=False):
                if p.dtype in other or (scaled and p.requires_grad and p.dtype == torch.float16):
                    p.data = p.data.float()
            for name, b in m.named_buffers(recurse=False):
                if b.dtype in other:
                    setattr(m, name, b.float())
        return module

    def convert_output(self, data: Any) -> Any:
        """fp16 and bf16 tensors in what the model returns, cast to fp32 (as Accelerate's prepared
        model returns them): a loss or metric computed from them outside autocast is computed in
        fp32. Differentiable; other tensors and containers pass unchanged."""
        return _up(data) if isinstance(data, torch.Tensor) else tree_map(_up, data)

    def fallback_precision(self, native_bf16: bool) -> str | None:
        return "bf16-mixed" if native_bf16 and self.policy.compute_dtype == torch.float16 else "fp32"
