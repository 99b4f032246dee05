"""The rivals in ``mixprec bench --compare``: the loop a user writes with torch alone, Hugging Face
Accelerate's ``Accelerator`` and the Hugging Face Trainer, each on the same job (init, data order,
fused AdamW) as mixprec's contestants; and the registry of ``--compare`` names."""

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

from mixprec.apps.bench.config import BenchConfig, Job
from mixprec.apps.bench.runners import (
    COUNTING_STEPS,
    LoopRunner,
    MixprecTrainerRunner,
    StepChunks,
    adamw,
    describe_optimizer,
    steps_to_train,
)
from mixprec.data import send_to_device
from mixprec.models import call_model, loss_of
from mixprec.precision import accelerate_name, policy_for, trainer_flags

__all__ = ["TorchLoopRunner", "HFTrainerRunner", "accelerate_runner", "compare_precision", "hf_missing",
           "reset_hf_state", "RIVALS", "RIVAL_FACTORIES"]

_HF_PRECISIONS = ("bf16-mixed", "fp16-mixed", "fp32")  # what Hugging Face offers too, by preference


class TorchLoopRunner(LoopRunner):
    """The loop a user writes with torch alone: ``torch.autocast`` (plus ``torch.amp.GradScaler``
    for fp16), or for bf16-true the model cast to bf16 and torch's AdamW, uncompensated."""

    def __init__(self, job: Job, precision: str, config: BenchConfig, device: torch.device,
                 notes: list[str]) -> None:
        torch.manual_seed(config.seed)
        # What the policy says, written out as a torch user would: no mixprec plugin here.
        policy = policy_for(precision)
        model = job.build_model().to(device=device, dtype=policy.param_dtype)
        opt = adamw(list(model.parameters()), config.lr)
        super().__init__(None, torch.compile(model) if config.compile else model, opt, job.train_loader(config),
                         device)
        self._dtype = policy.compute_dtype if policy.autocast_enabled else None
        self.scaler = torch.amp.GradScaler(device.type) if policy.needs_loss_scaler else None
        self.input_dtype = policy.param_dtype if policy.param_dtype != torch.float32 else None
        self.optimizer = describe_optimizer(opt)

    def step(self, flops: flop_counter.FlopCounterMode | None = None) -> torch.Tensor:
        batch = send_to_device(self.next_batch(), self.device, float_dtype=self.input_dtype)
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


def compare_precision(precisions: tuple[str, ...], name: str = "hf") -> str:
    """The precision contestant ``name`` runs at: bf16-mixed where benchmarked (Hugging Face's
    ``bf16=True``), else the first benchmarked one it offers too (bf16-true last, and only for the
    torch loop and mixprec's Trainer: Hugging Face has none); bf16-mixed when none is."""
    offered = _HF_PRECISIONS + (("bf16-true",) if name in ("torch", "trainer") else ())
    return next((p for p in offered if p in precisions), "bf16-mixed")


def hf_missing(name: str) -> str:
    """Why contestant ``name`` cannot run here (the Hugging Face packages it needs), or ``""``."""
    if name not in ("hf", "accelerate"):
        return ""
    needed = ("transformers", "accelerate") if name == "hf" else ("accelerate",)
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    return f"{' and '.join(missing)} not installed (pip install {' '.join(missing)})" if missing else ""


def accelerate_runner(job: Job, precision: str, config: BenchConfig, device: torch.device,
                      notes: list[str]) -> LoopRunner:
    """The user's loop through Hugging Face Accelerate's ``Accelerator`` (its API is mixprec's)."""
    import accelerate

    acc = accelerate.Accelerator(mixed_precision=accelerate_name(precision), cpu=device.type == "cpu",
                                 dynamo_backend="inductor" if config.compile else None)
    if not getattr(acc, "native_amp", True) and policy_for(precision).autocast_enabled:
        notes.append(f"Hugging Face Accelerate runs {precision} on {device.type} as fp32 (no autocast, no scaler)")
    torch.manual_seed(config.seed)
    model = job.build_model().to(device)
    opt = adamw(list(model.parameters()), config.lr)
    model, opt, dl = acc.prepare(model, opt, job.train_loader(config))
    runner = LoopRunner(acc, model, opt, dl, device)
    runner.optimizer = describe_optimizer(opt.optimizer)
    return runner


