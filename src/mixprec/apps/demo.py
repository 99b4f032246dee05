"""The demo's training: the built-in pycode GPT trained by the Trainer in one precision, in a
fresh process, timed on a clock that leaves out evaluations and checkpoints (``mixprec demo`` is
its face, :mod:`mixprec.cli.demo`)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["StepTimer", "demo_task", "train_in_fresh_process", "train_run"]


class StepTimer:
    """Times optimizer steps on a clock that leaves out evaluations and checkpoints, so that the
    seconds are training's own: ``intervals`` (step end to step end) for the throughput, and
    ``seconds`` (step -> training seconds when it ended) for the loss-against-time plot."""

    def __new__(cls):
        from mixprec.trainer import TrainerCallback

        class Timer(TrainerCallback):
            def __init__(self):
                self.intervals, self.seconds, self._clock = [], {}, 0.0
                self._last = self._begin = None
                self._paused = False

            def on_train_begin(self, args, state, control, **kwargs):
                self._last = time.perf_counter()

            def on_step_begin(self, args, state, control, **kwargs):
                self._begin = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                now = time.perf_counter()
                if self._paused:  # an evaluation or a save ran since the last step: count this step alone
                    self._clock += now - self._begin
                else:
                    self.intervals.append(now - self._last)
                    self._clock += now - self._last
                self.seconds[state.global_step] = self._clock
                self._last, self._paused = now, False

            def on_evaluate(self, args, state, control, **kwargs):
                self._paused = True

            def on_save(self, args, state, control, **kwargs):
                self._paused = True

        return Timer()


def demo_task(size: str, train_bytes: int | None, eval_bytes: int | None) -> Any:
    """The pycode task of ``size``, its training and evaluation text cut to the bytes given."""
    from mixprec.tasks import get_task

    options = {k: v for k, v in (("max_bytes", train_bytes), ("eval_max_bytes", eval_bytes)) if v}
    return get_task("pycode", size, **options)


def train_run(size: str, data: tuple[int | None, int | None], precision: str, steps: int, out: str, batch_size: int,
           progress: bool) -> dict[str, Any]:
    """One training run of the demo's GPT on pycode in ``precision``, meant to run in a fresh
    process so its peak memory is its own; returns its throughput, memory, losses and curves."""
    import resource
    import statistics
    import warnings

    from mixprec.precision import PrecisionPerformanceWarning

    warnings.simplefilter("ignore", PrecisionPerformanceWarning)  # the parent process said it once already
    from mixprec.trainer import PrinterCallback, Trainer, TrainingArguments
    from mixprec.trainer.checkpoints import list_checkpoints

    task = demo_task(size, *data)
    targs = TrainingArguments(
        output_dir=out, precision=precision, max_steps=steps, per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=32, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=min(50, steps // 10),
        weight_decay=0.1, optim="adamw_torch_fused", eval_strategy="steps", eval_steps=max(1, steps // 4),
        save_strategy="steps", save_steps=steps, logging_steps=max(1, steps // 50), seed=0, disable_tqdm=not progress)
    torch.manual_seed(0)
    timer = StepTimer()
    trainer = Trainer(model=task.build_model(), args=targs, train_dataset=task.train_dataset,
                      eval_dataset=task.eval_dataset, data_collator=task.collate_fn, compute_metrics=task.compute_metrics,
                      preprocess_logits_for_metrics=task.preprocess_logits_for_metrics, callbacks=[timer])
    if not progress:
        trainer.remove_callback(PrinterCallback)  # the demo's own lines say what a log would
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
    step_s = statistics.median(timer.intervals) if timer.intervals else float("nan")
    return {
        "precision": trainer.accelerator.policy.name,
        "steps": result.global_step,
        "median_step_seconds": step_s,
        "tokens_per_second": batch_size * task.train_dataset.block_size / step_s,
        "peak_memory_mb": peak / 2**20,
        "memory_kind": kind,
        "final_eval_loss": final_eval["eval_loss"],
        "final_bits_per_byte": final_eval.get("eval_bits_per_byte", final_eval["eval_loss"] / math.log(2)),
        "training_seconds": timer.seconds.get(result.global_step, float("nan")),
        "train": [(h["step"], h["loss"]) for h in hist if "loss" in h],
        "eval": [(h["step"], h["eval_loss"]) for h in hist if "eval_loss" in h],
        "seconds": timer.seconds,
        "scale_history": [(i + 1, s, k) for i, (s, k) in enumerate(scaler.scale_history)] if scaler else None,
        "skipped_steps": scaler.skipped_steps if scaler else 0,
        "checkpoint": str(list_checkpoints(Path(out))[-1]),
    }


def train_in_fresh_process(*args: Any) -> dict[str, Any]:
    """:func:`train_run` in a freshly spawned process (its peak memory is the run's own)."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(train_run, *args).result()
