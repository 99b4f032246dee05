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

``compare=("hf", "accelerate")`` adds the same job run through the Hugging Face Trainer and
through Hugging Face Accelerate's ``Accelerator``, interleaved with the others (the Trainer's
``train()`` drives: a callback runs the others' round after each of its chunks).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils import flop_counter
from torch.utils.data import DataLoader

from .accelerator import Accelerator
from .data import send_to_device
from .hardware import default_device, detect_capability
from .precision import PrecisionPerformanceWarning, canonical_precision

__all__ = ["BenchConfig", "run_bench", "DEFAULT_PRECISIONS", "COMPARE_NAMES"]

DEFAULT_PRECISIONS = ("fp32", "fp16-mixed", "bf16-mixed", "bf16-true")
COMPARE_NAMES = ("hf", "accelerate")
_TASKS = ("pycode", "digits")
_LAST_LOSSES = 5  # training losses averaged into the final loss


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What ``mixprec bench`` measures.

    Args:
        task: ``"pycode"`` or ``"digits"`` (ignored when ``model`` and ``data`` are given).
        size: pycode's size, ``"tiny"``, ``"mini"`` (default) or ``"small"``.
        arch: digits' model, ``"mlp"`` or ``"cnn"``.
        model: ``"module:factory"`` of a model whose forward returns ``.loss``; with ``data``.
        data: ``"module:factory"`` returning a dataset or a ``(train, eval)`` pair.
        precisions: the precisions to compare (names or aliases; canonical ones are kept).
        steps: timed optimizer steps per precision in each round.
        rounds: rounds of interleaving.
        warmup: untimed steps per precision before the first round.
        batch_size: samples per step.
        lr: AdamW's learning rate (constant, no weight decay).
        seed: the init and data-order seed, the same for every precision.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; ``None`` picks CUDA, then MPS, then the CPU.
        compare: ``"hf"`` (Hugging Face Trainer) and/or ``"accelerate"`` (Hugging Face Accelerate).
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
    precisions: tuple[str, ...] = DEFAULT_PRECISIONS
    steps: int = 20
    rounds: int = 3
    warmup: int = 2
    batch_size: int = 8
    lr: float = 1e-3
    seed: int = 0
    device: str | None = None
    compare: tuple[str, ...] = ()
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
        from .tasks import PYCODE_SIZES

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
        names = (self.precisions,) if isinstance(self.precisions, str) else tuple(self.precisions)
        if not names:
            raise ValueError(f"precisions is empty; name at least one, e.g. {','.join(DEFAULT_PRECISIONS)}")
        canon = tuple(dict.fromkeys(canonical_precision(p) for p in names))  # raises listing valid names
        if "auto" in canon:
            raise ValueError("the bench compares concrete precisions; name them (e.g. fp32,bf16-mixed) instead of "
                             "'auto' (`mixprec env` shows what auto picks here)")
        object.__setattr__(self, "precisions", canon)
        compare = (self.compare,) if isinstance(self.compare, str) else tuple(self.compare)
        for c in compare:
            if c not in COMPARE_NAMES:
                raise ValueError(f"unknown compare name {c!r}; choose from {', '.join(COMPARE_NAMES)} "
                                 "(hf: the Hugging Face Trainer, accelerate: Hugging Face Accelerate)")
        object.__setattr__(self, "compare", tuple(dict.fromkeys(compare)))
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as exc:
                raise ValueError(f"device {self.device!r} is not a device name; use e.g. 'cpu', 'cuda' or 'cuda:0'"
                                 ) from exc


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


# -- the job ------------------------------------------------------------------------------------
@dataclasses.dataclass(kw_only=True)
class _Job:
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


