"""Train a small layered model with Accelerator(fsdp_plugin=...) (under torchrun, or alone), for test_fsdp.py.

    python -m torch.distributed.run --nproc_per_node 2 fsdp_check.py OUT --precision bf16 [--save-at K]
        [--resume CKPT] [--inf-rank R --inf-step S] [--steps N]

Writes OUT/result.json (rank 0: shard fractions, scales, skip flags, ranks' agreement),
OUT/final.safetensors (the whole model, from save_model) and, with --save-at, OUT/ckpt.
"""

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mixprec import Accelerator, FullyShardedDataParallelPlugin  # noqa: E402

from toys import Regression  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(torch.nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.inp = torch.nn.Linear(8, d)
        self.layers = torch.nn.ModuleList(Block(d) for _ in range(3))
        self.head = torch.nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def local_numel(tensors):
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() for t in tensors)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-at", type=int, default=-1)
    ap.add_argument("--resume")
    ap.add_argument("--inf-rank", type=int, default=-1)
    ap.add_argument("--inf-step", type=int, default=-1)
    ap.add_argument("--compensation", default="kahan")
    ap.add_argument("--async-save", action="store_true")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--skip-nonfinite", action="store_true")
    ap.add_argument("--diagnostics", action="store_true", help="gradient statistics every step and the overflow tracer")
    ap.add_argument("--die-saving-at", type=int, default=-1, help="rank 1 SIGKILLs itself inside a save at this step")
    args = ap.parse_args()
    out = Path(args.out)
    scaler = {"init_scale": 2.0**10} if args.precision == "fp16" else None
    acc = Accelerator(mixed_precision=args.precision, cpu=True, loss_scaler=scaler,
                      bf16_true_compensation=args.compensation, skip_nonfinite_steps=args.skip_nonfinite,
                      diagnostics={"gradient_stats_every": 1, "trace_overflow": True} if args.diagnostics else None,
                      fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"],
                                                                 activation_checkpointing=args.activation_checkpointing))
    torch.manual_seed(0)
    model = Net()
    total = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dl = torch.utils.data.DataLoader(Regression(n=64), batch_size=8 // acc.num_processes)  # global batch 8
    model, opt, dl = acc.prepare(model, opt, dl)
    step = 0
    if args.resume:
        acc.load_state(args.resume)
        step = json.loads((Path(args.resume) / "loop.json").read_text())["step"]
    scales, skipped, losses = [], [], []
    for i, (x, y) in enumerate(dl):
        if i < step:
            continue  # the loop's own skip (Accelerate's default resume)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        acc.backward(loss)
        losses.append(acc.reduce(loss.detach(), "mean").item())
        if step == args.inf_step and acc.process_index == args.inf_rank:
            g = next(p for p in model.parameters() if p.grad is not None).grad
            (g.to_local() if hasattr(g, "to_local") else g).view(-1)[0] = float("inf")
        acc.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        opt.zero_grad()
        step += 1
        scales.append(acc.scaler.get_scale() if acc.scaler else None)
        skipped.append(acc.optimizer_step_was_skipped)
        if step == args.die_saving_at:
            if acc.process_index == 1:  # mid-save: the staging folder exists, the shards are not written
                import signal

                import mixprec.accelerator.checkpointer
                mixprec.accelerator.checkpointer.save_sharded = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
            acc.save_state(out / "ckpt", extra_files={"loop.json": json.dumps({"step": step})})
        if step == args.save_at:
            acc.save_state(out / "ckpt", extra_files={"loop.json": json.dumps({"step": step})},
                           async_save=args.async_save)  # training goes on while it is written
        if step == args.steps:
            break
    stats = acc.monitor.stats.report() if args.diagnostics else []  # every rank: the counts were all-reduced
    events = [e.module_path for e in acc.monitor.events] if args.diagnostics else []
    full = acc.get_state_dict(model)
    digest = hashlib.sha256(b"".join(full[k].float().numpy().tobytes() for k in sorted(full))).hexdigest()
    digests = [None] * acc.num_processes
    if acc.num_processes > 1:
        torch.distributed.all_gather_object(digests, digest)
    else:
        digests = [digest]
    report = acc.precision_report()
    acc.save_model(model, out, max_shard_size="10GB")
    if acc.is_main_process:
        os.replace(out / "model.safetensors", out / "final.safetensors")
        inner = opt.optimizer
        state = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
        (out / "result.json").write_text(json.dumps({
            "num_processes": acc.num_processes, "sharded": type(model).__name__.startswith("FSDP"),
            "param_fraction": local_numel(model.parameters()) / total,
            "state_fraction": local_numel(state) / (2 * total),
            "checkpointed_blocks": sum(type(m).__name__.endswith("CheckpointWrapper") for m in model.modules()),
            "grad_stats": [{n: {"numel": v["numel"], "zero": v["unscaled"]["zero"],
                                "fp16_flush": v["unscaled"]["fp16"]["flush"], "nan": v["unscaled"]["nan"], "overflow": v["unscaled"]["fp16"]["overflow"], "hist": v["unscaled"]["log2_hist"]}
                            for n, v in r["parameters"].items()} for r in stats],
            "overflow_events": events,
            "state_keys": sorted({k for s in inner.state.values() for k in s}),
            "state_sharded": all(hasattr(t, "to_local") for t in state),
            "precision_ok": report.ok, "precision_details": report.details,
            "scales": scales, "skipped": skipped, "losses": losses, "ranks_identical": len(set(digests)) == 1, "step": step}))
    acc.end_training()


if __name__ == "__main__":
    main()
