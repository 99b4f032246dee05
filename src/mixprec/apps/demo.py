"""The demo's training: the built-in pycode GPT trained by the Trainer in one precision, in a
fresh process, for a number of seconds of training (or of steps), timed on a clock that leaves
out evaluations and checkpoints (``mixprec demo`` is its face, :mod:`mixprec.cli.demo`).

A run on a time budget is as fair as one on a step budget: its learning rate follows a cosine
over the *seconds* spent (after a short warm-up in steps), so a faster precision takes more
steps down the same curve, and the run ends, evaluated and saved, when its seconds are spent.

The underflow lesson's runs take their loss as a large optimizer step does (``step_tokens``):
averaged over that many tokens, so that each token's gradient is as small as it is in such a
step, and they record their gradients against fp16's number line (:class:`GradientStats`).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mixprec.diagnostics import GradientStats
from mixprec.trainer import Trainer, TrainerCallback

__all__ = ["EVAL_BLOCKS", "DemoRun", "GradientRecorder", "TrainingClock", "demo_task", "gradient_summary",
           "held_out_line", "next_byte_accuracy", "predicted_line", "time_cosine_schedule", "train_in_fresh_process", "train_run"]

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
        self.excluded = 0.0  # seconds spent in this step that are not training's (a gradient record's)
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
            self.clock += now - self._begin - self.excluded
        else:
            self.intervals.append(now - self._last - self.excluded)
            self.clock += now - self._last - self.excluded
        self.excluded = 0.0
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


@dataclass(frozen=True, kw_only=True)
class DemoRun:
    """One training run of the demo.

    Args:
        name: what the demo calls it (``"fp32"``, ``"fp16-unscaled"``); also its progress label.
        precision: the Trainer's precision.
        size: the pycode model size.
        budget: a float is seconds of training (the learning rate follows them); an int is a
            number of optimizer steps (transformers' cosine schedule over them).
        out: its run folder.
        step_tokens: average each step's loss over this many tokens, as an optimizer step of that
            many tokens does (``None``: over the batch's own); the gradient-norm clip is scaled
            alike, so that fp32 clips the same steps.
        loss_scaler: :class:`~mixprec.LossScaler` arguments (``{"enabled": False}``: none).
        observe_every: record the gradients every this many steps (0: never).
        label: its progress lines' label (default: ``name``).
        lr_factors: the learning rate of each step, as a fraction of the peak: another run's
            (``train_run``'s ``"lr_factors"``), so that a run of its steps follows it exactly, as a
            run on a time budget's schedule cannot be computed ahead.

    Example:
        >>> DemoRun(name="fp32", precision="fp32", size="tiny", budget=10, out="runs/x").budget
        10
    """

    name: str
    precision: str
    size: str
    budget: float | int
    out: str
    step_tokens: int | None = None
    loss_scaler: dict[str, Any] | None = None
    observe_every: int = 0
    label: str = ""
    lr_factors: tuple[float, ...] | None = None


class GradientRecorder(TrainerCallback):
    """Records the gradients about to be applied (unscaled, clipped) against fp16's number line, as
    they are and at the loss scale in force (:class:`~mixprec.diagnostics.GradientStats`): what
    fp16 flushed, or would have. Every ``every`` optimizer steps for the first ten records, then
    every ``5 * every`` (a record costs about as much as an fp32 step of the demo's model); the
    seconds it takes are left out of ``clock``'s training time."""

    def __init__(self, model: torch.nn.Module, every: int, scaler: Any = None, clock: TrainingClock | None = None
                 ) -> None:
        self.stats = GradientStats(model, every_n_steps=1, scale_source=scaler, history=10_000)
        self.every, self.clock = every, clock

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        step = state.global_step + 1
        if step % self.every or (step > 10 * self.every and step % (5 * self.every)):
            return
        begin = time.perf_counter()
        # The Trainer clipped (so unscaled) the gradients just before: they carry no scale.
        self.stats.observe(step)
        if self.clock is not None:
            self.clock.excluded += time.perf_counter() - begin


def _step_cosine_schedule(optimizer: torch.optim.Optimizer, steps: int, warmup: int) -> torch.optim.lr_scheduler.LambdaLR:
    """transformers' ``get_cosine_schedule_with_warmup``, written out: the Trainer's ``"cosine"``
    imports transformers where it is installed, seconds in every fresh process of the demo."""
    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class _DemoTrainer(Trainer):
    """The Trainer, with the learning rate on :func:`time_cosine_schedule` of its clock (where the
    run has a time budget), and the loss for backward multiplied by ``loss_factor`` (its logged
    value left as the model computed it)."""

    def __init__(self, *args: Any, clock: TrainingClock | None = None, loss_factor: float = 1.0,
                 lr_factors: tuple[float, ...] | None = None, **kwargs: Any) -> None:
        self.clock, self.loss_factor, self.lr_factors = clock, loss_factor, lr_factors
        self.lrs_used: list[float] = []  # the learning rate of each step, as the optimizer had it
        super().__init__(*args, **kwargs)
        self.add_callback(_LearningRates(self))

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        if self.lr_scheduler is None:
            optimizer = optimizer or self.optimizer
            if self.lr_factors:
                factors = self.lr_factors
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: factors[min(s, len(factors) - 1)])
            elif self.clock is not None:
                self.lr_scheduler = time_cosine_schedule(optimizer, self.clock)
            else:
                self.lr_scheduler = _step_cosine_schedule(optimizer, num_training_steps, self.args.warmup_steps)
        return self.lr_scheduler

    def training_step(self, model: torch.nn.Module, inputs: Any) -> torch.Tensor:
        if self.loss_factor == 1.0:
            return super().training_step(model, inputs)
        if not model.training:
            model.train()
        loss = self.compute_loss(model, inputs)
        self.accelerator.backward(loss * self.loss_factor)
        return loss.detach().float()


class _LearningRates(TrainerCallback):
    """Records the learning rate each optimizer step uses (skipped steps included), into its
    trainer's ``lrs_used``."""

    def __init__(self, trainer: _DemoTrainer) -> None:
        self.trainer = trainer

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer.lrs_used.append(self.trainer.optimizer.param_groups[0]["lr"])


def demo_task(size: str, train_bytes: int | None, eval_bytes: int | None) -> Any:
    """The pycode task of ``size``, its training and evaluation text cut to the bytes given."""
    from mixprec.tasks import get_task

    options = {k: v for k, v in (("max_bytes", train_bytes), ("eval_max_bytes", eval_bytes)) if v}
    return get_task("pycode", size, **options)


def _adamw(model: torch.nn.Module, args: Any) -> torch.optim.Optimizer:
    """The Trainer's ``adamw_torch_fused`` with Hugging Face's two groups, which for this GPT are
    nanoGPT's: weight decay on the matrices and embeddings, none on biases and layer norms. (Built
    here because the Trainer reads that rule from transformers where it is installed, importing it:
    seconds in every fresh process of the demo.)"""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                             fused=True)


def train_run(run: DemoRun, data: tuple[int | None, int | None], batch_size: int, progress: bool) -> dict[str, Any]:
    """One training run of the demo's GPT on pycode (``run`` says which), meant to run in a fresh
    process so its peak memory is its own; returns its throughput, memory, losses, curves, loss
    scale and, where ``run.observe_every``, what its gradients were against fp16's range."""
    import resource
    import statistics
    import warnings

    from mixprec.precision import PrecisionPerformanceWarning
    from mixprec.trainer import PrinterCallback, ProgressCallback, TrainingArguments
    from mixprec.trainer.checkpoints import list_checkpoints

    warnings.simplefilter("ignore", PrecisionPerformanceWarning)  # the parent process said it once already
    task = demo_task(run.size, *data)
    timed = isinstance(run.budget, float)
    clock = TrainingClock(run.budget if timed else None, label=run.label or run.name, progress=progress)
    eval_slice = torch.utils.data.Subset(task.eval_dataset, range(min(EVAL_BLOCKS, len(task.eval_dataset))))
    steps = 10**7 if timed else run.budget  # a timed run ends by its clock
    tokens = batch_size * task.train_dataset.block_size
    factor = tokens / run.step_tokens if run.step_tokens else 1.0
    targs = TrainingArguments(
        output_dir=run.out, precision=run.precision, max_steps=steps, per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=32, learning_rate=3e-3, lr_scheduler_type="cosine",
        warmup_steps=min(WARMUP_STEPS, steps // 10), weight_decay=0.1, optim="adamw_torch_fused",
        eval_strategy="no" if timed else "steps", eval_steps=max(1, steps // 4), save_strategy="steps",
        save_steps=steps, logging_steps=10 if timed else max(1, min(10, steps // 10)), seed=0, disable_tqdm=True,
        max_grad_norm=1.0 * factor, loss_scaler=run.loss_scaler)
    torch.manual_seed(0)
    model = task.build_model()
    trainer = _DemoTrainer(model=model, args=targs, train_dataset=task.train_dataset, eval_dataset=eval_slice,
                           data_collator=task.collate_fn, compute_metrics=task.compute_metrics,
                           preprocess_logits_for_metrics=task.preprocess_logits_for_metrics, callbacks=[clock],
                           clock=clock if timed else None, loss_factor=factor, lr_factors=run.lr_factors,
                           optimizers=(_adamw(model, targs), None))
    trainer.remove_callback(PrinterCallback)  # the clock's lines say what a log would
    trainer.remove_callback(ProgressCallback)
    scaler = trainer.accelerator.scaler
    scaler = scaler if scaler is not None and scaler.is_enabled() else None
    recorder = GradientRecorder(model, run.observe_every, scaler, clock) if run.observe_every else None
    if run.loss_scaler is not None and run.loss_scaler.get("enabled") is False:  # on purpose: the demo says so
        logging.getLogger("mixprec.trainer").addFilter(lambda r: "precision in force" not in r.getMessage())
    if recorder is not None:
        trainer.add_callback(recorder)
    device = trainer.accelerator.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    result = trainer.train()
    if device.type == "cuda":
        peak, kind = torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    else:
        peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak RSS of the run's own process"
    hist = trainer.state.log_history
    final_eval = [h for h in hist if "eval_loss" in h][-1]
    step_s = statistics.median(clock.intervals) if clock.intervals else float("nan")
    return {
        "name": run.name,
        "precision": trainer.accelerator.policy.name,
        "size": run.size,
        "budget": run.budget,
        "step_tokens": run.step_tokens or tokens,
        "batch_tokens": tokens,
        "steps": result.global_step,
        "median_step_seconds": step_s,
        "tokens_per_second": tokens / step_s,
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
        "growth_interval": scaler.get_growth_interval() if scaler else None,
        "grads": gradient_summary(recorder.stats) if recorder is not None else None,
        "checkpoint": str(list_checkpoints(Path(run.out))[-1]),
        "lr_factors": tuple(lr / targs.learning_rate for lr in trainer.lrs_used),
    }


def gradient_summary(stats: GradientStats) -> dict[str, Any] | None:
    """What ``stats`` saw, over every observed step: the shares of all gradient values that were
    zero, that fp16 would flush to zero as they are, and at the loss scale in force; the module
    that lost most; and the last clean step's records for the histogram (``plot_demo``). Syncs."""
    records = stats.report()
    if not records:
        return None
    totals = {"numel": 0, "zero": 0.0, "flush": 0.0, "flush_at_scale": 0.0}
    modules: dict[str, list[float]] = {}
    for rec in records:
        for name, entry in rec["modules"].items():
            n = entry["numel"]
            u, a = entry["unscaled"], entry["at_scale"]
            lost = (u["zero"] + u["fp16"]["flush"]) * n
            totals["numel"] += n
            totals["zero"] += u["zero"] * n
            totals["flush"] += u["fp16"]["flush"] * n
            totals["flush_at_scale"] += a["fp16"]["flush"] * n
            row = modules.setdefault(name or "(root)", [0.0, 0.0])
            row[0] += lost
            row[1] += n
    numel = max(totals.pop("numel"), 1)
    first = records[0]
    n_first = sum(e["numel"] for e in first["modules"].values())
    first_at_scale = sum(e["at_scale"]["fp16"]["flush"] * e["numel"] for e in first["modules"].values()) / max(n_first, 1)
    worst = max(modules.items(), key=lambda kv: kv[1][0] / kv[1][1])
    clean = [r for r in records if all(e["unscaled"]["nan"] == 0 and e["unscaled"]["fp16"]["overflow"] == 0
                                       for e in r["modules"].values())] or records
    return {**{k: v / numel for k, v in totals.items()}, "steps_observed": len(records),
            "first": {"step": first["step"], "scale": first["scale"], "flush_at_scale": first_at_scale},
            "worst_module": worst[0], "worst_module_lost": worst[1][0] / worst[1][1],
            "histogram": {"stats": clean[-1:], "hist_edges": stats.hist_edges, "step": clean[-1]["step"],
                          "scale": clean[-1]["scale"]}}


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
