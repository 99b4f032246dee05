"""A wider byte-level GPT for the fp8 bench on a GPU, where float8's matrix products pay off only
for wide layers (pycode's sizes stop at width 512):

    mixprec bench --model gpt_wide:build_model --data gpt_wide:build_data --precisions bf16-mixed,fp8 \\
        --compile --device cuda          # with benchmarks/ on PYTHONPATH

Width 2048, 4 blocks, context 512 (Linear layers 2048x6144, 2048x2048, 2048x8192, 8192x2048), on
the same Python standard-library bytes as pycode.
"""

from __future__ import annotations

from mixprec.tasks import GPT, GPTConfig
from mixprec.tasks.pycode import ByteBlockDataset, load_pycode_bytes

CONFIG = GPTConfig(block_size=512, n_layer=4, n_head=16, n_embd=2048)


def build_model() -> GPT:
    return GPT(CONFIG)


def build_data() -> dict[str, ByteBlockDataset]:
    return {"train": ByteBlockDataset(load_pycode_bytes("train", 2_000_000, None), CONFIG.block_size),
            "validation": ByteBlockDataset(load_pycode_bytes("validation", 200_000, None), CONFIG.block_size)}
