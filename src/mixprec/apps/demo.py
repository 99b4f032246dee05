"""The demo's training: the built-in pycode GPT trained by the Trainer in one precision, in a
fresh process, for a number of seconds of training (or of steps), timed on a clock that leaves
out evaluations and checkpoints (``mixprec demo`` is its face, :mod:`mixprec.cli.demo`).

A run on a time budget is as fair as one on a step budget: its learning rate follows a cosine
over the *seconds* spent (after a short warm-up in steps), so a faster precision takes more
steps down the same curve, and the run ends, evaluated and saved, when its seconds are spent.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from mixprec.trainer import Trainer, TrainerCallback

__all__ = ["EVAL_BLOCKS", "TrainingClock", "demo_task", "held_out_line", "next_byte_accuracy", "predicted_line",
           "time_cosine_schedule", "train_in_fresh_process", "train_run"]

#: Validation blocks every run of the demo is evaluated on: the same fixed slice for each, small
#: enough that an evaluation costs a second, not the minute the whole validation split took.
EVAL_BLOCKS = 96
#: Optimizer steps of linear learning-rate warm-up, before the schedule follows the clock.
WARMUP_STEPS = 30


class TrainingClock(TrainerCallback):
    """Times optimizer steps on a clock that leaves out evaluations and checkpoints, so that the
    seconds are training's own: ``intervals`` (step end to step end) for the throughput, and
    ``seconds`` (step -> training seconds when it ended) for the loss-against-time plot.

    Args:
        budget: training seconds after which the run stops, with an evaluation and a checkpoint
            as at its last step (``None``: the Trainer's ``max_steps`` ends it).
        label: shown before the progress line.
        progress: write a progress line (seconds spent of the budget, steps, last loss) to
            stderr every ``every`` seconds.
    """

    def __init__(self, budget: float | None = None, label: str = "train", progress: bool = False,
                 every: float = 10.0) -> None:
        self.budget, self.label, self.progress, self.every = budget, label, progress, every
        self.intervals: list[float] = []
        self.seconds: dict[int, float] = {}
        self.clock = 0.0  # training seconds so far
        self._last = self._begin = None
        self._paused = False
        self._shown = -math.inf
        self._loss: float | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._last = time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        self._begin = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        if self._paused:  # an evaluation or a save ran since the last step: count this step alone
            self.clock += now - self._begin
        else:
            self.intervals.append(now - self._last)
            self.clock += now - self._last
        self.seconds[state.global_step] = self.clock
        self._last, self._paused = now, False
        spent = self.budget is not None and self.clock >= self.budget
        if spent:  # stop as the last step would: evaluated and saved
            control.should_training_stop = control.should_evaluate = control.should_save = True
        last = spent or state.global_step >= state.max_steps
        if self.progress and (last or self.clock - self._shown >= self.every):
            self._shown = self.clock
            of = f"{self.clock:.0f}/{self.budget:.0f} s" if self.budget is not None else f"{self.clock:.0f} s"
            loss = f", loss {self._loss:.3f}" if self._loss is not None else ""
            print(f"{self.label}: {of}, {state.global_step} steps{loss}", file=sys.stderr, flush=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self._loss = logs["loss"]

    def on_evaluate(self, args, state, control, **kwargs):
        self._paused = True

    def on_save(self, args, state, control, **kwargs):
        self._paused = True


def time_cosine_schedule(optimizer: torch.optim.Optimizer, clock: TrainingClock, warmup_steps: int = WARMUP_STEPS
                         ) -> torch.optim.lr_scheduler.LambdaLR:
    """transformers' cosine schedule with linear warm-up, over ``clock``'s seconds instead of
    steps: after ``warmup_steps`` the rate is ``0.5 * (1 + cos(pi * seconds / budget))`` of the
    peak, reaching 0 as the budget is spent, whatever the number of steps that takes."""
    def factor(step: int) -> float:
        warm = min(1.0, (step + 1) / warmup_steps)
        spent = min(1.0, clock.clock / clock.budget) if clock.budget else 0.0
        return warm * 0.5 * (1.0 + math.cos(math.pi * spent))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class _TimedTrainer(Trainer):
    """The Trainer, with the learning rate on :func:`time_cosine_schedule` of its clock."""

    def __init__(self, *args: Any, clock: TrainingClock, **kwargs: Any) -> None:
        self.clock = clock
        super().__init__(*args, **kwargs)

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        if self.lr_scheduler is None:
            self.lr_scheduler = time_cosine_schedule(optimizer or self.optimizer, self.clock)
        return self.lr_scheduler


def demo_task(size: str, train_bytes: int | None, eval_bytes: int | None) -> Any:
    """The pycode task of ``size``, its training and evaluation text cut to the bytes given."""
    from mixprec.tasks import get_task

    options = {k: v for k, v in (("max_bytes", train_bytes), ("eval_max_bytes", eval_bytes)) if v}
    return get_task("pycode", size, **options)


def train_run(size: str, data: tuple[int | None, int | None], precision: str, budget: float | int, out: str,
              batch_size: int, progress: bool, label: str = "train") -> dict[str, Any]:
    """One training run of the demo's GPT on pycode in ``precision``, meant to run in a fresh
    process so its peak memory is its own; returns its throughput, memory, losses and curves.

    ``budget``: a float is seconds of training (the learning rate follows them); an int is a
    number of optimizer steps (transformers' cosine schedule over them)."""
    import resource
    import statistics
    import warnings

    from mixprec.precision import PrecisionPerformanceWarning
    from mixprec.trainer import PrinterCallback, ProgressCallback, TrainingArguments
    from mixprec.trainer.checkpoints import list_checkpoints

    warnings.simplefilter("ignore", PrecisionPerformanceWarning)  # the parent process said it once already
    task = demo_task(size, *data)
    timed = isinstance(budget, float)
    clock = TrainingClock(budget if timed else None, label=label, progress=progress)
    eval_slice = torch.utils.data.Subset(task.eval_dataset, range(min(EVAL_BLOCKS, len(task.eval_dataset))))
    steps = 10**7 if timed else budget  # a timed run ends by its clock
    targs = TrainingArguments(
        output_dir=out, precision=precision, max_steps=steps, per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=32, learning_rate=3e-3, lr_scheduler_type="cosine",
        warmup_steps=min(WARMUP_STEPS, steps // 10), weight_decay=0.1, optim="adamw_torch_fused",
        eval_strategy="no" if timed else "steps", eval_steps=max(1, steps // 4), save_strategy="steps",
        save_steps=steps, logging_steps=10 if timed else max(1, steps // 50), seed=0, disable_tqdm=True,
        # The gradient statistics the doctor reads (fp16 flush fractions), a few times a run:
        # where a loss scaler runs, they say what it saved.
        diagnostics_steps=50 if timed else max(1, steps // 8))
    torch.manual_seed(0)
    cls, more = (_TimedTrainer, {"clock": clock}) if timed else (Trainer, {})
    trainer = cls(model=task.build_model(), args=targs, train_dataset=task.train_dataset, eval_dataset=eval_slice,
                  data_collator=task.collate_fn, compute_metrics=task.compute_metrics,
                  preprocess_logits_for_metrics=task.preprocess_logits_for_metrics, callbacks=[clock], **more)
    trainer.remove_callback(PrinterCallback)  # the clock's lines say what a log would
    trainer.remove_callback(ProgressCallback)
    device = trainer.accelerator.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    result = trainer.train()
    if device.type == "cuda":
        peak, kind = torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    else:
        peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak RSS of the run's own process"
    hist = trainer.state.log_history
    scaler = trainer.accelerator.scaler
    final_eval = [h for h in hist if "eval_loss" in h][-1]
    step_s = statistics.median(clock.intervals) if clock.intervals else float("nan")
    flush = [h for h in hist if "grad_fp16_flush" in h]
    return {
        "precision": trainer.accelerator.policy.name,
        "steps": result.global_step,
        "median_step_seconds": step_s,
        "tokens_per_second": batch_size * task.train_dataset.block_size / step_s,
        "peak_memory_mb": peak / 2**20,
        "memory_kind": kind,
        "final_eval_loss": final_eval["eval_loss"],
        "final_bits_per_byte": final_eval.get("eval_bits_per_byte", final_eval["eval_loss"] / math.log(2)),
        "training_seconds": clock.seconds.get(result.global_step, float("nan")),
        "train": [(h["step"], h["loss"]) for h in hist if "loss" in h],
        "eval": [(h["step"], h["eval_loss"]) for h in hist if "eval_loss" in h],
        "seconds": clock.seconds,
        "scale_history": [(i + 1, s, k) for i, (s, k) in enumerate(scaler.scale_history)] if scaler else None,
        "skipped_steps": scaler.skipped_steps if scaler else 0,
        # The worst layer's fraction of gradient values fp16 flushes to zero: without the scale, and at it.
        "flush": [(h["step"], h["grad_fp16_flush"], h["grad_fp16_flush_at_scale"], h["grad_fp16_flush_worst_module"])
                  for h in flush],
        "checkpoint": str(list_checkpoints(Path(out))[-1]),
    }


@torch.no_grad()
def next_byte_accuracy(model: torch.nn.Module, blocks: Any) -> float:
    """The fraction of bytes of ``blocks`` (a dataset of ``{"input_ids"}`` rows) whose most likely
    next byte, by ``model`` given the bytes before it, is the one the text has."""
    model.eval()
    right = total = 0
    for i in range(0, len(blocks), 32):
        ids = torch.stack([blocks[j]["input_ids"] for j in range(i, min(i + 32, len(blocks)))])
        ids = ids.to(next(model.parameters()).device)
        guess = model(ids).logits[:, :-1].argmax(-1)
        right += int((guess == ids[:, 1:]).sum())
        total += guess.numel()
    return right / max(total, 1)


@torch.no_grad()
def predicted_line(model: torch.nn.Module, text: bytes, line: bytes) -> str:
    """``line`` (which ends ``text``) as ``model`` predicts it byte by byte, each byte guessed
    from the real bytes before it (the context: ``text``'s last ``block_size``): what it has
    learned of the code, shown on code it never trained on."""
    model.eval()
    ids = torch.tensor([list(text[-model.config.block_size:])], device=next(model.parameters()).device)
    guess = model(ids).logits[0, :-1].argmax(-1).tolist()[-len(line):]
    return bytes(b if 32 <= b < 127 else 63 for b in guess).decode("ascii")  # "?" for the unprintable


def held_out_line(data: torch.Tensor, context: int, lo: int = 36, hi: int = 60) -> tuple[bytes, bytes]:
    """A line of the validation text to show the model's predictions on: the first one of
    ``lo``..``hi`` printable bytes that calls or assigns something on ``self``, with the
    ``context`` bytes that end with it."""
    raw = bytes(data.tolist())
    at = 0
    for line in raw.split(b"\n"):
        start = raw.index(line, at)
        at = start + len(line)
        if lo <= len(line) <= hi and b"self." in line and all(32 <= b < 127 for b in line) and start >= context:
            return raw[at - context:at], line
    return raw[:context], raw[max(0, context - hi):context]


def train_in_fresh_process(*args: Any) -> dict[str, Any]:
    """:func:`train_run` in a freshly spawned process (its peak memory is the run's own)."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(train_run, *args).result()