def _build_job(config: BenchConfig) -> _Job:
    from .tasks import PYCODE_SIZES, get_task, load_factory

    if config.model is not None:
        from .trainer.data import collate, prepare_dataset

        model_factory = load_factory(config.model)
        data = load_factory(config.data)()
        train, evals = data if isinstance(data, tuple) and len(data) == 2 else (data, data)
        probe = model_factory()
        # Whole batches by tensor indexing where the data allows it (the Trainer's batched fetch).
        fast = [prepare_dataset(d, probe, remove_unused_columns=False, label_names=[], custom_collator=False)
                for d in (train, evals)]
        job = _Job(name=config.model, build_model=model_factory, train=fast[0], eval=fast[1], collate_fn=collate,
                   description=f"{config.model} on {config.data}" + ("" if evals is not train else
                                                                      " (eval loss on the training data)"))
    elif config.task == "pycode":
        size = config.size or "mini"
        block = PYCODE_SIZES[size].block_size
        # Read only the text the run trains on (an epoch then covers it), instead of 4 MB.
        steps = 2 + config.warmup + config.rounds * config.steps + config.memory_steps
        task = get_task("pycode", size, max_bytes=min(4_000_000, max(steps, 8) * config.batch_size * block + block),
                        eval_max_bytes=(config.eval_batches * config.batch_size + 1) * block)
        job = _Job(name=task.name, build_model=task.build_model, train=task.train_dataset, eval=task.eval_dataset,
                   collate_fn=task.collate_fn, description=task.description)
    else:
        task = get_task("digits", arch=config.arch)
        job = _Job(name=task.name, build_model=task.build_model, train=task.train_dataset, eval=task.eval_dataset,
                   collate_fn=task.collate_fn, description=task.description)
    if len(job.train) < config.batch_size:
        raise ValueError(f"the training set has {len(job.train)} samples, fewer than batch_size={config.batch_size}; "
                         "use a smaller batch size")
    return job


