"""Prepared dataloaders: batches on the device, one shard per process, an exact resume position.

A prepared dataloader rebuilds the user's ``DataLoader`` around a batch sampler of ours, which

* gives process ``p`` of ``W`` the global batches ``p, p + W, p + 2W, ...`` (Accelerate's
  default), or the ``p``-th slice of every batch (``split_batches``), and, by Accelerate's rules,
  makes the last round the same size on every process by repeating samples from the start of the
  epoch (``even_batches``): ``remainder`` says how many, so ``gather_for_metrics`` can drop them;
* can skip the first ``n`` batches of an epoch without loading them (a resume mid-epoch);
* owns a ``torch.Generator`` for the shuffle order, drawn as Accelerate's prepared loaders draw
  theirs (so the same ``set_seed`` gives the same batches), and a checkpoint restores the
  epoch's order exactly.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, default_collate

from mixprec.nested import tree_leaves, tree_map

__all__ = ["send_to_device", "collate", "PreparedDataLoader", "IterableLoader"]


def send_to_device(batch: Any, device: torch.device, non_blocking: bool = False, float_dtype: torch.dtype | None = None) -> Any:
    """Move every tensor nested in ``batch`` to ``device``, keeping the containers' types.

    Handles what :func:`mixprec.nested.tree_map` walks: dicts and other mappings (Hugging Face
    ``BatchEncoding`` included), lists, tuples and named tuples, and dataclasses (Hugging Face
    ``ModelOutput`` too). ``float_dtype`` also casts floating-point tensors (bf16-true).
    """
    def move(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if float_dtype is not None and t.is_floating_point():
            return t.to(device=device, dtype=float_dtype, non_blocking=non_blocking)
        return t.to(device, non_blocking=non_blocking)

    return tree_map(move, batch)


def collate(samples: Any) -> Any:
    """A batch from what a DataLoader fetched: an already-collated batch passes through.

    A dataset's ``__getitems__`` may return the whole batch already stacked (a dict of tensors,
    or a tuple of them: one tensor index instead of a Python loop over samples); anything else
    (a list of samples) goes to torch's ``default_collate``. ``label`` is renamed ``labels``, as
    Hugging Face's default collator does.

    Example:
        >>> collate([{"x": torch.tensor(1), "label": 0}, {"x": torch.tensor(2), "label": 1}])
        {'x': tensor([1, 2]), 'labels': tensor([0, 1])}
    """
    collated = isinstance(samples, Mapping) or (
        isinstance(samples, tuple) and len(samples) > 0 and all(isinstance(t, torch.Tensor) for t in samples))
    batch = samples if collated else default_collate(samples)
    if isinstance(batch, Mapping) and "label" in batch and "labels" not in batch:
        batch = dict(batch)
        batch["labels"] = batch.pop("label")
    return batch


def _shard_whole_batches(batches: list[list[int]], world: int, rank: int, batch_size: int | None,
                         drop_last: bool, even: bool) -> tuple[list[list[int]], int]:
    """Process ``rank``'s batches when each process draws whole batches in turn, by Accelerate's
    rules (``BatchSamplerShard`` without ``split_batches``), and how many padded samples the last
    round holds over all processes.

    A round (one batch per process) is given out once its last batch is full. What is left: with
    ``drop_last`` nothing; with ``even_batches=False`` each process its own leftover batch (some
    processes get one batch fewer); else a leftover full batch is kept, the short last batch is
    filled up with samples from the start of the epoch, and whole batches of those samples are
    added until every process has the same number of batches.
    """
    full = (lambda b: True) if batch_size is None else (lambda b: len(b) == batch_size)
    mine: list[list[int]] = []
    pending: list[int] | None = None
    for idx, b in enumerate(batches):
        if idx % world == rank:
            pending = b
        if idx % world == world - 1 and full(b):
            mine.append(pending)
            pending = None
    if drop_last or not batches:
        return mine, 0
    if not even:
        if pending:
            mine.append(pending)
        return mine, 0
    if pending and full(pending):
        mine.append(pending)
    # The samples the padding comes from: the first round's (repeated, for a tiny dataset).
    if batch_size is None:
        start: list = batches[:world]
        while len(start) < world:
            start = start + start
    else:
        start = [i for b in batches[:world] for i in b]
        while len(start) < world * batch_size:
            start = start + start
    idx, batch = len(batches) - 1, list(batches[-1])
    if full(batch):
        idx, batch = idx + 1, []
    taken = pad = 0
    while idx % world != 0 or batch:
        if batch_size is None:
            batch, taken, pad = list(start[taken]), taken + 1, pad + len(start[taken])
        else:
            need = batch_size - len(batch)
            batch, taken, pad = batch + start[taken:taken + need], taken + need, pad + need
        if idx % world == rank:
            mine.append(batch)
        batch, idx = [], idx + 1
    return mine, pad


def _shard_split_batches(batches: list[list[int]], world: int, rank: int, batch_size: int, drop_last: bool,
                         even: bool) -> tuple[list[list[int]], int]:
    """Process ``rank``'s slice of every batch (``split_batches``, Accelerate's rules) and how
    many padded samples the last batch holds: a full batch gives each process ``batch_size /
    world`` samples; a short last batch is dropped (``drop_last``), sliced as it is (some
    processes get less or nothing, ``even_batches=False``), or filled up from the first batch."""
    per = batch_size // world
    mine = [b[rank * per:(rank + 1) * per] for b in batches if len(b) == batch_size]
    if drop_last or not batches or len(batches[-1]) == batch_size:
        return mine, 0
    last = list(batches[-1])
    if not even:
        if len(last) > rank * per:
            mine.append(last[rank * per:(rank + 1) * per])
        return mine, 0
    first = list(batches[0])
    while len(first) < batch_size:
        first = first + first
    pad = batch_size - len(last)
    mine.append((last + first)[rank * per:(rank + 1) * per])
    return mine, pad


class _ShardedBatchSampler:
    """Process ``rank``'s share of ``batch_sampler``'s batches (whole batches in turn, or a slice
    of each with ``split``), optionally skipping some first; and, as Accelerate's
    ``SeedableRandomSampler`` inside its ``BatchSamplerShard``, the epoch's shuffle order.

    The order is set here, where the indices are drawn, not in the loader: a ``DataLoader`` rebuilt
    around this batch sampler (Accelerate's free function ``skip_first_batches`` does that, and
    transformers' Trainer calls ``set_epoch`` on it) gives the same batches. When the sampler
    shuffles with ``generator`` (the prepared loader's own; with ``"seedable"``, whoever's), each
    epoch reseeds it by ``shuffle``: ``"seedable"`` with ``seed + epoch``; ``"per_epoch"`` with a
    draw of torch's global RNG (what torch's ``RandomSampler`` draws); ``"continue"`` lets it run
    on. A loader that does not shuffle draws nothing here.
    """

    def __init__(self, batch_sampler: Any, world_size: int, rank: int, drop_last: bool, *, split: bool = False,
                 even: bool = True, generator: torch.Generator | None = None, shuffle: str = "continue",
                 seed: int = 0) -> None:
        self.batch_sampler = batch_sampler
        self.world_size = world_size
        self.rank = rank
        self.drop_last = drop_last
        self.split = split and world_size > 1
        self.even = even
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        if self.split and (self.batch_size is None or self.batch_size % world_size):
            raise ValueError(f"split_batches=True needs a batch size that divides by the number of processes "
                             f"({world_size}), got {self.batch_size}; choose a multiple of {world_size}")
        self.skip = 0  # batches of this process's share to skip, on the next epoch only
        self.remainder = 0  # padded samples in the last round of the epoch, over all processes
        self.batches: list[list[int]] = []  # this process's batches of indices in the current epoch
        self.generator, self.shuffle, self.seed = generator, shuffle, seed
        self.epoch = 0
        #: A restored mid-epoch state: the epoch's order is the generator's as restored (no reseed).
        self.restored = False
        #: The generator's state the current epoch's order was drawn from (what a checkpoint keeps).
        self.epoch_start_state = generator.get_state() if generator is not None else None

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next pass draws its order for (Accelerate's ``SeedableRandomSampler.set_epoch``)."""
        self.epoch = epoch

    def _seed_epoch(self) -> None:
        gen, restored, self.restored = self.generator, self.restored, False
        if gen is None:
            return
        if self.shuffle == "seedable":
            gen.manual_seed(self.seed + self.epoch)  # the epoch's order, restored or not
        elif self.shuffle == "per_epoch" and not restored:
            gen.manual_seed(_draw())
        self.epoch_start_state = gen.get_state()

    def _shard(self) -> list[list[int]]:
        batches = [list(b) for b in self.batch_sampler]
        if self.world_size == 1:
            self.remainder = 0
            return batches
        shard = _shard_split_batches if self.split else _shard_whole_batches
        mine, self.remainder = shard(batches, self.world_size, self.rank, self.batch_size, self.drop_last, self.even)
        return mine

    def __iter__(self) -> Iterator[list[int]]:
        self._seed_epoch()
        self.batches = self._shard()
        skip, self.skip = self.skip, 0
        yield from self.batches[skip:]
        self.epoch += 1

    def __len__(self) -> int:
        n, w = len(self.batch_sampler), self.world_size
        if w == 1 or self.split:
            return n
        if n % w == 0 or self.drop_last:
            return n // w
        if self.even:
            return n // w + 1
        return n // w + (1 if self.rank < n % w else 0)


