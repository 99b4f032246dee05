"""What ``mixprec bench`` trains: :class:`BenchConfig`, and the job (model, data, batches) it builds."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader

from ..optim import COMPENSATIONS
from ..precision import BF16TrueConfig, canonical_precision

__all__ = ["BenchConfig", "DEFAULT_PRECISIONS", "COMPARE_NAMES"]

DEFAULT_PRECISIONS = ("fp32", "fp16-mixed", "bf16-mixed", "bf16-true")
COMPARE_NAMES = ("torch", "trainer", "hf", "accelerate")
_COMPARE_MEANING = ("torch: the hand-written torch.autocast loop, trainer: mixprec's Trainer, hf: the Hugging Face "
                    "Trainer, accelerate: Hugging Face Accelerate")
_TASKS = ("pycode", "digits")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What ``mixprec bench`` measures.

    Args:
        task: ``"pycode"`` or ``"digits"`` (ignored when ``model`` and ``data`` are given).
        size: pycode's size, ``"tiny"``, ``"mini"`` (default) or ``"small"``.
        arch: digits' model, ``"mlp"`` or ``"cnn"``.
        model: ``"module:factory"`` of a model whose forward returns ``.loss``; with ``data``.
        data: ``"module:factory"`` returning a dataset or a ``(train, eval)`` pair.
        precisions: the precisions to compare (names or aliases; canonical ones are kept);
            ``None`` (default): those of :data:`DEFAULT_PRECISIONS` that the device runs at a useful
            speed (fp16-mixed is left out, with a note, on a CPU that has no fp16 matrix kernel).
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
        matmul_size: side of the square matrix product that measures the peak; ``None``: 2048 on
            the CPU, 4096 elsewhere.
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
        if self.model is None and self.task not in _TASKS:
            raise ValueError(f"unknown task {self.task!r}; choose one of {list(_TASKS)}, or give model= and data=")
        from ..tasks import PYCODE_SIZES

        if self.size is not None and (self.task != "pycode" or self.model is not None):
            raise ValueError(f"size= is pycode's option ({', '.join(PYCODE_SIZES)}); drop it for "
                             f"{self.model or self.task}")
        if self.size is not None and self.size not in PYCODE_SIZES:
            raise ValueError(f"unknown pycode size {self.size!r}; choose one of {', '.join(PYCODE_SIZES)}")
        if self.arch not in ("mlp", "cnn"):
            raise ValueError(f"unknown digits arch {self.arch!r}; choose mlp or cnn")
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
            BF16TrueConfig(compensation=comp, state_dtype=self.bf16_true_state_dtype)
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be True or False, got {self.compile!r}")
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as exc:
                raise ValueError(f"device {self.device!r} is not a device name; use e.g. 'cpu', 'cuda' or 'cuda:0'"
                                 ) from exc


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
@dataclasses.dataclass(kw_only=True)
class Job:
    name: str
    build_model: Callable[[], torch.nn.Module]
    train: Any
    eval: Any
    collate_fn: Callable[[Any], Any]
    description: str = ""

    def train_loader(self, config: BenchConfig) -> DataLoader:
        # drop_last: every step trains exactly batch_size samples, so samples/s is exact.
        return DataLoader(self.train, batch_size=config.batch_size, shuffle=True, drop_last=True,
                          collate_fn=self.collate_fn, generator=torch.Generator().manual_seed(config.seed))

    def eval_batches(self, config: BenchConfig) -> list[Any]:
        dl = DataLoader(self.eval, batch_size=config.batch_size, shuffle=False, collate_fn=self.collate_fn)
        return [b for _, b in zip(range(config.eval_batches), dl)]


def build_job(config: BenchConfig) -> Job:
    from ..tasks import PYCODE_SIZES, get_task, load_factory

    if config.model is not None:
        from ..trainer.data import collate, prepare_dataset

        model_factory = load_factory(config.model)
        data = load_factory(config.data)()
        train, evals = data if isinstance(data, tuple) and len(data) == 2 else (data, data)
        probe = model_factory()
        # Whole batches by tensor indexing where the data allows it (the Trainer's batched fetch).
        fast = [prepare_dataset(d, probe, remove_unused_columns=False, label_names=[], custom_collator=False)
                for d in (train, evals)]
        job = Job(name=config.model, build_model=model_factory, train=fast[0], eval=fast[1], collate_fn=collate,
                   description=f"{config.model} on {config.data}" + ("" if evals is not train else
                                                                      " (eval loss on the training data)"))
    elif config.task == "pycode":
        size = config.size or "mini"
        block = PYCODE_SIZES[size].block_size
        # Read only the text the run trains on (an epoch then covers it: the FLOP- and sync-counting
        # steps, the warm-up, the rounds, the profiled step), instead of 4 MB.
        steps = 3 + config.warmup + config.rounds * config.steps + config.memory_steps
        task = get_task("pycode", size, max_bytes=min(4_000_000, max(steps, 8) * config.batch_size * block + block),
                        eval_max_bytes=(config.eval_batches * config.batch_size + 1) * block)
        job = Job(name=task.name, build_model=task.build_model, train=task.train_dataset, eval=task.eval_dataset,
                   collate_fn=task.collate_fn, description=task.description)
    else:
        task = get_task("digits", arch=config.arch)
        job = Job(name=task.name, build_model=task.build_model, train=task.train_dataset, eval=task.eval_dataset,
                   collate_fn=task.collate_fn, description=task.description)
    if len(job.train) < config.batch_size:
        raise ValueError(f"the training set has {len(job.train)} samples, fewer than batch_size={config.batch_size}; "
                         "use a smaller batch size")
    return job


def loss_of(out: Any) -> torch.Tensor:
    loss = out if isinstance(out, torch.Tensor) else out["loss"] if isinstance(out, Mapping) else getattr(out, "loss", None)
    if loss is None:
        raise TypeError(f"the model returned {type(out).__name__} without a loss; its forward must return .loss, "
                        "['loss'] or a tensor when the batch holds labels")
    return loss


def tokens_per_sample(batch: Any) -> int | None:
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    return int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None
