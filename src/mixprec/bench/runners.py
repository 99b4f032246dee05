"""The contestants of ``mixprec bench``: the training loop through :class:`~mixprec.Accelerator`,
the hand-written torch loop, mixprec's Trainer, and the same job through Hugging Face Accelerate
and the Hugging Face Trainer."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import sys
import tempfile
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import flop_counter

from ..accelerator import Accelerator
from ..data import send_to_device
from ..precision import policy_for
from ..trainer import PrinterCallback
from ..trainer.outputs import call_model
from .config import BenchConfig, Job, loss_of
from .measure import CPU_SDPA_FLOPS, Clock
from .syncs import count_host_syncs, host_side_tensors


# -- one contestant: a training loop we can run a chunk of steps at a time ----------------------
class Runner:
    """A contestant that trains a chunk of steps at a time; ``step()`` is one optimizer step."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device
        self.times: list[float] = []
        self.losses: list[torch.Tensor] = []
        self.optimizer = ""  # what kind, for the report
        self.input_dtype: torch.dtype | None = None  # what floating inputs are cast to (bf16-true by hand)

    def step(self, flops: flop_counter.FlopCounterMode | None = None) -> torch.Tensor:
        """One optimizer step, its forward and backward under ``flops``; returns the detached loss."""
        raise NotImplementedError

    def run_chunk(self, n: int) -> None:
        clock = Clock(self.device)
        clock.mark()
        for _ in range(n):
            self.losses.append(self.step())
            clock.mark()
        self.times += clock.intervals()

    def count_syncs(self) -> int:
        """Host-device syncs in one training step (a real step, untimed), as
        :func:`~mixprec.bench.syncs.count_host_syncs` counts them; the optimizer's host-side step
        counters are not device reads."""
        with count_host_syncs(self.device, ignore=host_side_tensors(self._optimizer())) as syncs:
            self.step()
        return syncs.count

    def _optimizer(self) -> Any:
        raise NotImplementedError

    def count_flops(self) -> int:
        """One training step with its forward and backward FLOPs counted (a real step, untimed)."""
        counter = flop_counter.FlopCounterMode(display=False, custom_mapping=CPU_SDPA_FLOPS)
        with warnings.catch_warnings():
            # The counter's module hooks are global; a compiled model warns they fire twice. The
            # count is unaffected (it counts operators, not hook calls).
            warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
            self.step(counter)
        return int(counter.get_total_flops())

    def finish(self) -> None:
        pass


class _LoopRunner(Runner):
    """The user's loop through an Accelerator (ours, or Hugging Face's: the API is the same)."""

    def __init__(self, acc: Any, model: torch.nn.Module, opt: Any, dl: Any, device: torch.device) -> None:
        super().__init__(model, device)
        self.acc, self.opt, self.dl = acc, opt, dl
        self._it = iter(dl)

    def _optimizer(self) -> Any:
        return self.opt

    def _next(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.dl)
            return next(self._it)

    def step(self, flops: flop_counter.FlopCounterMode | None = None) -> torch.Tensor:
        batch = self._next()
        with flops if flops is not None else contextlib.nullcontext():
            loss = loss_of(call_model(self.model, batch, self.model))
            self.acc.backward(loss)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def _adamw(params: Any, lr: float) -> torch.optim.Optimizer:
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    except (RuntimeError, ValueError, TypeError):  # a device or dtype fused AdamW does not take
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=True)


def mixprec_runner(job: Job, precision: str, config: BenchConfig, device: torch.device,
                    compensation: str | None = None) -> _LoopRunner:
    """The Accelerator's loop; ``compensation`` picks bf16-true's update (default: the config's first)."""
    acc = Accelerator(mixed_precision=precision, cpu=device.type == "cpu", compile=config.compile,
                      bf16_true_compensation=compensation or config.bf16_true_compensation[0],
                      bf16_true_state_dtype=config.bf16_true_state_dtype)
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
        [f"{opt.defaults['compensation']} compensation"] if "compensation" in opt.defaults else []) + (
        ["bf16 moments"] if opt.defaults.get("state_dtype") == torch.bfloat16 else [])
    return f"{kind.__module__.replace('torch.optim.adamw', 'torch.optim')}.{kind.__name__}" + (
        f" ({', '.join(how)})" if how else "")


# -- without mixprec's Accelerator: the hand-written loop, and mixprec's Trainer ----------------


