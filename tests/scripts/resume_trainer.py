"""Train with the Trainer for 2 epochs; optionally SIGKILL ourselves mid-training or mid-save; or resume.

    python resume_trainer.py OUT --precision fp32 [--kill-at STEP] [--sigterm-at STEP] [--kill-in-save N]
        [--workers N] [--report-to jsonl,tensorboard] [--resume]
"""

import argparse
import os
import signal
import sys
from pathlib import Path

import safetensors.torch
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mixprec.accelerator.accelerator  # noqa: E402
from mixprec import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from toys import Classifier, blobs  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--precision", default="fp32")
ap.add_argument("--kill-at", type=int, default=-1)
ap.add_argument("--sigterm-at", type=int, default=-1, help="send ourselves SIGTERM (a preemption) at this step")
ap.add_argument("--kill-in-save", type=int, default=-1)
ap.add_argument("--resume", action="store_true")
ap.add_argument("--workers", type=int, default=0, help="dataloader_num_workers, with persistent workers")
ap.add_argument("--report-to", default="jsonl", help="comma-separated reporters")
args = ap.parse_args()


class KillAt(TrainerCallback):
    def on_step_end(self, args_, state, control, **kwargs):
        if state.global_step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if state.global_step == args.sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)


if args.kill_in_save > 0:
    # Die in the middle of the N-th checkpoint write: some files are in the staging folder,
    # the manifest and the rename never happen.
    real_save, saves = torch.save, {"n": 0}

    def dying_save(obj, f, *a, **k):
        real_save(obj, f, *a, **k)
        if str(getattr(f, "name", f)).endswith("optimizer_0.bin"):  # a path, or a file open on it
            saves["n"] += 1
            if saves["n"] == args.kill_in_save:
                os.kill(os.getpid(), signal.SIGKILL)

    mixprec.accelerator.accelerator.torch.save = dying_save

targs = TrainingArguments(output_dir=args.out, precision=args.precision, num_train_epochs=2,
                          per_device_train_batch_size=8, learning_rate=3e-3, warmup_steps=3, save_steps=5,
                          logging_steps=4, eval_strategy="epoch", disable_tqdm=True, seed=7,
                          dataloader_num_workers=args.workers, dataloader_persistent_workers=args.workers > 0,
                          report_to=args.report_to.split(","))
torch.manual_seed(0)
model = Classifier(hidden=32, dropout=0.2)
trainer = Trainer(model=model, args=targs, train_dataset=blobs(96), eval_dataset=blobs(32, seed=1),
                  callbacks=[KillAt()])
out = trainer.train(resume_from_checkpoint=True if args.resume else None)
safetensors.torch.save_model(model, str(Path(args.out) / "final.safetensors"))
trainer.save_state()  # output_dir/trainer_state.json: the whole log_history
print("global_step", out.global_step)
