"""Two processes save a checkpoint, load it back, then load it again after one file that only
process 1 reads was damaged (for test_checkpoint_scale.py).

    python -m torch.distributed.run --nproc_per_node 2 damaged_shard.py OUT [--layout fsdp|ddp]
    python damaged_shard.py OUT --spawn [--layout ...]    # torch.multiprocessing, no torchrun

``fsdp``: FSDP2, every rank writes its DCP shard; rank 1's shard gets one byte changed.
``ddp``: replicated weights; rank 1's RNG file (read by rank 1 alone) gets one byte changed.
Each process writes OUT/rank<r>.json: the files of the checkpoint it opened for reading while
saving and while loading, and the error each load raised.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mixprec import Accelerator, FullyShardedDataParallelPlugin  # noqa: E402
from mixprec.checkpoint import CheckpointError  # noqa: E402

from toys import Opens  # noqa: E402


def run(out: Path, layout: str) -> None:
    torch.manual_seed(0)
    plugin = FullyShardedDataParallelPlugin() if layout == "fsdp" else None
    acc = Accelerator(fsdp_plugin=plugin)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64),
                                torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    loss = model(torch.randn(8, 64, device=acc.device)).pow(2).mean()
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    ckpt = out / "ckpt"
    seen = {"rank": acc.process_index}
    with Opens(ckpt) as o:
        acc.save_state(ckpt)
    seen["opened_saving"] = o.seen
    with Opens(ckpt) as o:
        acc.load_state(ckpt)
    seen["opened_loading"] = sorted(set(o.seen))
    acc.wait_for_everyone()
    if acc.is_main_process:
        victim = ckpt / ("model_0/__1_0.distcp" if layout == "fsdp" else "random_states_1.bin")
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size: only the sha256 can tell
        victim.write_bytes(bytes(data))
        seen["damaged"] = str(victim.relative_to(ckpt))
    acc.wait_for_everyone()
    before = [p.detach().clone() for p in model.parameters()]
    try:
        acc.load_state(ckpt)
        seen["error"] = None
    except CheckpointError as e:
        seen["error"] = str(e)
    seen["unchanged"] = all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    acc.wait_for_everyone()  # every rank got here: none is left waiting in a collective
    (out / f"rank{acc.process_index}.json").write_text(json.dumps(seen))


def _spawned(rank: int, out: str, layout: str, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    run(Path(out), layout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layout", choices=("fsdp", "ddp"), default="fsdp")
    ap.add_argument("--spawn", action="store_true")
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.spawn:
        import torch.multiprocessing as mp

        mp.spawn(_spawned, args=(str(out), a.layout, a.port), nprocs=2, join=True)
    else:
        run(out, a.layout)


if __name__ == "__main__":
    main()
