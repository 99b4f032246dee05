"""Checkpoint writes that fail for real: a file size limit (RLIMIT_FSIZE) makes the write fail with EFBIG
(the Accelerator's save, the Trainer's, and the Trainer's rotation with save_total_limit=1).

    python full_disk.py OUT      # prints one JSON line of what it saw
"""

import json
import resource
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mixprec import Accelerator, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from mixprec.checkpoint.folder import verify_checkpoint  # noqa: E402

from toys import Classifier, blobs  # noqa: E402

out = Path(sys.argv[1])
seen = {}
acc = Accelerator(cpu=True)
model = torch.nn.Linear(256, 256)
opt = torch.optim.AdamW(model.parameters())
model, opt = acc.prepare(model, opt)
acc.save_state(out / "ckpt")  # before the limit: complete
good = sorted(verify_checkpoint(out / "ckpt"))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
model(torch.randn(2, 256)).sum().backward()
opt.step()
try:
    acc.save_state(out / "ckpt")
except OSError as e:
    seen["errno"], seen["message"] = e.errno, str(e)
seen["previous_intact"] = sorted(verify_checkpoint(out / "ckpt")) == good
seen["left_in_out"] = sorted(p.name for p in out.iterdir())
# The Trainer, told to warn: both saves fail, training finishes, no half checkpoint is left.
args = TrainingArguments(output_dir=str(out / "run"), max_steps=4, save_steps=2, per_device_train_batch_size=8,
                         disable_tqdm=True, report_to="none", on_save_error="warn", use_cpu=True)
torch.manual_seed(0)
result = Trainer(model=Classifier(hidden=2048), args=args, train_dataset=blobs(64)).train()
seen["trainer_steps"] = result.global_step
seen["left_in_run"] = sorted(p.name for p in (out / "run").iterdir())
# Rotation (save_total_limit=1): the first save completes, then the limit drops and the next fails:
# the last good checkpoint must still be there, complete.
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))


class LimitAfterFirstSave(TrainerCallback):
    def on_save(self, args, state, control, **kwargs):
        resource.setrlimit(resource.RLIMIT_FSIZE, (200, hard))


args = TrainingArguments(output_dir=str(out / "rot"), max_steps=4, save_steps=2, save_total_limit=1,
                         per_device_train_batch_size=8, disable_tqdm=True, report_to="none", on_save_error="warn",
                         use_cpu=True)
torch.manual_seed(0)
Trainer(model=Classifier(), args=args, train_dataset=blobs(64), callbacks=[LimitAfterFirstSave()]).train()
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
seen["left_after_rotation"] = sorted(p.name for p in (out / "rot").iterdir())
seen["kept_complete"] = bool(verify_checkpoint(out / "rot" / "checkpoint-2"))
print(json.dumps(seen))
