"""Run every precision under DDP or FSDP2 (2 gloo ranks, torchrun) and write each precision_report, for test_audit.py.

    python -m torch.distributed.run --nproc_per_node 2 audit_check.py OUT ddp|fsdp

Each precision trains 3 steps, saves and loads a checkpoint, and reports. A last run,
"bf16-mixed, reduce_dtype ignored", shards with a policy that drops reduce_dtype (the kind of
silent no-op the audit exists for) and must be caught; under DDP a last run compresses the
all-reduce to bf16 (ddp_comm_hook="bf16"), which the report must see on the wire.
"""

import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsdp_check import Net  # noqa: E402

from mixprec import Accelerator, FullyShardedDataParallelPlugin  # noqa: E402

from toys import Regression  # noqa: E402


def run(out: Path, mode: str, precision: str, broken: bool = False, comm_hook: str | None = None) -> dict:
    plugin = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]) if mode == "fsdp" else None
    scaler = {"init_scale": 2.0**10} if precision == "fp16" else None
    acc = Accelerator(mixed_precision=precision, cpu=True, loss_scaler=scaler, fsdp_plugin=plugin,
                      ddp_comm_hook=comm_hook)
    if broken:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        acc.precision.sharding_policy = lambda reduce_dtype: MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dl = torch.utils.data.DataLoader(Regression(n=48), batch_size=4)
    model, opt, dl = acc.prepare(model, opt, dl)
    for i, (x, y) in enumerate(dl):
        acc.backward(torch.nn.functional.mse_loss(model(x).float(), y))
        opt.step()
        opt.zero_grad()
        if i == 2:
            break
    ckpt = out / f"{mode}-{precision}{'-broken' if broken else ''}{comm_hook or ''}"
    acc.save_state(ckpt)
    acc.load_state(ckpt)
    r = acc.precision_report()
    return {"precision": r.precision, "mode": r.mode, "observed": r.observed, "violations": r.violations,
            "line": r.line()}


def main():
    warnings.simplefilter("ignore")
    out, mode = Path(sys.argv[1]), sys.argv[2]
    reports = [run(out, mode, p) for p in ("fp32", "bf16", "fp16", "bf16-true")]
    if mode == "fsdp":
        reports.append(run(out, mode, "bf16", broken=True))
    else:  # gradients compressed to bf16 on the wire, as asked
        reports.append(run(out, mode, "bf16", comm_hook="bf16"))
    if torch.distributed.get_rank() == 0:
        (out / f"{mode}.json").write_text(json.dumps(reports, indent=1))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
