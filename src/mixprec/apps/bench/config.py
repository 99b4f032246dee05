"""What ``mixprec bench`` trains: :class:`BenchConfig`, and the :class:`Job` (a Task and its batches) it builds.

The task comes from :func:`mixprec.tasks.load_task`, the loader ``mixprec train`` and ``doctor`` use
too; the built-in tasks, their sizes and architectures are those of :data:`mixprec.tasks.TASKS`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader

from mixprec.precision import PrecisionConfig, canonical_precision
from mixprec.precision.optim import COMPENSATIONS
from mixprec.tasks import PYCODE_SIZES, TASKS, Task, TaskEntry, load_task

__all__ = ["BenchConfig", "DEFAULT_PRECISIONS", "COMPARE_NAMES"]

DEFAULT_PRECISIONS = ("fp32", "fp16-mixed", "bf16-mixed", "bf16-true")
COMPARE_NAMES = ("torch", "trainer", "hf", "accelerate")
_COMPARE_MEANING = ("torch: the hand-written torch.autocast loop, trainer: mixprec's Trainer, hf: the Hugging Face "
                    "Trainer, accelerate: Hugging Face Accelerate")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What ``mixprec bench`` measures.

    Args:
        task: a key of :data:`mixprec.tasks.TASKS`, ``"pycode"`` or ``"digits"`` (ignored when
            ``model`` and ``data`` are given).
        size: pycode's size, ``"tiny"``, ``"mini"`` (default) or ``"small"``.
        arch: digits' model, ``"mlp"`` or ``"cnn"``.
        model: ``"module:factory"`` of a model whose forward returns ``.loss``; with ``data``.
        data: ``"module:factory"`` returning :data:`mixprec.tasks.DATA_CONTRACT` (without an eval
            split, the eval loss is measured on the training data).
        precisions: the precisions to compare (names or aliases; canonical ones are kept);
            ``None`` (default): those of :data:`DEFAULT_PRECISIONS` that the device runs at a useful
            speed: a precision whose matrix products fall back to a generic kernel here
            (:attr:`~mixprec.hardware.DeviceCapability.impractical`: fp16-mixed on a CPU without
            AMX-FP16 or AVX512-FP16, bf16-mixed and bf16-true on one without AVX512) is left out,
            with a note saying why.
        steps: timed optimizer steps per precision in each round.
        rounds: rounds of interleaving.
        warmup: untimed steps per precision before the first round.
        batch_size: samples per step.
        lr: AdamW's learning rate (constant, no weight decay).
        seed: the init and data-order seed, the same for every precision.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; ``None`` picks CUDA, then MPS, then the CPU.
        compare: contestants besides mixprec's Accelerator, each at one precision the others share:
            ``"torch"`` (the hand-written loop: ``torch.autocast``, ``GradScaler`` for fp16, the model
            cast to bf16 for bf16-true), ``"trainer"`` (mixprec's Trainer), ``"hf"`` (the Hugging
            Face Trainer), ``"accelerate"`` (Hugging Face Accelerate).
        bf16_true_compensation: bf16-true's optimizer updates, one row each (``"kahan"``,
            ``"stochastic"``, ``"none"``); the first is the row ``bf16-true``, the others
            ``bf16-true (none)``... Ignored without bf16-true among the precisions.
        bf16_true_state_dtype: bf16-true's optimizer moments, ``"fp32"`` or ``"bf16"``.
        compile: build every contestant compiled (``Accelerator(compile=True)``, the Trainers'
            ``torch_compile=True``, ``torch.compile(model)``); the warm-up absorbs the compilation.
        eval_batches: batches of the eval set's start that the eval loss averages over.
        memory: measure peak memory (on the CPU this starts one fresh process per precision).
        memory_steps: steps the CPU memory measurement trains.
        matmul_size: side of the square matrix product that measures the peak; ``None``: sized to
            the device per dtype, doubling from 256 to the first side whose one product takes at
            least 0.05 s, at most 2048 on the CPU (4096 elsewhere), so that a dtype the device
            emulates costs a second, not minutes (:func:`~mixprec.apps.bench.measure.matmul_side`).
        profile: also profile one step of each precision (top operators, share in matmuls).

    Example:
        >>> BenchConfig(task="pycode", size="tiny", precisions=["fp32", "bf16"]).precisions
        ('fp32', 'bf16-mixed')
    """

    task: str = "pycode"
    size: str | None = None
    arch: str = "mlp"
    model: str | None = None
    data: str | None = None
    precisions: tuple[str, ...] | None = None
    steps: int = 20
    rounds: int = 3
    warmup: int = 2
    batch_size: int = 8
    lr: float = 1e-3
    seed: int = 0
    device: str | None = None
    compare: tuple[str, ...] = ()
    bf16_true_compensation: tuple[str, ...] = ("kahan", "none")
    bf16_true_state_dtype: str = "fp32"
    compile: bool = False
    eval_batches: int = 4
    memory: bool = True
    memory_steps: int = 3
    matmul_size: int | None = None
    profile: bool = False

    def __post_init__(self) -> None:
        if (self.model is None) != (self.data is None):
            raise ValueError("a custom task needs both model= and data= ('module:factory' each), or neither")
        if self.model is None and self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; choose one of {list(TASKS)}, or give model= and data=")
        _check_variants(None if self.model is not None else TASKS[self.task], self.size, self.arch,
                        self.model or self.task)
        for name in ("steps", "rounds", "batch_size", "eval_batches", "memory_steps"):
            _check_int(name, getattr(self, name), 1)
        _check_int("warmup", self.warmup, 0)
        if self.matmul_size is not None:
            _check_int("matmul_size", self.matmul_size, 16)
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        if self.precisions is not None:  # None: the defaults the device runs usefully (run_bench picks)
            object.__setattr__(self, "precisions", _canonical_precisions(self.precisions))
        object.__setattr__(self, "compare", _names(self.compare, COMPARE_NAMES, "compare name", f"({_COMPARE_MEANING})"))
        comps = _names(self.bf16_true_compensation, COMPENSATIONS, "bf16-true compensation", "(one bf16-true row each)")
        if not comps:
            raise ValueError(f"bf16_true_compensation is empty; name at least one of {', '.join(COMPENSATIONS)}")
        object.__setattr__(self, "bf16_true_compensation", comps)
        for comp in comps:  # bf16-true's one validation (the Accelerator's and TrainingArguments' too)
            PrecisionConfig(bf16_true_compensation=comp, bf16_true_state_dtype=self.bf16_true_state_dtype)
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be True or False, got {self.compile!r}")
        if self.compile and self.warmup < 1:
            raise ValueError("compile=True needs warmup >= 1: the first step compiles, before the steps that count "
                             "FLOPs and host syncs (a model first called under a counter stays uncompiled)")
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as exc:
                raise ValueError(f"device {self.device!r} is not a device name; use e.g. 'cpu', 'cuda' or 'cuda:0'"
                                 ) from exc


