"""Steps per second of mixprec's Trainer against a hand-written torch.autocast loop and the
Hugging Face Trainer, on the same model, data, batch size, optimizer and precision.

Two jobs: an MLP on scikit-learn's digits (batch 32: per-step overhead dominates) and a small
GPT on the standard library's source (batch 8). bf16 autocast, fused AdamW, gradient clipping
at 1.0, constant learning rate. The three runners are interleaved in rounds in one invocation;
the step time is the median interval between consecutive optimizer steps (data loading
included), after a warm-up, and the fixed cost a runner adds is its median step time less the
hand-written loop's, in microseconds; beside it, the wall time of the whole run (one ``train()`` call, its
set-up included: building the Accelerator, preparing, the dataloader, the optimizer), median over
the rounds. The Hugging Face Trainer needs `pip install transformers accelerate`
(for this benchmark only); without it that column is left out.

    .venv/bin/python benchmarks/trainer_overhead.py [--steps 60] [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
import types

import torch

import mixprec
from mixprec.tasks import collate

from _common import GPT_SMALL, digits_job, gpt_job, hand_loop, interleave, median_after_warmup


def step_times_callback(base):
    class StepTimes(base):
        def __init__(self):
            self.stamps = []

        def on_step_end(self, args, state, control, **kwargs):
            self.stamps.append(time.perf_counter())

    return StepTimes()


def intervals(stamps):
    return [b - a for a, b in zip(stamps, stamps[1:])]


def mixprec_trainer(model, data, batch_size, steps, out):
    cb = step_times_callback(mixprec.TrainerCallback)
    args = mixprec.TrainingArguments(output_dir=out, bf16=True, optim="adamw_torch_fused", max_grad_norm=1.0,
                                     per_device_train_batch_size=batch_size, max_steps=steps, learning_rate=1e-3,
                                     lr_scheduler_type="constant", logging_steps=10**6, save_strategy="no",
                                     report_to="none", disable_tqdm=True, use_cpu=True)
    mixprec.Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]).train()
    return intervals(cb.stamps)


def hf_trainer(model, data, batch_size, steps, out):
    import transformers

    cb = step_times_callback(transformers.TrainerCallback)
    if dataclasses.is_dataclass(getattr(model, "config", None)):
        # The HF Trainer writes model.config.use_cache; give it a mutable copy of our frozen config.
        model.config = types.SimpleNamespace(**dataclasses.asdict(model.config))
    args = transformers.TrainingArguments(output_dir=out, bf16=True, optim="adamw_torch_fused", max_grad_norm=1.0,
                                          per_device_train_batch_size=batch_size, max_steps=steps, learning_rate=1e-3,
                                          lr_scheduler_type="constant", logging_steps=10**6, save_strategy="no",
                                          report_to="none", disable_tqdm=True, use_cpu=True,
                                          remove_unused_columns=False)  # its column filter expects per-sample dicts
    transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=[cb]).train()
    return intervals(cb.stamps)


def have_hf() -> bool:
    try:
        import accelerate  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps per round and runner")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    jobs = {"MLP on digits (batch 32)": (digits_job(), 32), "GPT 2x128 on pycode (batch 8)": (gpt_job(GPT_SMALL), 8)}
    out = tempfile.mkdtemp()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bf16 autocast, fused AdamW, clip 1.0")
    for job, ((factory, data), bs) in jobs.items():
        walls: dict[str, list[float]] = {}

        def run(name, fn, f=factory, d=data, b=bs, walls=walls):
            def go():
                model = f()  # built outside the clock: the same for every runner
                start = time.perf_counter()
                times = fn(model, d, b, args.steps, out)
                walls.setdefault(name, []).append(time.perf_counter() - start)
                return times
            return go

        runs = {
            "hand-written loop": run("hand-written loop",
                                     lambda m, d, b, n, _: hand_loop(m, d, b, torch.bfloat16, n, clip=1.0)),
            "mixprec Trainer": run("mixprec Trainer", mixprec_trainer),
        }
        if have_hf():
            runs["Hugging Face Trainer"] = run("Hugging Face Trainer", hf_trainer)
        med = {k: median_after_warmup(v) for k, v in interleave(runs, args.rounds).items()}
        wall = {k: statistics.median(v) for k, v in walls.items()}
        base, base_wall = med["hand-written loop"], wall["hand-written loop"]
        print(f"{job}, {args.steps} steps:")
        for k, v in med.items():
            print(f"  {k:<22} {1 / v:8.1f} steps/s   x{base / v:5.3f} of the hand-written loop (steady state; "
                  f"fixed cost {(v - base) * 1e6:+5.0f} us/step);   whole run {wall[k]:6.2f} s   x{base_wall / wall[k]:5.3f}")


if __name__ == "__main__":
    main()
