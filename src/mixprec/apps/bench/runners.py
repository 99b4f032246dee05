"""mixprec's contestants in ``mixprec bench``: the training loop through :class:`~mixprec.Accelerator`,
and mixprec's :class:`~mixprec.Trainer` driven through its callbacks; and what every contestant
shares (:class:`Runner`, the Trainers' :class:`StepChunks` callback). The rivals (the hand-written
torch loop, Hugging Face Accelerate and the Hugging Face Trainer) are in :mod:`.rivals`."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import flop_counter

from mixprec.accelerator.accelerator import Accelerator
from mixprec.apps.bench.config import BenchConfig, Job
from mixprec.apps.bench.measure import CPU_SDPA_FLOPS, Clock
from mixprec.diagnostics.syncs import count_host_syncs, host_side_tensors
from mixprec.models import call_model, loss_of
from mixprec.trainer import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

__all__ = ["Runner", "LoopRunner", "MixprecTrainerRunner", "StepChunks", "StepWindow", "mixprec_runner",
           "adamw", "describe_optimizer", "steps_to_train", "COUNTING_STEPS"]

# Untimed steps besides the warm-up: one counts the FLOPs, one the host syncs (the Hugging Face
# Trainer, which cannot be stepped alone, trains as many before its rounds: the same batches).
COUNTING_STEPS = 2


def steps_to_train(config: BenchConfig) -> int:
    """Every contestant's steps: the counting ones, the warm-up, the rounds."""
    return COUNTING_STEPS + config.warmup + config.rounds * config.steps


# -- one contestant: a training loop we can run a chunk of steps at a time ----------------------
class Runner:
    """A contestant that trains a chunk of steps at a time; ``step()`` is one optimizer step.

    ``times`` gets each timed step's seconds and ``losses`` each step's detached loss (the bench
    clears both after the warm-up); ``optimizer`` says what kind, for the report.
    """

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
        """Train ``n`` steps, timing each (its batch's fetch included)."""
        clock = Clock(self.device)
        clock.mark()
        for _ in range(n):
            self.losses.append(self.step())
            clock.mark()
        self.times += clock.intervals()

    def prepared_optimizer(self) -> Any:
        """The optimizer ``step()`` steps (its host-side step counters are not device reads)."""
        raise NotImplementedError

    def count_syncs(self) -> int:
        """Host-device syncs in one training step (a real step, untimed), as
        :func:`~mixprec.diagnostics.count_host_syncs` counts them; the optimizer's host-side step
        counters are not device reads."""
        with self._uncompiled(), count_host_syncs(self.device,
                                                  ignore=host_side_tensors(self.prepared_optimizer())) as syncs:
            self.step()
        return syncs.count

    def count_flops(self) -> int:
        """One training step with its forward and backward FLOPs counted (a real step, untimed)."""
        counter = flop_counter.FlopCounterMode(display=False, custom_mapping=CPU_SDPA_FLOPS)
        with self._uncompiled():
            self.step(counter)
        return int(counter.get_total_flops())

    @contextlib.contextmanager
    def _uncompiled(self) -> Iterator[None]:
        """The counted steps run the compiled model's own module: after a compiled fp8 model was
        called under a counter (a dispatch mode), dynamo compiled its float8 tensors'
        ``__torch_dispatch__`` op by op at every later step (CPU: 3 steps took 4.9 s, not 0.07 s)."""
        compiled = self.model
        self.model = getattr(compiled, "_orig_mod", compiled)
        try:
            yield
        finally:
            self.model = compiled

    def finish(self) -> None:
        """Release what the contestant holds (temporary folders)."""


class LoopRunner(Runner):
    """The user's loop through an Accelerator (ours, or Hugging Face's: the API is the same)."""

    def __init__(self, acc: Any, model: torch.nn.Module, opt: Any, dl: Any, device: torch.device) -> None:
        super().__init__(model, device)
        self.acc, self.opt, self.dl = acc, opt, dl
        self._it = iter(dl)

    def prepared_optimizer(self) -> Any:
        return self.opt

    def next_batch(self) -> Any:
        """The loader's next batch; a new epoch after its last."""
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.dl)
            return next(self._it)

    def step(self, flops: flop_counter.FlopCounterMode | None = None) -> torch.Tensor:
        batch = self.next_batch()
        with flops if flops is not None else contextlib.nullcontext():
            loss = loss_of(call_model(self.model, batch, self.model))
            self.acc.backward(loss)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def adamw(params: Any, lr: float) -> torch.optim.Optimizer:
    """Every contestant's optimizer: fused AdamW (foreach where fused is not offered), no weight decay."""
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    except (RuntimeError, ValueError, TypeError):  # a device or dtype fused AdamW does not take
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=True)


