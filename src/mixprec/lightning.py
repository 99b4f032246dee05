"""``from mixprec.lightning import MixprecPrecision``: mixprec's precision as a Lightning precision
plugin, for ``lightning.pytorch.Trainer(plugins=[...])`` and ``lightning.fabric.Fabric(plugins=[...])``
(:mod:`mixprec.integrations.lightning`; the sharded strategies' class in
:mod:`mixprec.integrations.lightning_sharded`). Importing it imports Lightning; ``import mixprec`` does not."""

from mixprec.integrations.lightning import MixprecPrecision
from mixprec.integrations.lightning_sharded import MixprecFSDPPrecision

__all__ = ["MixprecFSDPPrecision", "MixprecPrecision"]
