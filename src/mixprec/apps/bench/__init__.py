"""``mixprec bench``: one training job under every precision, measured side by side in one run.

Each precision trains its own copy of the model through :class:`~mixprec.Accelerator` (fused
AdamW, or what the Accelerator makes of it: bf16-true's compensated twin; the prepared
dataloader with batched fetch), from the same initial weights and in the same data order. The runs are interleaved: in each round every precision trains a chunk of
steps in turn, so a change in the machine's speed hits all of them alike. Reported per precision:

* the median step time (data fetch, forward, backward, optimizer), samples/s and tokens/s, and
  the speed-up over the baseline (fp32 when benchmarked): the median over rounds of each round's
  throughput ratio, so a machine that slows down between rounds does not skew it;
* the peak memory of training: on CUDA, ``max_memory_allocated`` growth over building the model
  and its warm-up steps; on the CPU, where RSS is process-wide and never goes down, the peak RSS
  growth of a fresh process that builds the model and trains a few steps in that precision only;
* achieved TFLOP/s: the FLOPs of one forward+backward counted by ``FlopCounterMode``, divided by
  the median step time, and its fraction of this device's matrix-product peak for the
  precision's compute dtype, measured with a square ``torch.mm`` after every round (each
  round's steps against that round's peak);
* the final training loss (mean of the last steps) and an eval loss on a fixed slice of the
  eval set, each against the baseline's.

``compare=`` adds the same job as rivals run it (:mod:`.rivals`): the hand-written torch loop,
Hugging Face Accelerate's ``Accelerator`` and the Hugging Face Trainer; and through mixprec's own
Trainer. Both Trainers are driven through their callbacks alone: mixprec's trains each round's
chunk in one ``train()`` that a callback stops (the next one goes on where it stopped); Hugging
Face's ``train()`` runs once and drives, a callback running the others' round after each chunk.

The host-sync counter of the ``syncs`` column is a diagnostic: :func:`mixprec.diagnostics.count_host_syncs`
(re-exported here).
"""

from __future__ import annotations

from mixprec.apps.bench.config import COMPARE_NAMES, DEFAULT_PRECISIONS, BenchConfig
from mixprec.apps.bench.core import add_ratios as add_ratios
from mixprec.apps.bench.core import drift_note as drift_note
from mixprec.apps.bench.core import run_bench
from mixprec.apps.bench.memory import (
           memory_probe_main as memory_probe_main,  # run by the CPU memory probe's subprocess
)
from mixprec.apps.bench.memory import tensor_peak_bytes as tensor_peak_bytes
from mixprec.diagnostics.syncs import HostSyncs, SyncEvent, count_host_syncs, host_side_tensors

__all__ = ["BenchConfig", "run_bench", "DEFAULT_PRECISIONS", "COMPARE_NAMES",
           "count_host_syncs", "host_side_tensors", "HostSyncs", "SyncEvent"]
