"""A prepared dataloader's batches (data.py ``_fetcher``): over torch's single-process iterator of a
map-style dataset, the fetch skips the profiler range torch's ``__next__`` opens per batch while no
profiler records; the batches, their order and the counts are torch's, and under a profiler (or for
iterable datasets) torch's own ``__next__`` runs."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, IterableDataset

from mixprec import Accelerator

DATA = [{"x": torch.tensor([float(i), -float(i)]), "y": torch.tensor(i % 3)} for i in range(37)]


def loader(data=DATA, seed=0, **kw):
    return DataLoader(data, batch_size=8, shuffle=not isinstance(data, IterableDataset),
                      generator=torch.Generator().manual_seed(seed), **kw)


def batches(dl):
    out, ends = [], []
    for b in dl:
        out.append(b)
        ends.append(getattr(dl, "end_of_dataloader", None))
    return out, ends


def same(a, b):
    return len(a) == len(b) and all(torch.equal(p["x"], q["x"]) and torch.equal(p["y"], q["y"]) for p, q in zip(a, b))


def test_the_batches_and_counts_are_torchs_and_no_profiler_range_is_opened(monkeypatch):
    opened = []
    real_enter = torch.autograd.profiler.record_function.__enter__
    monkeypatch.setattr(torch.autograd.profiler.record_function, "__enter__",
                        lambda self: (opened.append(self.name), real_enter(self))[1])
    prepared = Accelerator(cpu=True).prepare(loader())
    got, ends = batches(prepared)
    assert not any("DataLoader" in name for name in opened)
    assert ends == [False] * 4 + [True] and prepared.batches_yielded == 5
    assert same(got, batches(loader())[0])
    assert any("DataLoader" in name for name in opened)  # (torch's own loader, for the reference: it opens them)
    prepared.set_epoch(1)
    assert not same(batches(prepared)[0], got)  # the next epoch reshuffles, as torch's does


def test_under_a_profiler_torchs_next_runs_and_records_its_range():
    prepared = Accelerator(cpu=True).prepare(loader())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got, _ = batches(prepared)
    assert same(got, batches(loader())[0])
    assert sum(e.name.startswith("enumerate(DataLoader)#") for e in prof.events()) >= 5


class Stream(IterableDataset):
    def __iter__(self):
        return iter(DATA)


def test_an_iterable_dataset_is_iterated_by_torch():
    got, ends = batches(Accelerator(cpu=True).prepare(loader(Stream())))
    assert same(got, batches(loader(Stream()))[0]) and ends[-1] is True