class HFTrainerRunner:
    """The Hugging Face Trainer as a contestant. Its loader cannot continue mid-epoch in a second
    ``train()``, so it drives: its :class:`StepChunks` callback runs the other contestants' round
    after each of its chunks of steps. (Not a thread: on the CPU a second thread running torch
    gets its own OpenMP team, and from then on every step in the process, ours too, ran 2-3x
    slower in our measurements.)"""

    def __init__(self, job: Job, precision: str, config: BenchConfig, device: torch.device,
                 notes: list[str]) -> None:
        import transformers

        self.device, self.times, self.losses = device, [], []
        self.optimizer = "optim='adamw_torch_fused'"
        torch.manual_seed(config.seed)
        self.model = job.build_model()
        if dataclasses.is_dataclass(getattr(self.model, "config", None)):
            # The Trainer writes model.config attributes; give it a mutable copy of a frozen config.
            self.model.config = types.SimpleNamespace(**dataclasses.asdict(self.model.config))
        self.model.register_forward_hook(self._record_loss)
        self._dir = tempfile.TemporaryDirectory(prefix="mixprec-bench-hf-")
        args = transformers.TrainingArguments(
            output_dir=self._dir.name, **trainer_flags(precision),
            use_cpu=device.type == "cpu", optim="adamw_torch_fused", learning_rate=config.lr, weight_decay=0.0,
            lr_scheduler_type="constant", max_grad_norm=0.0, per_device_train_batch_size=config.batch_size,
            max_steps=steps_to_train(config), logging_strategy="no", save_strategy="no", report_to="none",
            disable_tqdm=True, remove_unused_columns=False, seed=config.seed, torch_compile=config.compile)
        loader = job.train_loader(config)

        class Trainer(transformers.Trainer):
            # The documented override. Unprepared, so that Accelerate's seedable sampler keeps the
            # others' data order; one process needs no sharding, and the Trainer moves each batch.
            def get_train_dataloader(self) -> Any:
                return loader

        class Chunks(StepChunks, transformers.TrainerCallback):
            pass

        self.chunks = Chunks(device, self.times)
        self.trainer = Trainer(model=self.model, args=args, train_dataset=job.train, data_collator=job.collate_fn,
                               callbacks=[self.chunks])
        self.trainer.remove_callback(transformers.PrinterCallback)  # it prints the final metrics
        if not getattr(self.trainer.accelerator, "native_amp", True) and policy_for(precision).autocast_enabled:
            notes.append(f"the Hugging Face Trainer runs {precision} on {device.type} as fp32 (no autocast, no scaler)")

    def _record_loss(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if module.training:
            self.losses.append(loss_of(output).detach())

    def train(self, config: BenchConfig, play_round: Callable[[int], None]) -> None:
        """Train the warm-up and every round's chunk, calling ``play_round(r)`` after chunk ``r``."""
        def warmed_up(control: Any) -> None:
            self.times.clear()
            self.losses.clear()

        self.chunks.plan = [(COUNTING_STEPS + config.warmup, warmed_up)] + [
            (config.steps, lambda control, r=r: play_round(r)) for r in range(config.rounds)]
        self.trainer.train()

    def finish(self) -> None:
        """Remove its output folder."""
        self._dir.cleanup()


# Each --compare name: its row's label, and what builds it (job, precision, config, device, notes).
RIVALS = {"torch": "torch-loop", "trainer": "mixprec-trainer", "hf": "hf-trainer", "accelerate": "accelerate"}
RIVAL_FACTORIES: dict[str, Callable[..., Any]] = {
    "torch": TorchLoopRunner, "trainer": MixprecTrainerRunner, "hf": HFTrainerRunner, "accelerate": accelerate_runner}


def reset_hf_state() -> None:
    """Clear Accelerate's process-wide state ("Borg"), so that a later run may differ."""
    state = sys.modules.get("accelerate.state")
    for cls, args in (("AcceleratorState", (True,)), ("GradientState", ())):
        reset = getattr(getattr(state, cls, None), "_reset_state", None)
        if reset is not None:
            reset(*args)
