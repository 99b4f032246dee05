"""The Trainer with FSDP2 under torchrun; on the first attempt rank 1 SIGKILLs itself at a step.

    python -m torch.distributed.run --nproc_per_node 2 --max-restarts 1 elastic_trainer.py OUT [--kill-at K]

torchrun's elastic agent restarts both ranks; the Trainer (resume_from_checkpoint unset) then
resumes from the newest complete checkpoint by itself. Writes OUT/final/model.safetensors and,
on rank 0, OUT/attempts.txt (one line per attempt). Each rank that exits normally prints whether
the process group was destroyed by then (mixprec destroys the one it created at exit).
"""

import argparse
import atexit
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mixprec import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from toys import Classifier, blobs  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--kill-at", type=int, default=-1)
ap.add_argument("--fsdp", default="full_shard", help="'' runs DDP")
ap.add_argument("--sigterm-at", type=int, default=-1, help="rank 1 alone gets SIGTERM at this step")
ap.add_argument("--resume", action="store_true", help="resume_from_checkpoint='auto'")
args = ap.parse_args()
out = Path(args.out)
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


@atexit.register  # before the Trainer creates the group: runs after mixprec's own exit handler
def report_the_group_at_exit():
    state = "alive" if dist.is_initialized() else "destroyed"
    # One write of the whole line: the two ranks share torchrun's stdout, and print's text and
    # newline may reach it as two writes, interleaved with the other rank's.
    os.write(1, f"attempt {attempt} rank {os.environ.get('RANK')}: process group {state} at exit\n".encode())


class KillOnce(TrainerCallback):
    def on_step_end(self, targs, state, control, **kwargs):
        if attempt == 0 and state.global_step == args.kill_at and int(os.environ.get("RANK", "0")) == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if state.global_step == args.sigterm_at and int(os.environ.get("RANK", "0")) == 1:
            os.kill(os.getpid(), signal.SIGTERM)


targs = TrainingArguments(output_dir=str(out), max_steps=12, per_device_train_batch_size=8, learning_rate=0.05,
                          save_strategy="steps", save_steps=4, logging_steps=4, disable_tqdm=True, report_to="none",
                          seed=0, use_cpu=True, fsdp=args.fsdp)
torch.manual_seed(0)
trainer = Trainer(model=Classifier(hidden=32), args=targs, train_dataset=blobs(256), callbacks=[KillOnce()])
result = trainer.train(resume_from_checkpoint="auto" if args.resume else None)
trainer.save_model(str(out / "final"))
if trainer.is_world_process_zero():
    with open(out / "attempts.txt", "a") as fh:
        fh.write(f"attempt {attempt} finished at step {result.global_step}\n")