def _check_variants(entry: TaskEntry | None, size: str | None, arch: str, what: str) -> None:
    """``size=`` and ``arch=`` against the registry: each the variant of the tasks that take it."""
    sized = {n: e for n, e in TASKS.items() if e.variant == "size"}
    if size is not None and (entry is None or entry.variant != "size"):
        sizes = sorted({v for e in sized.values() for v in e.variants}, key=str)
        raise ValueError(f"size= is {' and '.join(sized)}'s option ({', '.join(sizes)}); drop it for {what}")
    if size is not None:
        entry.check({"size": size})
    archs = [v for e in TASKS.values() if e.variant == "arch" for v in e.variants]
    if arch not in archs:
        raise ValueError(f"unknown digits arch {arch!r}; choose {' or '.join(archs)}")


def _names(value: str | tuple[str, ...], choices: tuple[str, ...], what: str, meaning: str) -> tuple[str, ...]:
    """``value`` (a name or names) as a tuple without repeats, each checked against ``choices``."""
    names = (value,) if isinstance(value, str) else tuple(value)
    for n in names:
        if n not in choices:
            raise ValueError(f"unknown {what} {n!r}; choose from {', '.join(choices)} {meaning}")
    return tuple(dict.fromkeys(names))


def _canonical_precisions(precisions: str | tuple[str, ...]) -> tuple[str, ...]:
    names = (precisions,) if isinstance(precisions, str) else tuple(precisions)
    if not names:
        raise ValueError(f"precisions is empty; name at least one, e.g. {','.join(DEFAULT_PRECISIONS)}")
    canon = tuple(dict.fromkeys(canonical_precision(p) for p in names))  # raises listing valid names
    if "auto" in canon:
        raise ValueError("the bench compares concrete precisions; name them (e.g. fp32,bf16-mixed) instead of "
                         "'auto' (`mixprec env` shows what auto picks here)")
    return canon


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