def _call(model: torch.nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    return model(*batch) if isinstance(batch, (tuple, list)) else model(batch)


def _loss_of(out: Any) -> torch.Tensor:
    loss = out if isinstance(out, torch.Tensor) else out["loss"] if isinstance(out, Mapping) else getattr(out, "loss", None)
    if loss is None:
        raise TypeError(f"the model returned {type(out).__name__} without a loss; its forward must return .loss, "
                        "['loss'] or a tensor when the batch holds labels")
    return loss


def _tokens_per_sample(batch: Any) -> int | None:
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    return int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None


# -- one contestant: a training loop we can run a chunk of steps at a time ----------------------
class _Clock:
    """Step-end marks; on CUDA as events, so timing a step never waits for the device."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []
        _sync(device)

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":  # pragma: no cover
        torch.mps.synchronize()


class _LoopRunner:
    """The user's loop through an Accelerator (ours, or Hugging Face's: the API is the same)."""

    def __init__(self, acc: Any, model: torch.nn.Module, opt: Any, dl: Any, device: torch.device) -> None:
        self.acc, self.model, self.opt, self.dl, self.device = acc, model, opt, dl, device
        self.times: list[float] = []
        self.losses: list[torch.Tensor] = []
        self.optimizer = ""  # what kind, for the report
        self._it = iter(dl)

    def _next(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.dl)
            return next(self._it)

    def step(self, flops: flop_counter.FlopCounterMode | None = None) -> torch.Tensor:
        batch = self._next()
        with flops if flops is not None else contextlib.nullcontext():
            loss = _loss_of(_call(self.model, batch))
            self.acc.backward(loss)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def run_chunk(self, n: int) -> None:
        clock = _Clock(self.device)
        clock.mark()
        for _ in range(n):
            self.losses.append(self.step())
            clock.mark()
        self.times += clock.intervals()

    def count_flops(self) -> int:
        """One training step with its forward and backward FLOPs counted (a real step, untimed)."""
        counter = flop_counter.FlopCounterMode(display=False, custom_mapping=_CPU_SDPA_FLOPS)
        self.step(counter)
        return int(counter.get_total_flops())

    def finish(self) -> None:
        pass


def _sdpa_cpu(q, k, v, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(q, k, v)


def _sdpa_cpu_backward(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out, q, k, v)


# torch counts the CUDA attention kernels but not the CPU one; count it the same way.
_CPU_SDPA_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward,
}


def _adamw(params: Any, lr: float) -> torch.optim.Optimizer:
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    except (RuntimeError, ValueError, TypeError):  # a device or dtype fused AdamW does not take
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=True)


def _mixprec_runner(job: _Job, precision: str, config: BenchConfig, device: torch.device) -> _LoopRunner:
    acc = Accelerator(mixed_precision=precision, cpu=device.type == "cpu")
    torch.manual_seed(config.seed)
    model = acc.prepare_model(job.build_model())
    # Built after prepare_model, so it sees the parameters in their final dtype (bf16-true).
    opt = _adamw(list(model.parameters()), config.lr)
    prepared = acc.prepare_optimizer(opt)
    runner = _LoopRunner(acc, model, prepared, acc.prepare_data_loader(job.train_loader(config)), device)
    runner.optimizer = _describe(prepared.optimizer)  # bf16-true swaps in its compensated twin
    return runner


def _describe(opt: torch.optim.Optimizer) -> str:
    kind = type(opt)
    how = [k for k in ("fused", "foreach") if opt.defaults.get(k)] + (
        [f"{opt.defaults['compensation']} compensation"] if "compensation" in opt.defaults else [])
    return f"{kind.__module__.replace('torch.optim.adamw', 'torch.optim')}.{kind.__name__}" + (
        f" ({', '.join(how)})" if how else "")


# -- memory -------------------------------------------------------------------------------------
def _proc_status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _memory_probe_main() -> None:
    """Run in a fresh process: the peak RSS growth of building and training one precision (CPU)."""
    import resource

    request = json.loads(sys.stdin.read())
    config = BenchConfig(**request["config"])
    warnings.simplefilter("ignore", PrecisionPerformanceWarning)
    job = _build_job(config)
    try:  # Linux: writing 5 resets the peak (VmHWM) to the current RSS
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        base, method = _proc_status_bytes("VmRSS"), "VmHWM"
    except OSError:
        base, method = None, "ru_maxrss"
    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is in bytes on macOS, KiB elsewhere
    if base is None:  # the peak so far is a floor: the growth is then a lower bound
        base, method = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit, "ru_maxrss, a lower bound"
    runner = _mixprec_runner(job, request["precision"], config, torch.device("cpu"))
    runner.run_chunk(config.memory_steps)
    peak = _proc_status_bytes("VmHWM") if method == "VmHWM" else None
    peak = peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit
    print(json.dumps({"peak_bytes": max(0, peak - base), "method": method}))


def _cpu_peak_memory(config: BenchConfig, precision: str) -> tuple[int | None, str]:
    """``(bytes, how)`` from :func:`_memory_probe_main` in a fresh process; ``(None, why)`` if it failed."""
    request = json.dumps({"config": dataclasses.asdict(config), "precision": precision})
    # The same imports as here (a user's factory module found through sys.path included).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    code = "from mixprec.bench import _memory_probe_main; _memory_probe_main()"
    try:
        proc = subprocess.run([sys.executable, "-c", code], input=request, capture_output=True, text=True,
                              env=env, timeout=1800)
    except subprocess.TimeoutExpired:
        return None, "the memory measurement timed out"
    try:
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        return int(out["peak_bytes"]), out["method"]
    except (ValueError, IndexError, KeyError):
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"the memory measurement failed: {last}"


# -- the device's matrix-product peak -----------------------------------------------------------
def _matmul_peak(device: torch.device, dtypes: list[torch.dtype], n: int) -> dict[str, float]:
    """Best-of-3 TFLOP/s of an ``n x n @ n x n`` product in each dtype."""
    inner = 1 if device.type == "cpu" else 10  # enough work between syncs on a fast device
    peaks = {}
    for dtype in dtypes:
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        torch.mm(a, b)
        best = math.inf
        for _ in range(3):
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(inner):
                torch.mm(a, b)
            _sync(device)
            best = min(best, (time.perf_counter() - t0) / inner)
        peaks[_dtype_name(dtype)] = 2 * n**3 / best / 1e12
    return peaks


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- profile --------------------------------------------------------------------------------------
_MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product")


@contextlib.contextmanager
def _quiet_stderr() -> Any:
    """Silence file descriptor 2: the profiler's C++ side logs every start and stop there."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _profile_step(runner: Any, device: torch.device, rows: int = 15) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with _quiet_stderr(), profile(activities=activities) as prof:
        runner.step()
        _sync(device)
    events = prof.key_averages()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    total = sum(getattr(e, key) for e in events) or 1.0
    in_matmul = sum(getattr(e, key) for e in events if e.key.startswith(_MATMUL_OPS))
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:rows]
    return {"matmul_fraction": in_matmul / total, "self_time_ms": total / 1e3,
            "top": [{"op": e.key, "self_ms": getattr(e, key) / 1e3, "share": getattr(e, key) / total} for e in top],
            "table": events.table(sort_by=key, row_limit=rows)}


