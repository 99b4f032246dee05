"""The contestants of ``mixprec bench``: the training loop through :class:`~mixprec.Accelerator`,
and the same job through Hugging Face Accelerate and the Hugging Face Trainer."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import sys
import tempfile
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import flop_counter

from ..accelerator import Accelerator
from ..trainer.outputs import call_model
from .config import BenchConfig, _Job, _loss_of
from .measure import _CPU_SDPA_FLOPS, _Clock


# -- one contestant: a training loop we can run a chunk of steps at a time ----------------------
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
            loss = _loss_of(call_model(self.model, batch, self.model))
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
