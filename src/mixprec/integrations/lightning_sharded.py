"""mixprec's precision under Lightning's sharded strategies.

- ``FSDPStrategy`` (torch's FSDP1; Lightning runs it on CUDA only) takes only an ``FSDPPrecision``:
  :class:`MixprecFSDPPrecision` is one, for the Trainer and for Fabric. FSDP1 is given the
  precision's sharding policy as its ``MixedPrecision`` (parameters gathered in the compute dtype
  over fp32 shards, gradients reduced in fp32), and with a loss scaler every rank agrees on a skip
  (one all-reduce of the found-inf flag, as torch's ``ShardedGradScaler`` does): each rank sees only
  its shard of the gradients.
- ``ModelParallelStrategy`` (FSDP2; on the CPU too) takes any precision plugin: the model is sharded
  by the user's ``configure_model`` with ``fully_shard``, and
  :meth:`~mixprec.integrations.lightning.MixprecPrecision.sharding_policy` is the
  ``MixedPrecisionPolicy`` to pass it (``fully_shard(layer, mesh=..., mp_policy=plugin.sharding_policy())``).
  Gradients there are DTensors, whose inf/NaN check torch already agrees on across the mesh.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.integrations.lightning import MixprecPrecision

from lightning.fabric.plugins.precision.fsdp import FSDPPrecision as FabricFSDPPrecision  # isort: skip
from lightning.pytorch.plugins.precision import FSDPPrecision  # isort: skip

__all__ = ["MixprecFSDPPrecision"]


class MixprecFSDPPrecision(MixprecPrecision, FSDPPrecision, FabricFSDPPrecision):
    """:class:`~mixprec.integrations.lightning.MixprecPrecision` for Lightning's ``FSDPStrategy``
    (the Trainer's and Fabric's accept only ``FSDPPrecision`` plugins): the same precisions and
    options, FSDP1's ``MixedPrecision`` from the precision's sharding policy, and skips agreed
    across ranks. Clipping by norm is refused as Lightning's ``FSDPPrecision`` refuses it (torch's
    ``clip_grad_norm_`` is wrong on shards: call the FSDP module's ``clip_grad_norm_``).

    Limits: bf16-true keeps normalisation layers fp32 beside bf16 weights, and FSDP1 flattens only
    parameters of one dtype, so wrap the normalisation layers on their own (``auto_wrap_policy``)
    or use ``ModelParallelStrategy`` (FSDP2).

    Example:
        >>> from lightning.pytorch.strategies import FSDPStrategy
        >>> strategy = FSDPStrategy(precision_plugin=MixprecFSDPPrecision("bf16-mixed", device="cuda"))  # doctest: +SKIP
    """

    @property
    def mixed_precision_config(self) -> Any:
        """torch's FSDP1 ``MixedPrecision`` for the precision (``param_dtype``, ``reduce_dtype``
        from :meth:`sharding_policy`; fp32: nothing cast)."""
        from torch.distributed.fsdp import MixedPrecision

        policy = self.sharding_policy()
        return MixedPrecision(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """With a loss scaler and several ranks: unscale, then agree on the found-inf flag (its
        maximum over the ranks), so every rank skips, or steps, together."""
        dist = torch.distributed
        scaler = self.scaler
        if scaler is None or not scaler.is_enabled() or not (dist.is_available() and dist.is_initialized()) \
                or dist.get_world_size() == 1:
            return
        self.plugin.unscale_gradients(optimizer)
        flag, _ = scaler.found_inf(optimizer)  # the flag itself, with one device per rank
        if flag is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