# -- Hugging Face, for comparison ------------------------------------------------------------------
_HF_RUNNERS = {"hf": "hf-trainer", "accelerate": "accelerate"}
_HF_PRECISIONS = ("bf16-mixed", "fp16-mixed", "fp32")  # what Hugging Face offers too, by preference
_ACCELERATE_NAMES = {"fp32": "no", "fp16-mixed": "fp16", "bf16-mixed": "bf16"}


def _compare_precision(precisions: tuple[str, ...]) -> str:
    """bf16-mixed where benchmarked (Hugging Face's ``bf16=True``), else the first benchmarked
    precision Hugging Face offers too; bf16-mixed when none is (bf16-true has no HF equivalent)."""
    return next((p for p in _HF_PRECISIONS if p in precisions), "bf16-mixed")


def _hf_missing(name: str) -> str:
    needed = ("transformers", "accelerate") if name == "hf" else ("accelerate",)
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    return f"{' and '.join(missing)} not installed (pip install {' '.join(missing)})" if missing else ""


def _accelerate_runner(job: _Job, precision: str, config: BenchConfig, device: torch.device,
                       notes: list[str]) -> _LoopRunner:
    import accelerate

    acc = accelerate.Accelerator(mixed_precision=_ACCELERATE_NAMES[precision], cpu=device.type == "cpu")
    if precision == "fp16-mixed" and not getattr(acc, "native_amp", True):
        notes.append(f"Hugging Face Accelerate runs fp16-mixed on {device.type} as fp32 (no autocast, no scaler)")
    torch.manual_seed(config.seed)
    model = job.build_model().to(device)
    opt = _adamw(list(model.parameters()), config.lr)
    model, opt, dl = acc.prepare(model, opt, job.train_loader(config))
    runner = _LoopRunner(acc, model, opt, dl, device)
    runner.optimizer = _describe(opt.optimizer)
    return runner


