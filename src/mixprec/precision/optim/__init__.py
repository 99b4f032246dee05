"""Optimizers for bf16-true: ``AdamW`` and ``SGD`` whose update is Kahan-compensated or
stochastically rounded, so updates smaller than bf16's resolution of the weights are not lost;
the fused AdamW kernel they use where ``torch.compile`` works."""

from mixprec.precision.optim.compensated import (
    COMPENSATIONS,
    OPTIMIZER_NAMES,
    SGD,
    STATE_DTYPE_NAMES,
    AdamW,
    bf16_stochastic_round,
    compensated_for_bf16,
    make_bf16_optimizer,
)

__all__ = ["AdamW", "COMPENSATIONS", "OPTIMIZER_NAMES", "SGD", "STATE_DTYPE_NAMES", "bf16_stochastic_round",
           "compensated_for_bf16", "make_bf16_optimizer"]