class PreparedDataLoader(DataLoader):
    """A dataloader prepared by an :class:`~mixprec.Accelerator`: device placement and sharding.

    A ``torch.utils.data.DataLoader`` (as Accelerate's prepared loaders are): iterate it like the
    original. It keeps the original's ``dataset``, ``batch_size``, ``sampler`` and ``drop_last``,
    its ``__len__`` is this process's number of batches, and it knows during iteration whether
    the current batch is the last (``end_of_dataloader``) and how many padded duplicates that
    batch holds across all processes (``remainder``).

    With ``dispatch_batches`` (Accelerate's ``DataLoaderDispatcher``; its default for an
    ``IterableDataset`` over several processes), process 0 alone iterates the original loader,
    takes one batch per process (one batch with ``split_batches``), concatenates them and sends
    the result to every process, which keeps its slice: the same batches, in the same order, as
    Accelerate gives for the same seed, and an ``IterableDataset`` needs no sharding of its own.
    """

    def __init__(self, loader: DataLoader, *, device: torch.device | None, world_size: int = 1, rank: int = 0,
                 seed: int = 0, float_dtype: torch.dtype | None = None, on_iter=None, on_end=None,
                 non_blocking: bool | None = None, resume_position: bool = True, shuffle: str = "seedable",
                 split_batches: bool = False, even_batches: bool = True, dispatch_batches: bool = False,
                 gradient_state: Any = None) -> None:
        self.base_dataloader = loader
        self.gradient_state = gradient_state  # the owner's (Accelerate's attribute of this name)
        self.torch_device_mesh = None  # Accelerate's, for tensor parallelism: mixprec runs data parallelism only
        self.device = device
        self.float_dtype = float_dtype
        self.non_blocking = non_blocking
        #: Whether ``load_state_dict`` resumes inside the epoch (else at the epoch's first batch).
        self.resume_position = resume_position
        self.seed = seed
        self._on_iter = on_iter
        self._on_end = on_end
        sampler = loader.sampler
        user_gen = loader.generator
        if user_gen is None and isinstance(sampler, RandomSampler):
            user_gen = sampler.generator
        # How our own generator (the user gave none) gets each epoch's shuffle order, as Accelerate's
        # prepared loaders get theirs: "seedable" re-seeds it with seed + epoch (use_seedable_sampler,
        # data_seed); "per_epoch" seeds it from a draw of torch's global RNG at each epoch's start
        # (one process: torch's own RandomSampler; several, dispatched: process 0's); "continue" lets
        # it run on from ``seed`` (several processes: the synchronised generator). A user's generator
        # simply runs on, except under "seedable" (below).
        if shuffle not in ("seedable", "per_epoch", "continue"):
            raise ValueError(f"shuffle must be 'seedable', 'per_epoch' or 'continue', got {shuffle!r}")
        self._own_generator = user_gen is None
        #: The generator of the shuffle order (Accelerate's name).
        self.synchronized_generator = user_gen if user_gen is not None else torch.Generator().manual_seed(seed)
        # torch draws the workers' base seed from the DataLoader's generator, else from its global RNG
        # (a generator given to the sampler only draws the order). Drawn from the global RNG, it is
        # drawn here from one apart where torch would not draw it (a restored epoch), so that the
        # order's generator is left alone; a DataLoader's generator gives both, in torch's order
        # (base seed, then shuffle).
        self._base_seed_global = loader.generator is None
        self._worker_generator = (torch.Generator().manual_seed(seed) if self._base_seed_global
                                  else loader.generator)
        self.epoch = 0
        self.batches_yielded = 0
        self.end_of_dataloader = False
        self._in_epoch = False
        self._iterable = isinstance(loader.dataset, IterableDataset)
        self._world_size, self._rank = world_size, rank
        self._skip = 0  # batches to skip at the start of the next epoch
        self._workers_started = False  # persistent workers running: torch draws no new base seed
        self._sharder: _ShardedBatchSampler | None = None
        # Dispatched, as Accelerate's DataLoaderDispatcher (in one process it only reads, but its
        # remainder is still the rows of the last batch, which gather_for_metrics keeps).
        self._dispatch_asked = bool(dispatch_batches)
        self._dispatch = self._dispatch_asked and world_size > 1
        self._split = bool(split_batches)
        self._dispatch_rows: int | None = None  # the rows of the last dispatched round (once reached)
        common = dict(num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
                      timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                      multiprocessing_context=loader.multiprocessing_context,
                      persistent_workers=loader.persistent_workers)
        if loader.num_workers > 0:
            common["prefetch_factor"] = loader.prefetch_factor
        for name in ("pin_memory_device", "in_order"):  # torch versions that have them
            if hasattr(loader, name):
                common[name] = getattr(loader, name)
        if self._dispatch and split_batches:
            bs = getattr(loader.batch_sampler, "batch_size", loader.batch_size)
            if bs is None or bs % world_size:
                raise ValueError(f"split_batches=True needs a batch size that divides by the number of processes "
                                 f"({world_size}), got {bs}; choose a multiple of {world_size}")
        if self._iterable or loader.batch_sampler is None:
            if world_size > 1 and not self._dispatch:
                raise TypeError(
                    "an IterableDataset or a DataLoader without batch_size is read over several processes by "
                    "dispatching (process 0 reads, each process gets its slice of every batch): prepare it with "
                    "DataLoaderConfiguration(dispatch_batches=True) (the default for an IterableDataset), or give "
                    "each process its own part of the data in the dataset's __iter__ "
                    "(torch.distributed.get_rank() tells which)")
            # The original's own settings: iterating this loader is iterating the original.
            super().__init__(loader.dataset, batch_size=loader.batch_size, drop_last=loader.drop_last,
                             sampler=None if self._iterable else sampler, generator=loader.generator, **common)
            return
        shuffles = isinstance(sampler, RandomSampler) and sampler.generator is None and self._own_generator
        if shuffles:
            sampler.generator = self.synchronized_generator  # the shuffle order becomes part of our state
        order = self.synchronized_generator if shuffles else None
        inner = getattr(loader.batch_sampler, "sampler", None)  # where Accelerate's get_sampler looks
        if order is None and shuffle == "seedable" and isinstance(inner, RandomSampler):
            # Accelerate's SeedableRandomSampler: epoch e's order is seed + e's, whatever generator the
            # RandomSampler draws from: a user's, or none, and also one inside a batch sampler of the
            # user's own (sentence-transformers'), which the DataLoader's ``sampler`` does not show.
            if inner.generator is None:
                inner.generator = torch.Generator()
            order = inner.generator
        # Dispatched, process 0 reads the whole epoch (nothing sharded) and the others read nothing.
        sharded_over = 1 if self._dispatch else world_size
        batch_sampler = self._sharder = _ShardedBatchSampler(
            loader.batch_sampler, sharded_over, rank if sharded_over > 1 else 0,
            getattr(loader.batch_sampler, "drop_last", False), split=split_batches, even=even_batches,
            generator=order, shuffle=shuffle, seed=seed)
        # Without a DataLoader generator, the workers' base seed is drawn from torch's global RNG, as torch's
        # and Accelerate's loaders draw it (``generator=None``); a DataLoader rebuilt from this one
        # (Accelerate's ``skip_first_batches``) then draws it alike.
        super().__init__(loader.dataset, batch_sampler=batch_sampler,
                         generator=None if self._base_seed_global else self._worker_generator, **common)
        # What the original loader said (torch's DataLoader would say None with a batch sampler).
        for name in ("batch_size", "sampler", "drop_last"):
            object.__setattr__(self, name, getattr(loader, name))

    @property
    def base_loader(self) -> DataLoader:
        """The user's original ``DataLoader`` (also ``base_dataloader``, Accelerate's name)."""
        return self.base_dataloader

    @property
    def even_batches(self) -> bool | None:
        """Whether the last round is padded so every process gets a batch (``None``: not sharded
        by us, an ``IterableDataset``, a loader without ``batch_size``, dispatched batches);
        settable, as ``Accelerator.join_uneven_inputs(even_batches=...)`` does for the block it wraps."""
        return self._sharder.even if self._sharder is not None and not self._dispatch else None

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        if self._sharder is not None:
            self._sharder.even = bool(value)

    @property
    def iteration(self) -> int:
        """Accelerate's name for the epoch this loader is in (set by :meth:`set_epoch`)."""
        return self.epoch

    @property
    def use_stateful_dataloader(self) -> bool:
        """Whether its position within an epoch is saved and restored with the checkpoint."""
        return self.resume_position

    @property
    def rng_types(self) -> list[str]:
        """Accelerate's names of the random generators synchronised between processes: the
        sampler's own generator, seeded alike on every process."""
        return ["generator"]

    @property
    def split_batches(self) -> bool:
        """Whether each original batch is split over the processes (Accelerate's name)."""
        return self._split

    @property
    def dispatch_batches(self) -> bool:
        """Whether process 0 reads the batches and sends each process its slice."""
        return self._dispatch

    @property
    def total_batch_size(self) -> int | None:
        """Samples in one batch over all processes (Accelerate's name): the original batch size
        with ``split_batches``, else that times the number of processes."""
        bs = self.base_dataloader.batch_size
        if bs is None or self._split:
            return bs
        return bs * self._world_size

    @property
    def total_dataset_length(self) -> int:
        """The length of the dataset all processes share (Accelerate's name)."""
        return len(self.dataset)

    @property
    def remainder(self) -> int:
        """Accelerate's meaning: the real samples (over all processes) in the epoch's last batch
        round, which ``gather_for_metrics`` keeps of what it gathers there, the padding dropped:
        ``len(dataset) % total_batch_size``; ``0`` when the dataset divides evenly; ``-1`` where it
        is not known (``drop_last``, a dataset without a length). Dispatched batches: the rows of
        the last round, known once it is reached (``-1`` before)."""
        if self._dispatch_asked:
            return self._dispatch_rows if self.end_of_dataloader and self._dispatch_rows is not None else -1
        if self.drop_last:
            return -1
        try:
            return self.total_dataset_length % self.total_batch_size
        except (TypeError, ZeroDivisionError, NotImplementedError):  # no length, or no batch size
            return -1

    def __len__(self) -> int:
        if self._sharder is not None and not self._dispatch:
            return len(self._sharder)
        n = len(self.base_dataloader)
        if not self._dispatch or self._split:
            return n
        w = self._world_size
        return n // w if self.drop_last else -(-n // w)

    def batch_indices(self, position: int) -> list[int] | None:
        """The dataset indices of batch ``position`` (0-based, skipped batches counted) of this
        process's share of the current epoch, in the batch's row order; ``None`` where the sampler
        does not tell them (an ``IterableDataset``, a loader without ``batch_size``, dispatched batches).

        Example:
            >>> from mixprec import Accelerator
            >>> dl = Accelerator(cpu=True).prepare(DataLoader(list(range(10)), batch_size=4))
            >>> [b.tolist() for b in dl][-1], dl.batch_indices(2)
            ([8, 9], [8, 9])
        """
        if self._sharder is None or self._dispatch or not 0 <= position < len(self._sharder.batches):
            return None
        return list(self._sharder.batches[position])

    def set_epoch(self, epoch: int) -> None:
        """Make ``epoch`` the next epoch (its shuffle order is the one that epoch had), and
        forward it to a sampler or dataset that wants it (``DistributedSampler``, a streaming dataset)."""
        self.epoch = epoch
        if self._sharder is not None:
            self._sharder.set_epoch(epoch)
        targets = [getattr(self.base_dataloader, "sampler", None), getattr(self.base_dataloader, "batch_sampler", None)]
        if not any(hasattr(s, "set_epoch") for s in targets):
            targets.append(self.dataset)
        for s in targets:
            if hasattr(s, "set_epoch"):
                s.set_epoch(epoch)

    # -- resume ---------------------------------------------------------------------------
    def skip_batches(self, n: int) -> None:
        """Start the next epoch at batch ``n`` of this process's share, without loading the ones before."""
        if n < 0:
            raise ValueError(f"the number of batches to skip must be >= 0, got {n}")
        self._skip = n

    @property
    def batches_to_skip(self) -> int:
        """Batches the next epoch skips at its start (set by :meth:`skip_batches` or a restored position)."""
        return self._skip

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands: epochs started, batches yielded in this one, the epoch's RNG state."""
        start = self._sharder.epoch_start_state if self._sharder is not None else None
        if not self._in_epoch or start is None:  # between epochs: the next one starts from the generator as it is
            return {"epoch": self.epoch, "batches_yielded": self.batches_yielded if self._in_epoch else 0,
                    "generator_state": self.synchronized_generator.get_state(), "seed": self.seed}
        return {"epoch": self.epoch, "batches_yielded": self.batches_yielded,
                "generator_state": start.clone(), "seed": self.seed}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue where :meth:`state_dict` was taken: the same shuffle order, at the next batch
        (with ``resume_position``) or at the first batch of the epoch that was running."""
        state = state_dict
        self.epoch = int(state["epoch"])
        self.seed = int(state.get("seed", self.seed))
        self.synchronized_generator.set_state(state["generator_state"])
        if self._sharder is not None:
            self._sharder.seed = self.seed
            # that epoch's order is the state's, drawn already: the next pass draws no new one
            self._sharder.restored = int(state["batches_yielded"]) > 0
        self.skip_batches(int(state["batches_yielded"]) if self.resume_position else 0)

    def __iter__(self) -> Iterator[Any]:
        if self._on_iter is not None:
            self._on_iter(self)
        if self._base_seed_global and not self._iterable and self._sharder is not None:
            # torch's DataLoader draws the workers' base seed from the global RNG at each epoch, then
            # a shuffling loader's batch sampler draws the order, when the first batch is asked for:
            # the same draws as torch's and Accelerate's, in the same order (dispatched, only process
            # 0 reads the sampler, so only its order is drawn). An epoch restored mid-way draws
            # neither: the global RNG is the checkpoint's, past those draws.
            self.generator = self._worker_generator if self._sharder.restored else None
        if self._sharder is not None:
            self._sharder.set_epoch(self.epoch)
            if not self._own_generator:  # the user's draws the workers' base seed, then the order: from here
                self._sharder.epoch_start_state = self.synchronized_generator.get_state()
        if self._workers_started:
            # torch draws the workers' base seed when it starts the workers, and persistent workers
            # are started once: draw it here in the epochs torch does not.
            torch.empty((), dtype=torch.int64).random_(generator=self._worker_generator)
        self._workers_started = self.persistent_workers and self.num_workers > 0
        skip, self._skip = self._skip, 0
        sampler_skips = self._sharder is not None and not self._dispatch
        if sampler_skips:
            self._sharder.skip = skip  # skipped in the sampler: those batches are never loaded
        self.batches_yielded = skip
        self.end_of_dataloader = False
        self._in_epoch = True
        it = super().__iter__()
        if self._dispatch:
            it, skip = self._dispatched(it, skip), 0
        elif self._dispatch_asked:
            it = self._counting_rows(it)
        if sampler_skips:
            skip = 0  # skipped in the sampler already
        yield from _epoch(self, it, skip)

    def _counting_rows(self, it: Iterator[Any]) -> Iterator[Any]:
        """``it``'s batches, the rows of the latest noted (the last batch's, once it is reached)."""
        self._dispatch_rows = None
        for batch in it:
            self._dispatch_rows = _rows(batch)
            yield batch

    def _dispatched(self, it: Iterator[Any], skip: int) -> Iterator[Any]:
        """This process's slices of the batches process 0 reads from ``it``, by Accelerate's
        ``DataLoaderDispatcher`` rules, after ``skip`` of them.

        Each round, process 0 concatenates the next ``W`` batches (one with ``split_batches``)
        and sends the result to all; process ``p`` keeps rows ``[p*n//W, (p+1)*n//W)``. Without
        ``drop_last``, a last round short of whole batches is concatenated as it is, and one whose
        rows do not divide by ``W`` is filled up with the first ``W`` rows of the epoch's first round.
        """
        w, rank, drop_last = self._world_size, self._rank, bool(self.drop_last)
        take = 1 if self._split else w

        def fetch() -> Any:
            box: list[Any] = [None]
            if rank == 0:
                parts = list(itertools.islice(it, take))
                if parts and (len(parts) == take or not drop_last):
                    box[0] = _concatenate(parts)
            torch.distributed.broadcast_object_list(box, src=0)
            return box[0]

        first, index = None, 0
        self._dispatch_rows = None
        current = fetch()
        while current is not None:
            nxt = fetch()
            if first is None and not drop_last:
                first = _slice_rows(current, 0, w)
            rows = _rows(current)
            per = rows // w
            if nxt is None:
                if not drop_last and rows % w:
                    current, per = _concatenate([current, first]), per + 1
                self._dispatch_rows = rows
            if index >= skip:
                yield _slice_rows(current, rank * per, (rank + 1) * per)
            index += 1
            current = nxt

    def _moves(self) -> bool:
        """Whether batches need moving or casting: on the CPU with nothing to cast there is nothing
        to do (not a walk of the batch per step)."""
        return not (self.device is None or (self.device.type == "cpu" and self.float_dtype is None))

    def _move(self, batch: Any) -> Any:
        if not self._moves():
            return batch
        non_blocking = self.device.type == "cuda" if self.non_blocking is None else self.non_blocking
        return send_to_device(batch, self.device, non_blocking=non_blocking, float_dtype=self.float_dtype)


_END = object()


def _epoch(loader: Any, it: Iterator[Any], skip: int) -> Iterator[Any]:
    """``it``'s batches after the first ``skip``, on ``loader``'s device, with ``loader``'s
    ``end_of_dataloader`` set before the last is yielded and ``batches_yielded`` counted; the epoch
    count moves on when ``it`` is exhausted, and ``loader._on_end`` runs however the loop ends."""
    try:
        for _ in range(skip):  # no sampler to skip in: load the batches and drop them
            next(it, None)
        move = loader._move if loader._moves() else None
        # The two counters are written into the loader's __dict__: the same attributes, without
        # torch DataLoader's __setattr__ (a Python call) on every batch.
        state = loader.__dict__
        fetch = _fetcher(it)
        current = fetch()
        while current is not _END:
            nxt = fetch()
            # Looking one batch ahead tells whether this is the last: accumulate() and
            # gather_for_metrics need to know before the batch is used.
            state["end_of_dataloader"] = nxt is _END
            state["batches_yielded"] += 1
            yield current if move is None else move(current)
            current = nxt
        loader.end_of_dataloader = True
        loader._in_epoch = False
        loader.epoch += 1
    finally:
        if loader._on_end is not None:
            loader._on_end(loader)


def _fetcher(it: Iterator[Any]) -> Any:
    """A function returning ``next(it)``, or ``_END`` when ``it`` is exhausted.

    For torch's own single-process iterator over a map-style dataset (what a ``DataLoader`` with
    ``num_workers=0`` iterates), it is what torch's ``__next__`` does, less the profiler range that
    ``__next__`` opens around every batch (on a short step it costs as much as fetching a small
    batch): the same indices, samples and collate, the same count of batches yielded. Under a
    profiler, and for any other iterator, ``next(it)`` itself.
    """
    if type(it) is not _SINGLE_PROCESS or type(it).__next__ is not _TORCH_NEXT or it._dataset_kind != _MAP_STYLE:
        return lambda: next(it, _END)

    def fetch() -> Any:
        if torch.autograd._profiler_enabled():
            return next(it, _END)
        if it._sampler_iter is None:  # (as torch's __next__)
            it._reset()
        try:
            batch = it._next_data()
        except StopIteration:
            return _END
        it._num_yielded += 1
        return batch

    return fetch


_SINGLE_PROCESS = torch.utils.data.dataloader._SingleProcessDataLoaderIter
_TORCH_NEXT = torch.utils.data.dataloader._BaseDataLoaderIter.__next__
_MAP_STYLE = torch.utils.data.dataloader._DatasetKind.Map


class IterableLoader:
    """Any iterable of batches (what an overridden ``Trainer.get_train_dataloader`` may return),
    with what a training loop reads from a prepared dataloader: batches on the device, the epoch
    and the position in it (``batches_yielded``; a restored position is reached by skipping
    batches), ``end_of_dataloader``. Nothing is sharded: the iterable is iterated as it is, and
    other attributes are the iterable's own.
    """

    remainder = -1  # Accelerate's "not known": nothing is padded, nothing cut

    def __init__(self, iterable: Any, *, device: torch.device | None, float_dtype: torch.dtype | None = None,
                 on_iter=None, on_end=None, non_blocking: bool | None = None) -> None:
        self.base_dataloader = iterable
        self.device, self.float_dtype, self.non_blocking = device, float_dtype, non_blocking
        self._on_iter, self._on_end = on_iter, on_end
        self.epoch = self.batches_yielded = self._skip = 0
        self.end_of_dataloader = self._in_epoch = False

    def __getattr__(self, name: str) -> Any:
        if name == "base_dataloader":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.base_dataloader, name)

    def __len__(self) -> int:
        return len(self.base_dataloader)

    def set_epoch(self, epoch: int) -> None:
        """Make ``epoch`` the next epoch, and tell the iterable if it wants to know."""
        self.epoch = epoch
        if hasattr(self.base_dataloader, "set_epoch"):
            self.base_dataloader.set_epoch(epoch)

    def skip_batches(self, n: int) -> None:
        """Start the next epoch at batch ``n`` (the ones before are read and dropped)."""
        if n < 0:
            raise ValueError(f"the number of batches to skip must be >= 0, got {n}")
        self._skip = n

    batches_to_skip = PreparedDataLoader.batches_to_skip

    def batch_indices(self, position: int) -> None:
        """``None``: an iterable does not tell which samples a batch holds."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """The epoch and the batches yielded in it."""
        return {"epoch": self.epoch, "batches_yielded": self.batches_yielded if self._in_epoch else 0}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue at the saved epoch, at the batch after the last one yielded."""
        self.epoch = int(state_dict["epoch"])
        self.skip_batches(int(state_dict["batches_yielded"]))

    def __iter__(self) -> Iterator[Any]:
        if self._on_iter is not None:
            self._on_iter(self)
        skip, self._skip = self._skip, 0
        self.batches_yielded, self.end_of_dataloader, self._in_epoch = skip, False, True
        yield from _epoch(self, self._outermost(iter(self.base_dataloader)), skip)

    def _outermost(self, it: Iterator[Any]) -> Iterator[Any]:
        # A prepared loader iterated inside (a chain of loaders) registers as the active one; the
        # batches are this iterable's, and so is the end that syncs gradients: take the place back.
        for batch in it:
            if self._on_iter is not None:
                self._on_iter(self)
            yield batch

    _move = PreparedDataLoader._move
    _moves = PreparedDataLoader._moves