class _TrainerRunner:
    """The Hugging Face Trainer as a contestant. ``train()`` cannot be paused, so it drives: a
    callback runs the other contestants' round after each of its chunks of steps. (Not a thread:
    on the CPU a second thread running torch gets its own OpenMP team, and from then on every
    step in the process, ours too, ran 2-3x slower in our measurements.)"""

    def __init__(self, job: _Job, precision: str, config: BenchConfig, device: torch.device,
                 notes: list[str]) -> None:
        import transformers

        self.device, self.times, self.losses = device, [], []
        self.optimizer = "optim='adamw_torch_fused'"
        self._chunks: list[tuple[int, Callable[[], None]]] = []
        self._left, self._clock = 0, _Clock(device)
        torch.manual_seed(config.seed)
        self.model = job.build_model()
        if dataclasses.is_dataclass(getattr(self.model, "config", None)):
            # The Trainer writes model.config attributes; give it a mutable copy of a frozen config.
            self.model.config = types.SimpleNamespace(**dataclasses.asdict(self.model.config))
        self.model.register_forward_hook(self._record_loss)
        self._dir = tempfile.TemporaryDirectory(prefix="mixprec-bench-hf-")
        args = transformers.TrainingArguments(
            output_dir=self._dir.name, bf16=precision == "bf16-mixed", fp16=precision == "fp16-mixed",
            use_cpu=device.type == "cpu", optim="adamw_torch_fused", learning_rate=config.lr, weight_decay=0.0,
            lr_scheduler_type="constant", max_grad_norm=0.0, per_device_train_batch_size=config.batch_size,
            max_steps=1 + config.warmup + config.rounds * config.steps, logging_strategy="no", save_strategy="no",
            report_to="none", disable_tqdm=True, remove_unused_columns=False, seed=config.seed)
        loader, runner = job.train_loader(config), self

        class Trainer(transformers.Trainer):
            # The documented override. Unprepared, so that Accelerate's seedable sampler keeps the
            # others' data order; one process needs no sharding, and the Trainer moves each batch.
            def get_train_dataloader(self) -> Any:
                return loader

        class Chunks(transformers.TrainerCallback):
            def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
                runner._next_chunk()

            def on_step_end(self, *args: Any, **kwargs: Any) -> None:
                runner._step_end()

        self.trainer = Trainer(model=self.model, args=args, train_dataset=job.train, data_collator=job.collate_fn,
                               callbacks=[Chunks()])
        self.trainer.remove_callback(transformers.PrinterCallback)  # it prints the final metrics
        if precision == "fp16-mixed" and not getattr(self.trainer.accelerator, "native_amp", True):
            notes.append(f"the Hugging Face Trainer runs fp16-mixed on {device.type} as fp32 (no autocast, no scaler)")

    def _record_loss(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if module.training:
            self.losses.append(_loss_of(output).detach())

    def _next_chunk(self) -> None:
        self._left = self._chunks[0][0] if self._chunks else -1
        self._clock = _Clock(self.device)
        self._clock.mark()

    def _step_end(self) -> None:
        self._clock.mark()
        self._left -= 1
        if self._left == 0:
            self.times += self._clock.intervals()
            _, then = self._chunks.pop(0)
            # Called bare: an autocast region around it, even a disabled one, would keep the
            # others' cached bf16 copies of their weights alive across their optimizer steps.
            then()
            self._next_chunk()

    def train(self, config: BenchConfig, play_round: Callable[[int], None]) -> None:
        """Train the warm-up and every round's chunk, calling ``play_round(r)`` after chunk ``r``."""
        def warmed_up() -> None:
            self.times.clear()
            self.losses.clear()

        self._chunks = [(1 + config.warmup, warmed_up)] + [
            (config.steps, lambda r=r: play_round(r)) for r in range(config.rounds)]
        self.trainer.train()

    def finish(self) -> None:
        self._dir.cleanup()


_HF_FACTORIES = {"hf": _TrainerRunner, "accelerate": _accelerate_runner}


def _reset_hf_state() -> None:
    # Accelerate keeps one process-wide state ("Borg"); clear it so a later run may differ.
    state = sys.modules.get("accelerate.state")
    for cls, args in (("AcceleratorState", (True,)), ("GradientState", ())):
        reset = getattr(getattr(state, cls, None), "_reset_state", None)
        if reset is not None:
            reset(*args)


# -- the run ------------------------------------------------------------------------------------
def _eval_loss(model: torch.nn.Module, batches: list[Any], device: torch.device) -> float:
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            n = len(next(iter(batch.values())) if isinstance(batch, Mapping) else batch[0])
            total += float(_loss_of(_call(model, send_to_device(batch, device))).float()) * n
            count += n
    model.train(was_training)
    return total / max(count, 1)


def _resolve_device(name: str | None) -> torch.device:
    device = torch.device(name) if name is not None else default_device()
    detect_capability(device)  # raises, saying why, for a device that is not there
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def _machine(device: torch.device) -> dict[str, Any]:
    cap = detect_capability(device)
    return {"device": cap.device, "device_name": cap.name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}


def run_bench(config: BenchConfig) -> dict[str, Any]:
    """Train the job under each precision, interleaved, and measure it; returns every number.

    Precisions the device cannot run are reported with ``status="skipped"`` and the reason. That
    fp16 is emulated on a CPU without AMX-FP16 lands in ``notes``, not in a warning.

    Args:
        config: what to measure.

    Returns:
        ``{"machine", "config", "task", "baseline", "matmul_size", "matmul_peak_tflops",
        "memory_method", "results", "notes", "profile"}``; ``results`` maps a row name (a
        precision, or ``"hf-trainer bf16-mixed"``...) to its numbers.

    Example:
        >>> out = run_bench(BenchConfig(size="tiny", precisions=["fp32"], steps=2, rounds=1, memory=False))
        >>> out["results"]["fp32"]["speedup"]
        1.0
    """
    device = _resolve_device(config.device)
    cap = detect_capability(device)
    try:
        job = _build_job(config)
    except (ImportError, AttributeError, TypeError) as exc:  # load_factory's, naming the spec and the fix
        raise ValueError(f"cannot build the task: {exc}") from exc
    notes = [f"{p} is emulated here: {cap.reasons[p]}" for p in config.precisions
             if cap.support.get(p) == "emulated" and p in cap.reasons]
    rows: dict[str, dict[str, Any]] = {}
    runners: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionPerformanceWarning)  # said once, in the notes
        for p in config.precisions:
            rows[p] = {"runner": "mixprec", "precision": p}
            _start(rows[p], runners, p, lambda p=p: _mixprec_runner(job, p, config, device), device, config)
        hf_precision = _compare_precision(config.precisions)
        for c in config.compare:
            name = f"{_HF_RUNNERS[c]} {hf_precision}"
            rows[name] = {"runner": _HF_RUNNERS[c], "precision": hf_precision}
            if _hf_missing(c):
                _skip(rows[name], _hf_missing(c))
                continue
            _start(rows[name], runners, name, lambda c=c: _HF_FACTORIES[c](job, hf_precision, config, device, notes),
                   device, config)
        size = config.matmul_size or (2048 if device.type == "cpu" else 4096)
        dtypes = sorted({torch.float32} | {_COMPUTE_DTYPE[p] for p in config.precisions}, key=str)
        try:
            profiles, round_peaks = _run_rounds(rows, runners, job, config, device,
                                                lambda: _matmul_peak(device, dtypes, size))
        finally:
            for runner in runners.values():
                runner.finish()
            _reset_hf_state()
        memory_method = _measure_memory(rows, runners, config, device)
    peaks = {k: max(p[k] for p in round_peaks) for k in round_peaks[0]}
    sample = next(iter(DataLoader(job.train, batch_size=config.batch_size, collate_fn=job.collate_fn)))
    tokens = _tokens_per_sample(sample)
    for name, runner in runners.items():
        _finish_row(rows[name], runner, config, round_peaks, rows, tokens)
    baseline = "fp32" if rows.get("fp32", {}).get("status") == "ok" else next(
        (n for n, r in rows.items() if r.get("status") == "ok" and r["runner"] == "mixprec"), None)
    if baseline not in (None, "fp32"):
        notes.append(f"fp32 was not measured: speed-ups and loss differences are against {baseline}")
    _add_ratios(rows, baseline)
    notes += _drift_note(rows)
    notes += [f"{n} trains with {r['optimizer']}: the Accelerator's replacement for the fused torch AdamW"
              for n, r in rows.items() if r.get("status") == "ok" and r["runner"] == "mixprec"
              and r["optimizer"] != "torch.optim.AdamW (fused)"]
    if any(r["runner"] != "mixprec" and r.get("status") == "ok" for r in rows.values()):
        notes.append("Hugging Face rows: same init, data order and optimizer as mixprec's; their FLOPs per step "
                     "are mixprec's count for the same job, their memory is not measured; vs mixprec is their "
                     "throughput over mixprec.Accelerator's at the same precision")
    model = next(iter(runners.values())).model if runners else job.build_model()
    return {
        "machine": _machine(device),
        "config": dataclasses.asdict(config),
        "task": {"name": job.name, "description": job.description, "batch_size": config.batch_size,
                 "tokens_per_sample": tokens, "parameters": sum(p.numel() for p in model.parameters())},
        "baseline": baseline,
        "matmul_size": size,
        "matmul_peak_tflops": peaks,
        "matmul_peak_tflops_per_round": round_peaks,
        "memory_method": memory_method,
        "results": rows,
        "notes": list(dict.fromkeys(notes)),
        "profile": profiles,
    }


