"""Prepared dataloaders shard batches over processes exactly as Accelerate's ``BatchSamplerShard``
does: whole batches in turn or a slice of each (``split_batches``), the last round padded or not
(``even_batches``), with and without ``drop_last``; index for index, length for length, and
``gather_for_metrics`` keeps exactly the samples Accelerate keeps."""

from __future__ import annotations

import itertools

import pytest
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from mixprec.data import PreparedDataLoader

accelerate_data = pytest.importorskip("accelerate.data_loader")

CASES = [(n, bs, world, drop_last, even)
         for n, bs, world, drop_last, even in itertools.product(
             [0, 1, 2, 3, 5, 7, 8, 11, 16, 21], [1, 2, 3, 4], [2, 3, 4], [False, True], [True, False])]


def _batches(loader: PreparedDataLoader) -> list[list[int]]:
    return [b.tolist() for b in loader]


def _mixprec(n, bs, world, drop_last, even, split):
    loaders = [PreparedDataLoader(DataLoader(list(range(n)), batch_size=bs, drop_last=drop_last), device=None,
                                  world_size=world, rank=r, split_batches=split, even_batches=even)
               for r in range(world)]
    return loaders, [_batches(dl) for dl in loaders]


def _accelerate(n, bs, world, drop_last, even, split):
    sampler = BatchSampler(SequentialSampler(range(n)), batch_size=bs, drop_last=drop_last)
    shards = [accelerate_data.BatchSamplerShard(sampler, num_processes=world, process_index=r,
                                                split_batches=split, even_batches=even) for r in range(world)]
    return shards, [[list(b) for b in s] for s in shards]


@pytest.mark.parametrize("n,bs,world,drop_last,even", CASES)
def test_whole_batches_in_turn_are_accelerates(n, bs, world, drop_last, even):
    ours, got = _mixprec(n, bs, world, drop_last, even, split=False)
    shards, want = _accelerate(n, bs, world, drop_last, even, split=False)
    assert got == want
    assert [len(dl) for dl in ours] == [len(s) for s in shards]
    _gathered_alike(ours, got, n, bs * world, drop_last)


@pytest.mark.parametrize("n,bs,world,drop_last,even", [c for c in CASES if c[1] % c[2] == 0])
def test_split_batches_are_accelerates(n, bs, world, drop_last, even):
    ours, got = _mixprec(n, bs, world, drop_last, even, split=True)
    shards, want = _accelerate(n, bs, world, drop_last, even, split=True)
    assert got == want
    assert [len(dl) for dl in ours] == [len(s) for s in shards]
    _gathered_alike(ours, got, n, bs, drop_last)


def _gathered_alike(loaders, batches, n, total_batch_size, drop_last):
    """The last round gathered in process order, less our padding, is what Accelerate's
    gather_for_metrics keeps (the first ``len(dataset) % total_batch_size`` samples of it)."""
    assert all(dl.total_batch_size == total_batch_size for dl in loaders)
    if drop_last or not all(batches) or len({len(b) for b in batches}) > 1:
        return  # nothing padded, or a round not every process takes part in: nothing is dropped
    gathered = [i for b in batches for i in b[-1]]
    pad = loaders[0]._sharder.remainder
    keep = n % total_batch_size
    if keep:
        assert gathered[:len(gathered) - pad] == gathered[:keep]
    else:
        assert pad == 0


def test_split_batches_needs_a_batch_size_the_processes_divide():
    with pytest.raises(ValueError, match="multiple of 2"):
        PreparedDataLoader(DataLoader(list(range(8)), batch_size=3), device=None, world_size=2, rank=0,
                           split_batches=True)
