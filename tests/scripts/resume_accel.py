"""Train with the Accelerator; optionally save state at a step and SIGKILL ourselves, or resume.

    python resume_accel.py OUT --precision fp16 [--save-at K [--kill]] [--resume CKPT]
"""

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import safetensors.torch
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mixprec import Accelerator, DataLoaderConfiguration  # noqa: E402

from toys import LMData, TinyLM  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--precision", default="fp32")
ap.add_argument("--save-at", type=int, default=-1)
ap.add_argument("--kill", action="store_true")
ap.add_argument("--resume")
ap.add_argument("--epochs", type=int, default=3)
ap.add_argument("--stateful", action="store_true", help="DataLoaderConfiguration(use_stateful_dataloader=True); "
                "without it the loop skips the seen batches itself (skip_first_batches), as Accelerate's examples do")
args = ap.parse_args()
out = Path(args.out)

acc = Accelerator(mixed_precision=args.precision, cpu=True, loss_scaler={"init_scale": 2.0**10, "growth_interval": 3}
                  if args.precision.startswith("fp16") else None,
                  dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=args.stateful))
torch.manual_seed(0)
model = TinyLM(dropout=0.1)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
dl = torch.utils.data.DataLoader(LMData(n=80), batch_size=8, shuffle=True)
model, opt, dl, sched = acc.prepare(model, opt, dl, sched)

epoch0, step, seen = 0, 0, 0
if args.resume:
    acc.load_state(args.resume)
    loop = json.loads((Path(args.resume) / "loop.json").read_text())
    epoch0, step, seen = loop["epoch"], loop["step"], loop["seen"]
for epoch in range(epoch0, args.epochs):
    seen_in_epoch = seen if epoch == epoch0 else 0
    if seen_in_epoch and not args.stateful:
        acc.skip_first_batches(dl, seen_in_epoch)  # the loop's own skip (load_state did not)
    for i, batch in enumerate(dl, start=seen_in_epoch):
        loss = model(**batch).loss
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        step += 1
        if step == args.save_at:
            loop = {"epoch": epoch, "step": step, "seen": i + 1}
            acc.save_state(out / "ckpt", extra_files={"loop.json": json.dumps(loop)})
            if args.kill:
                os.kill(os.getpid(), signal.SIGKILL)
safetensors.torch.save_model(acc.unwrap_model(model), str(out / "final.safetensors"))
(out / "final.json").write_text(json.dumps({"step": step, "lr": sched.get_last_lr()[0],
                                            "scale": acc.scaler.get_scale() if acc.scaler else None}))