_COMPUTE_DTYPE = {"fp32": torch.float32, "fp16-mixed": torch.float16, "bf16-mixed": torch.bfloat16,
                  "bf16-true": torch.bfloat16}


def _skip(row: dict[str, Any], reason: str) -> None:
    row.update(status="skipped", reason=reason)


def _start(row: dict[str, Any], runners: dict[str, Any], name: str, build: Callable[[], Any],
           device: torch.device, config: BenchConfig) -> None:
    """Build a contestant, count its FLOPs on one step, warm it up; a failure skips it, saying why."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    runner = None
    try:
        runner = build()
        if isinstance(runner, _LoopRunner):  # the Trainer warms up in its own run (_run_rounds)
            row["flops_per_step"] = runner.count_flops()
            runner.run_chunk(config.warmup)
    except Exception as exc:  # e.g. resolve_precision's ValueError for a precision the device lacks
        _skip(row, f"{type(exc).__name__}: {exc}")
        if runner is not None:
            runner.finish()
        return
    runner.times.clear()
    runner.losses.clear()
    if device.type == "cuda" and config.memory and row["runner"] == "mixprec":
        row["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device) - before
    row.update(status="ok", optimizer=runner.optimizer)
    runners[name] = runner


def _run_rounds(rows: dict[str, dict[str, Any]], runners: dict[str, Any], job: _Job, config: BenchConfig,
                device: torch.device, peak: Callable[[], dict[str, float]]) -> tuple[dict[str, Any], list[dict]]:
    """The interleaved rounds, each ending with a matmul-peak measurement (so the peak drifts with
    the steps it is compared to); then each contestant's eval loss and (if asked) a profiled step."""
    played, peaks = [], []

    def play_round(r: int) -> None:
        for name, runner in list(runners.items()):
            if isinstance(runner, _LoopRunner):
                try:
                    runner.run_chunk(config.steps)
                except Exception as exc:  # one contestant failing must not lose the others' numbers
                    _skip(rows[name], f"failed in round {r + 1}: {type(exc).__name__}: {exc}")
                    runners.pop(name).finish()
        peaks.append(peak())
        played.append(r)

    trainer = next(((n, r) for n, r in runners.items() if isinstance(r, _TrainerRunner)), None)
    if trainer is not None:
        try:
            trainer[1].train(config, play_round)
        except Exception as exc:
            _skip(rows[trainer[0]], f"failed: {type(exc).__name__}: {exc}")
            runners.pop(trainer[0]).finish()
    for r in range(len(played), config.rounds):
        play_round(r)
    eval_set = job.eval_batches(config)
    for name, runner in runners.items():
        rows[name]["eval_loss"] = _eval_loss(runner.model, eval_set, device)
    profiles = {n: _profile_step(r, device) for n, r in runners.items()
                if config.profile and rows[n]["runner"] == "mixprec"}
    return profiles, peaks