def _concatenate(batches: list[Any]) -> Any:
    """The batches' tensors joined along the first dimension, in the batches' structure."""
    def cat(*leaves: Any) -> Any:
        if not all(isinstance(t, torch.Tensor) for t in leaves):
            raise TypeError(f"dispatch_batches=True joins batches of tensors only, got {type(leaves[0]).__name__}: "
                            "use dispatch_batches=False (each process reads its own batches), or a collate_fn "
                            "that returns tensors")
        try:
            return torch.cat(leaves, dim=0)
        except RuntimeError as e:
            raise RuntimeError(f"dispatch_batches=True joins the batches of one round, and these differ in shape "
                               f"({e}); use dispatch_batches=False or split_batches=True") from e
    return tree_map(cat, batches[0], *batches[1:]) if len(batches) > 1 else batches[0]


def _slice_rows(batch: Any, lo: int, hi: int) -> Any:
    """Rows ``lo:hi`` of every tensor in ``batch`` (other leaves as they are)."""
    return tree_map(lambda t: t[lo:hi] if isinstance(t, torch.Tensor) else t, batch)


def _rows(batch: Any) -> int:
    """The first dimension of the first tensor in ``batch``."""
    for t in tree_leaves(batch):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    raise TypeError("dispatch_batches=True needs batches holding tensors with a batch dimension")


def _draw() -> int:
    """One int64 from torch's global RNG, drawn as torch's DataLoader and RandomSampler draw their seeds."""
    return int(torch.empty((), dtype=torch.int64).random_().item())
