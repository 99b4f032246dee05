"""``mixprec.trainer.evaluation``: evaluation outputs concatenated across batches and read as numpy."""

from __future__ import annotations

import collections

import numpy as np
import torch

from mixprec.trainer.evaluation import nested_concat, to_numpy


def test_nested_concat_pads_variable_lengths_with_minus_100_inside_any_container():
    Pair = collections.namedtuple("Pair", "logits hidden")
    parts = [Pair(torch.ones(2, 3), torch.zeros(2)), Pair(torch.ones(1, 5), torch.zeros(1))]
    out = nested_concat(parts)
    assert type(out) is Pair and out.hidden.shape == (3,)
    assert out.logits.shape == (3, 5) and out.logits[0, 3:].tolist() == [-100.0, -100.0]


def test_to_numpy_reads_bf16_as_float32_and_keeps_the_containers():
    out = to_numpy((torch.ones(2, dtype=torch.bfloat16), [torch.arange(3)]))
    assert isinstance(out, tuple) and out[0].dtype == np.float32 and out[1][0].tolist() == [0, 1, 2]