class _TorchLoopRunner(_LoopRunner):
    """The loop a user writes with torch alone: ``torch.autocast`` (plus ``torch.amp.GradScaler``
    for fp16), or for bf16-true the model cast to bf16 and torch's AdamW, uncompensated."""

    def __init__(self, job: Job, precision: str, config: BenchConfig, device: torch.device,
                 notes: list[str]) -> None:
        torch.manual_seed(config.seed)
        # What the policy says, written out as a torch user would: no mixprec plugin here.
        policy = policy_for(precision)
        model = job.build_model().to(device=device, dtype=policy.param_dtype)
        opt = _adamw(list(model.parameters()), config.lr)
        super().__init__(None, torch.compile(model) if config.compile else model, opt, job.train_loader(config),
                         device)
        self._dtype = policy.compute_dtype if policy.autocast_enabled else None
        self.scaler = torch.amp.GradScaler(device.type) if policy.needs_loss_scaler else None
        self.input_dtype = policy.param_dtype if policy.param_dtype != torch.float32 else None
        self.optimizer = _describe(opt)

    def step(self, flops: flop_counter.FlopCounterMode | None = None) -> torch.Tensor:
        batch = send_to_device(self._next(), self.device, float_dtype=self.input_dtype)
        autocast = torch.autocast(self.device.type, dtype=self._dtype) if self._dtype else contextlib.nullcontext()
        with flops if flops is not None else contextlib.nullcontext():
            with autocast:
                loss = loss_of(call_model(self.model, batch, self.model))
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


class _MixprecTrainerRunner(Runner):
    """mixprec's :class:`~mixprec.Trainer`, stepped through its loop's generator
    (``Trainer._training_steps``), on the bench's dataloader (prepared by its own Accelerator)."""

    def __init__(self, job: Job, precision: str, config: BenchConfig, device: torch.device,
                 notes: list[str]) -> None:
        from ..trainer import Trainer, TrainingArguments

        self._dir = tempfile.TemporaryDirectory(prefix="mixprec-bench-trainer-")
        args = TrainingArguments(
            output_dir=self._dir.name, precision=precision, use_cpu=device.type == "cpu",
            optim="adamw_torch_fused", learning_rate=config.lr, weight_decay=0.0, lr_scheduler_type="constant",
            max_grad_norm=0.0, per_device_train_batch_size=config.batch_size, max_steps=_steps_to_train(config),
            logging_steps=10**9, save_strategy="no", report_to="none", disable_tqdm=True,
            remove_unused_columns=False, seed=config.seed, torch_compile=config.compile,
            bf16_true_compensation=config.bf16_true_compensation[0], bf16_true_state_dtype=config.bf16_true_state_dtype)
        loader, runner = job.train_loader(config), self

        class BenchTrainer(Trainer):
            # The bench's loader: the Trainer's own draws the same order (seeded alike) but keeps
            # a last partial batch; this way every contestant trains exactly the same batches.
            def get_train_dataloader(self) -> Any:
                return self.accelerator.prepare_data_loader(loader)

            def training_step(self, model: torch.nn.Module, inputs: Any) -> torch.Tensor:
                runner._loss = super().training_step(model, inputs)
                return runner._loss

        torch.manual_seed(config.seed)
        self.trainer = BenchTrainer(model=job.build_model(), args=args, train_dataset=job.train,
                                    data_collator=job.collate_fn)
        self.trainer.remove_callback(PrinterCallback)  # the bench prints its own table
        super().__init__(self.trainer.model_wrapped, device)
        self._loss = torch.zeros(())
        self._steps = self.trainer._training_steps()

    def step(self, flops: flop_counter.FlopCounterMode | None = None) -> torch.Tensor:
        with flops if flops is not None else contextlib.nullcontext():
            if next(self._steps, None) is None:
                raise RuntimeError(f"the Trainer ended at its max_steps={self.trainer.args.max_steps}")
        if not self.optimizer:  # the Trainer makes it when its loop starts
            self.optimizer = _describe(self.trainer.optimizer.optimizer)
        return self._loss

    def _optimizer(self) -> Any:
        return self.trainer.optimizer

    def finish(self) -> None:
        self._steps.close()
        self._dir.cleanup()


# Untimed steps besides the warm-up: one counts the FLOPs, one the host syncs (the Hugging Face
# Trainer, which cannot be stepped alone, trains as many before its rounds: the same batches).
_COUNTING_STEPS = 2


