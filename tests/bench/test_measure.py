"""The matmul peak costs a fixed time, not a fixed size: its side grows until one product takes long enough."""

from __future__ import annotations

import time

import pytest
import torch

import mixprec.apps.bench.measure as measure
from mixprec.apps.bench.measure import PEAK_PRODUCT_S, matmul_peak, matmul_side


@pytest.mark.parametrize("gflops, side", [(2.0, 512), (0.5, 256), (90.0, 2048), (1e5, 2048)])
def test_the_side_doubles_until_one_product_takes_the_least_time_or_reaches_the_cap(monkeypatch, gflops, side):
    """A generic kernel's 2 GFLOP/s (bf16 held to AVX2 measured 0.8-3) stops at 512: ~0.13 s a
    product, where 2048 took 21 s; fp32's 90 and a GPU's reach the cap."""
    tried = []

    def product_time(device, a, b, repeats):
        tried.append(a.shape[0])
        return 2 * a.shape[0] ** 3 / (gflops * 1e9)

    monkeypatch.setattr(measure, "_product_time", product_time)
    monkeypatch.setattr(measure, "_operands", lambda device, dtype, n: (torch.empty(n, 0), None))
    assert matmul_side(torch.device("cpu"), torch.bfloat16, max_n=2048) == side
    assert tried == [256 * 2**i for i in range(len(tried))] and max(tried) <= side


def test_a_start_above_the_cap_measures_at_the_cap():
    assert matmul_side(torch.device("cpu"), torch.float32, max_n=128) == 128


def test_the_peak_measures_each_dtype_at_its_own_side_in_about_a_second_here():
    t0 = time.perf_counter()
    sides = {"float32": matmul_side(torch.device("cpu"), torch.float32, max_n=1024), "bfloat16": 128}
    peaks = matmul_peak(torch.device("cpu"), [torch.float32, torch.bfloat16], sides)
    assert set(peaks) == {"float32", "bfloat16"} and all(v > 0 for v in peaks.values())
    # Sizing plus a best of 3: a handful of products of at most ~8x PEAK_PRODUCT_S each (loaded machines: slack).
    assert time.perf_counter() - t0 < 60 * PEAK_PRODUCT_S