# -- the job ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class Job(Task):
    """A :class:`~mixprec.tasks.Task` as the bench runs it, and the loaders its runners share.

    Unlike a Task it always has an eval split (the training data where the task has none) and a
    ``collate_fn`` (a user's data is adapted for whole-batch fetching, as the Trainer does).
    ``train`` and ``eval`` are the two datasets.
    """

    @classmethod
    def of(cls, task: Task, config: BenchConfig) -> Job:
        """The bench's job for ``task``: every field kept, the gaps filled.

        Raises:
            ValueError: when the training set has fewer samples than one batch.
        """
        fields = {f.name: getattr(task, f.name) for f in dataclasses.fields(Task)}
        if task.eval_dataset is None:
            fields.update(eval_dataset=task.train_dataset,
                          description=task.description + " (eval loss on the training data)")
        if task.collate_fn is None:
            from mixprec.trainer.datasets import collate, prepare_dataset

            probe = task.build_model()
            # Whole batches by tensor indexing where the data allows it (the Trainer's batched fetch).
            fast = {k: prepare_dataset(fields[k], probe, remove_unused_columns=False, label_names=[],
                                       custom_collator=False) for k in ("train_dataset", "eval_dataset")}
            fields.update(fast, collate_fn=collate)
        job = cls(**fields)
        if len(job.train) < config.batch_size:
            raise ValueError(f"the training set has {len(job.train)} samples, fewer than batch_size="
                             f"{config.batch_size}; use a smaller batch size")
        return job

    @property
    def train(self) -> Any:
        """The training samples (``train_dataset``)."""
        return self.train_dataset

    @property
    def eval(self) -> Any:
        """The samples the eval loss is measured on (``eval_dataset``)."""
        return self.eval_dataset

    def train_loader(self, config: BenchConfig) -> DataLoader:
        """Shuffled (``config.seed``) whole batches of ``config.batch_size``."""
        # drop_last: every step trains exactly batch_size samples, so samples/s is exact.
        return DataLoader(self.train, batch_size=config.batch_size, shuffle=True, drop_last=True,
                          collate_fn=self.collate_fn, generator=torch.Generator().manual_seed(config.seed))

    def eval_batches(self, config: BenchConfig) -> list[Any]:
        """The first ``config.eval_batches`` batches of the eval set, in order."""
        dl = DataLoader(self.eval, batch_size=config.batch_size, shuffle=False, collate_fn=self.collate_fn)
        return [b for _, b in zip(range(config.eval_batches), dl)]


def build_job(config: BenchConfig) -> Job:
    """Load the task ``config`` names (:func:`mixprec.tasks.load_task`) and make it the bench's :class:`Job`."""
    if config.model is not None:
        return Job.of(load_task(model=config.model, data=config.data), config)
    entry = TASKS[config.task]
    options: dict[str, Any] = {entry.variant: getattr(config, entry.variant)}
    if config.task == "pycode":
        block = PYCODE_SIZES[config.size or entry.defaults["size"]].block_size
        # Read only the text the run trains on (an epoch then covers it: the FLOP- and sync-counting
        # steps, the warm-up, the rounds, the profiled step), instead of 4 MB.
        steps = 3 + config.warmup + config.rounds * config.steps + config.memory_steps
        options.update(max_bytes=min(4_000_000, max(steps, 8) * config.batch_size * block + block),
                       eval_max_bytes=(config.eval_batches * config.batch_size + 1) * block)
    return Job.of(load_task(config.task, **options), config)


def tokens_per_sample(batch: Any) -> int | None:
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    return int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None