def _steps_to_train(config: BenchConfig) -> int:
    """Every contestant's steps: the counting ones, the warm-up, the rounds."""
    return _COUNTING_STEPS + config.warmup + config.rounds * config.steps


# -- Hugging Face, for comparison ------------------------------------------------------------------
_HF_PRECISIONS = ("bf16-mixed", "fp16-mixed", "fp32")  # what Hugging Face offers too, by preference
_ACCELERATE_NAMES = {"fp32": "no", "fp16-mixed": "fp16", "bf16-mixed": "bf16"}


def compare_precision(precisions: tuple[str, ...], name: str = "hf") -> str:
    """The precision contestant ``name`` runs at: bf16-mixed where benchmarked (Hugging Face's
    ``bf16=True``), else the first benchmarked one it offers too (bf16-true last, and only for the
    torch loop and mixprec's Trainer: Hugging Face has none); bf16-mixed when none is."""
    offered = _HF_PRECISIONS + (("bf16-true",) if name in ("torch", "trainer") else ())
    return next((p for p in offered if p in precisions), "bf16-mixed")


def hf_missing(name: str) -> str:
    if name not in ("hf", "accelerate"):
        return ""
    needed = ("transformers", "accelerate") if name == "hf" else ("accelerate",)
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    return f"{' and '.join(missing)} not installed (pip install {' '.join(missing)})" if missing else ""


def _accelerate_runner(job: Job, precision: str, config: BenchConfig, device: torch.device,
                       notes: list[str]) -> _LoopRunner:
    import accelerate

    acc = accelerate.Accelerator(mixed_precision=_ACCELERATE_NAMES[precision], cpu=device.type == "cpu",
                                 dynamo_backend="inductor" if config.compile else None)
    if precision == "fp16-mixed" and not getattr(acc, "native_amp", True):
        notes.append(f"Hugging Face Accelerate runs fp16-mixed on {device.type} as fp32 (no autocast, no scaler)")
    torch.manual_seed(config.seed)
    model = job.build_model().to(device)
    opt = _adamw(list(model.parameters()), config.lr)
    model, opt, dl = acc.prepare(model, opt, job.train_loader(config))
    runner = _LoopRunner(acc, model, opt, dl, device)
    runner.optimizer = _describe(opt.optimizer)
    return runner


class TrainerRunner:
    """The Hugging Face Trainer as a contestant. ``train()`` cannot be paused, so it drives: a
    callback runs the other contestants' round after each of its chunks of steps. (Not a thread:
    on the CPU a second thread running torch gets its own OpenMP team, and from then on every
    step in the process, ours too, ran 2-3x slower in our measurements.)"""

    def __init__(self, job: Job, precision: str, config: BenchConfig, device: torch.device,
                 notes: list[str]) -> None:
        import transformers

        self.device, self.times, self.losses = device, [], []
        self.optimizer = "optim='adamw_torch_fused'"
        self._chunks: list[tuple[int, Callable[[], None]]] = []
        self._left, self._clock = 0, Clock(device)
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
            max_steps=_steps_to_train(config), logging_strategy="no", save_strategy="no", report_to="none",
            disable_tqdm=True, remove_unused_columns=False, seed=config.seed, torch_compile=config.compile)
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
            self.losses.append(loss_of(output).detach())

    def _next_chunk(self) -> None:
        self._left = self._chunks[0][0] if self._chunks else -1
        self._clock = Clock(self.device)
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

        self._chunks = [(_COUNTING_STEPS + config.warmup, warmed_up)] + [
            (config.steps, lambda r=r: play_round(r)) for r in range(config.rounds)]
        self.trainer.train()

    def finish(self) -> None:
        self._dir.cleanup()


# Each --compare name: its row's label, and what builds it (job, precision, config, device, notes).
RIVALS = {"torch": "torch-loop", "trainer": "mixprec-trainer", "hf": "hf-trainer", "accelerate": "accelerate"}
RIVAL_FACTORIES = {"torch": _TorchLoopRunner, "trainer": _MixprecTrainerRunner, "hf": TrainerRunner,
                    "accelerate": _accelerate_runner}


def reset_hf_state() -> None:
    # Accelerate keeps one process-wide state ("Borg"); clear it so a later run may differ.
    state = sys.modules.get("accelerate.state")
    for cls, args in (("AcceleratorState", (True,)), ("GradientState", ())):
        reset = getattr(getattr(state, cls, None), "_reset_state", None)
        if reset is not None:
            reset(*args)