def _measure_memory(rows: dict[str, dict[str, Any]], runners: dict[str, Any], config: BenchConfig,
                    device: torch.device) -> str:
    """Peak memory per precision on the CPU (CUDA's was taken in :func:`_start`); says how."""
    if not config.memory:
        return ""
    if device.type != "cpu":
        return "torch.cuda.max_memory_allocated growth over building the model and its warm-up steps"
    names = [n for n in runners if rows[n]["runner"] == "mixprec"]
    # Two at a time: each process's peak is its own, and the start-up (importing torch) overlaps.
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        measured = list(pool.map(lambda n: _cpu_peak_memory(config, n), names))
    how = set()
    for name, (peak, method) in zip(names, measured):
        rows[name]["peak_memory_bytes"] = peak
        how.add(method)
    return (f"peak RSS growth of a fresh process per precision that builds the model and trains "
            f"{config.memory_steps} steps (peak read from {', '.join(sorted(how))}); it includes torch's one-time "
            "set-up (kernels, thread pools: tens of MiB), so for small models compare the differences")


def _finish_row(row: dict[str, Any], runner: Any, config: BenchConfig, round_peaks: list[dict[str, float]],
                rows: dict[str, dict[str, Any]], tokens: int | None) -> None:
    median = statistics.median(runner.times)
    per_round = [statistics.median(runner.times[r * config.steps:(r + 1) * config.steps])
                 for r in range(config.rounds)]
    samples = config.batch_size / median
    row.update(step_time_s=median, step_time_per_round_s=per_round, step_time_min_s=min(runner.times),
               round_spread=max(per_round) / min(per_round), step_times_s=list(runner.times),
               samples_per_s=samples, tokens_per_s=samples * tokens if tokens else None,
               compute_dtype=_dtype_name(_COMPUTE_DTYPE[row["precision"]]))
    if not row.get("flops_per_step"):  # a compare row: the same job's FLOPs, counted on our run
        row["flops_per_step"] = rows.get(row["precision"], {}).get("flops_per_step")
    flops = row["flops_per_step"]
    row["tflops"] = flops / median / 1e12 if flops else None
    # Each round against the peak measured right after it, so a slower machine lowers both alike.
    row["fraction_of_peak"] = statistics.median(
        flops / t / 1e12 / p[row["compute_dtype"]] for t, p in zip(per_round, round_peaks)) if flops else None
    row["train_loss"] = float(torch.stack(runner.losses[-_LAST_LOSSES:]).float().mean())