def mixprec_runner(job: Job, precision: str, config: BenchConfig, device: torch.device,
                   compensation: str | None = None) -> LoopRunner:
    """The Accelerator's loop; ``compensation`` picks bf16-true's update (default: the config's first)."""
    acc = Accelerator(mixed_precision=precision, cpu=device.type == "cpu", compile=config.compile,
                      bf16_true_compensation=compensation or config.bf16_true_compensation[0],
                      bf16_true_state_dtype=config.bf16_true_state_dtype)
    torch.manual_seed(config.seed)
    model = acc.prepare_model(job.build_model())
    # Built after prepare_model, so it sees the parameters in their final dtype (bf16-true).
    opt = adamw(list(model.parameters()), config.lr)
    prepared = acc.prepare_optimizer(opt)
    runner = LoopRunner(acc, model, prepared, acc.prepare_data_loader(job.train_loader(config)), device)
    runner.optimizer = describe_optimizer(prepared.optimizer)  # bf16-true swaps in its compensated twin
    return runner


def describe_optimizer(opt: torch.optim.Optimizer) -> str:
    """The optimizer's class and how it steps, e.g. ``"torch.optim.AdamW (fused)"``."""
    kind = type(opt)
    how = [k for k in ("fused", "foreach") if opt.defaults.get(k)] + (
        [f"{opt.defaults['compensation']} compensation"] if "compensation" in opt.defaults else []) + (
        ["bf16 moments"] if opt.defaults.get("state_dtype") == torch.bfloat16 else [])
    return f"{kind.__module__.replace('torch.optim.adamw', 'torch.optim')}.{kind.__name__}" + (
        f" ({', '.join(how)})" if how else "")


# -- a Trainer as a contestant, through its callbacks -------------------------------------------
class StepChunks:
    """Callback events that time a Trainer's steps and end each planned chunk of them.

    Mixed into each Trainer's own callback class (mixprec's and Hugging Face's have the same
    events). The clock starts at ``on_train_begin`` and marks every ``on_step_end``, so a step's
    time includes its batch's fetch, as a loop's does; a chunk's times go to ``times``. After a
    chunk's last step, its ``then(control)`` runs: the other contestants' round (the Trainer
    drives), or ``control.should_training_stop = True`` (the Trainer pauses).

    Args:
        device: where the steps run (CUDA steps are timed with events).
        times: the list each chunk's step times are appended to.
    """

    def __init__(self, device: torch.device, times: list[float]) -> None:
        self.device, self.times = device, times
        self.plan: list[tuple[int, Callable[[Any], None]]] = []  # (steps, then(control)) per chunk
        self._begin_chunk()

    def _begin_chunk(self) -> None:
        self._left = self.plan[0][0] if self.plan else -1
        self._clock = Clock(self.device)
        self._clock.mark()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._begin_chunk()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._clock.mark()
        self._left -= 1
        if self._left == 0:
            self.times += self._clock.intervals()
            _, then = self.plan.pop(0)
            # Called bare: an autocast region around it, even a disabled one, would keep the
            # others' cached bf16 copies of their weights alive across their optimizer steps.
            then(control)
            self._begin_chunk()


def stop_training(control: Any) -> None:
    """A chunk's end that pauses the Trainer: its ``train()`` returns after this step."""
    control.should_training_stop = True