def _round_ratio(base: dict[str, Any], row: dict[str, Any]) -> float:
    """The median over rounds of the per-round throughput ratio: drift between rounds cancels."""
    return statistics.median(b / t for b, t in zip(base["step_time_per_round_s"], row["step_time_per_round_s"]))


def _add_ratios(rows: dict[str, dict[str, Any]], baseline: str | None) -> None:
    base = rows.get(baseline, {}) if baseline else {}
    for row in rows.values():
        if row.get("status") != "ok":
            continue
        # Equal batches, so the step-time ratio is the throughput ratio.
        row["speedup"] = _round_ratio(base, row) if base else None
        # Other work only ever slows a step down: the fastest steps are the least disturbed.
        row["speedup_fastest_steps"] = base["step_time_min_s"] / row["step_time_min_s"] if base else None
        for key in ("train_loss", "eval_loss"):
            b = base.get(key)
            row[f"{key}_rel_diff"] = (row[key] - b) / abs(b) if b else None
        twin = rows.get(row["precision"], {})
        if row["runner"] != "mixprec" and twin.get("status") == "ok":
            row["throughput_vs_mixprec"] = _round_ratio(twin, row)


def _drift_note(rows: dict[str, dict[str, Any]], tolerance: float = 1.25) -> list[str]:
    """A warning, in words, when the machine's speed changed so much between rounds that the
    interleaving cannot cancel it (other work on a shared machine comes and goes in bursts)."""
    ok = {n: r for n, r in rows.items() if r.get("status") == "ok"}
    worst = max(ok.items(), key=lambda kv: kv[1]["round_spread"], default=None)
    if worst is None or worst[1]["round_spread"] <= tolerance:
        return []
    fastest = ", ".join(f"{n} {r['speedup_fastest_steps']:.2f}x" for n, r in ok.items()
                        if r.get("speedup_fastest_steps") is not None)
    return [f"the machine's speed changed during the run ({worst[0]}'s round medians differ by "
            f"{worst[1]['round_spread']:.1f}x; other work running?): the speed-ups are unreliable. On each one's "
            f"fastest steps, the least disturbed: {fastest}. Rerun on an idle machine, or with more, shorter rounds"]