class StepWindow(TrainerCallback):
    """Runs the Trainer's next step, from ``on_step_begin`` to ``on_step_end``, inside the context
    manager ``open(optimizer)`` returns (set ``open`` before the step); ``entered`` is what its
    ``__enter__`` gave. Used once per ``open``."""

    def __init__(self) -> None:
        self.open: Callable[[Any], Any] | None = None
        self.entered: Any = None
        self._stack = contextlib.ExitStack()

    def on_step_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if self.open is not None:
            opener, self.open = self.open, None
            self.entered = self._stack.enter_context(opener(optimizer))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Leave the context manager, if the step that entered it did not (it raised)."""
        self._stack.close()


class MixprecTrainerRunner(Runner):
    """mixprec's :class:`~mixprec.Trainer` as a contestant, through its public parts.

    Each chunk of steps is one ``train()`` that a callback stops after the chunk; the next
    ``train()`` goes on with the same model, optimizer and loss scale (the Trainer keeps them) and
    the same prepared loader, rewound to where it stood (``state_dict``/``load_state_dict``: the
    epoch's shuffle order, from its next unseen batch), so the Trainer trains exactly the batches
    the other contestants do, and its steps are timed by :class:`StepChunks`.
    """

    def __init__(self, job: Job, precision: str, config: BenchConfig, device: torch.device,
                 notes: list[str]) -> None:
        super().__init__(None, device)
        self._dir = tempfile.TemporaryDirectory(prefix="mixprec-bench-trainer-")
        args = TrainingArguments(
            output_dir=self._dir.name, precision=precision, use_cpu=device.type == "cpu",
            optim="adamw_torch_fused", learning_rate=config.lr, weight_decay=0.0, lr_scheduler_type="constant",
            max_grad_norm=0.0, per_device_train_batch_size=config.batch_size, max_steps=steps_to_train(config),
            logging_steps=10**9, save_strategy="no", report_to="none", disable_tqdm=True,
            remove_unused_columns=False, seed=config.seed, torch_compile=config.compile,
            # The bench's loader carries its own generator: drawn on as the loop's Accelerator draws
            # it, not reseeded with seed + epoch as transformers' default seedable sampler would.
            accelerator_config={"use_seedable_sampler": False},
            bf16_true_compensation=config.bf16_true_compensation[0], bf16_true_state_dtype=config.bf16_true_state_dtype)
        runner, loaders = self, []

        class BenchTrainer(Trainer):
            # The bench's loader: the Trainer's own draws the same order (seeded alike) but keeps
            # a last partial batch; this way every contestant trains exactly the same batches.
            def get_train_dataloader(self) -> Any:
                if not loaders:
                    loaders.append(self.accelerator.prepare_data_loader(job.train_loader(config)))
                else:  # a later chunk: on at the next batch (the loop left the epoch mid-way)
                    loaders[0].load_state_dict(loaders[0].state_dict())
                return loaders[0]

            def training_step(self, model: torch.nn.Module, inputs: Any) -> torch.Tensor:
                loss = super().training_step(model, inputs)
                runner.losses.append(loss)
                return loss

        class Chunks(StepChunks, TrainerCallback):
            pass

        self.chunks, self.window = Chunks(device, self.times), StepWindow()
        torch.manual_seed(config.seed)
        self.trainer = BenchTrainer(model=job.build_model(), args=args, train_dataset=job.train,
                                    data_collator=job.collate_fn, callbacks=[self.chunks, self.window])
        self.trainer.remove_callback(PrinterCallback)  # the bench prints its own table
        self.model = self.trainer.model_wrapped

    def run_chunk(self, n: int) -> None:
        """Train ``n`` steps: one ``train()``, stopped by :class:`StepChunks` after them."""
        if n == 0:
            return
        self.chunks.plan.append((n, stop_training))
        try:
            self.trainer.train()
        finally:
            self.window.close()
        if self.chunks.plan:  # train() ended first: the epochs that max_steps makes room for are done
            self.chunks.plan.clear()
            raise RuntimeError(f"the Trainer stopped before the chunk's end: it trains at most the "
                               f"epochs of its max_steps={self.trainer.args.max_steps}")
        if not self.optimizer:  # the Trainer makes it when its first train() starts
            self.optimizer = describe_optimizer(self.trainer.optimizer.optimizer)

    def step(self, flops: flop_counter.FlopCounterMode | None = None) -> torch.Tensor:
        """One real step (a ``train()`` of one), its forward, backward and optimizer step under ``flops``."""
        if flops is not None:
            self.window.open = lambda optimizer: flops
        self.run_chunk(1)
        return self.losses[-1]

    def count_syncs(self) -> int:
        """Host-device syncs in one Trainer step, from ``on_step_begin`` to ``on_step_end``."""
        self.window.open = lambda optimizer: count_host_syncs(self.device, ignore=host_side_tensors(optimizer))
        self.run_chunk(1)
        return self.window.entered.count

    def prepared_optimizer(self) -> Any:
        return self.trainer.optimizer

    def finish(self) -> None:
        self._dir.cleanup()
