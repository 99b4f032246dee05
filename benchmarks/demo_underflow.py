"""Where fp16 without loss scaling costs the demo's GPT something, measured: the experiment behind
``mixprec demo``'s underflow lesson (its ``--step-tokens``).

Part ``probe``: one batch of pycode ``size`` after ``--stages`` steps of fp32 training, its gradients
in fp32, in fp16 autocast with the loss scaled by 2^16 (then unscaled), and in fp16 without a scale:
the share of the Linear layers' output gradients (activation gradients) that are zero or
subnormal, and how far the parameter gradients are from fp32's (relative error of the whole
gradient; the share of parameter gradient values that are zero beyond fp32's).

Part ``sweep``: the demo's own runs (:func:`mixprec.apps.demo.train_run`, the Trainer, the same
data, seed and learning rates) of pycode ``tiny``, ``--steps`` steps in fp16 without loss scaling
and in fp32, with each step's loss averaged over ``--step-tokens`` tokens (each value one run;
0 is the batch's own 512): the validation loss each ended at and the share of gradient values
the unscaled run lost to zero.

    python benchmarks/demo_underflow.py probe --size tiny --batch-size 8 --stages 0,300,1500
    python benchmarks/demo_underflow.py sweep --steps 200 --step-tokens 0,32768,131072,262144,524288
"""

from __future__ import annotations

import argparse
import math
import tempfile
import warnings

import torch

from mixprec.apps.demo import DemoRun, demo_task, train_in_fresh_process


def _grads(model: torch.nn.Module, batch: dict, scale: float | None) -> tuple[dict, list[torch.Tensor]]:
    """Parameter gradients (unscaled) and the Linear layers' output gradients of one backward:
    fp32 where ``scale`` is None, else fp16 autocast with the loss times ``scale``."""
    model.zero_grad(set_to_none=True)
    outputs: list[torch.Tensor] = []
    hooks = [m.register_full_backward_hook(lambda m, gi, go: outputs.append(go[0].detach()))
             for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if scale is None:
        model(**batch).loss.backward()
    else:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(**batch).loss
        (loss.float() * scale).backward()
    for h in hooks:
        h.remove()
    grads = {n: p.grad.detach().clone() / (scale or 1.0) for n, p in model.named_parameters() if p.grad is not None}
    return grads, outputs


def probe(args: argparse.Namespace) -> None:
    task = demo_task(args.size, None, None)
    torch.manual_seed(0)
    model = task.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    loader = torch.utils.data.DataLoader(task.train_dataset, batch_size=args.batch_size, shuffle=True,
                                         collate_fn=task.collate_fn, generator=torch.Generator().manual_seed(0))
    batches = iter(loader)
    done = 0
    print(f"| pycode/{args.size}, batch {args.batch_size} | step | loss | fp16 | activation gradients 0 (fp32: ) "
          "| subnormal | parameter gradient error | parameter values 0 beyond fp32's |")
    print("|---|---|---|---|---|---|---|---|")
    for stage in (int(s) for s in args.stages.split(",")):
        while done < stage:
            model(**next(batches)).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            done += 1
        batch = next(batches)
        ref, ref_out = _grads(model, batch, None)
        loss = float(model(**batch).loss)
        for label, scale in (("scaled 2^16", 2.0**16), ("unscaled", 1.0)):
            grads, out = _grads(model, batch, scale)
            n_out = sum(o.numel() for o in out)
            zero = sum(int((o == 0).sum()) for o in out) / n_out
            zero_ref = sum(int((o == 0).sum()) for o in ref_out) / n_out
            sub = sum(int(((o.abs() < 2.0**-14) & (o != 0)).sum()) for o in out) / n_out
            err = math.sqrt(sum(float((grads[k] - ref[k]).pow(2).sum()) for k in ref)
                            / sum(float(ref[k].pow(2).sum()) for k in ref))
            numel = sum(g.numel() for g in ref.values())
            lost = sum(int((grads[k] == 0).sum()) - int((ref[k] == 0).sum()) for k in ref) / numel
            print(f"| | {stage} | {loss:.3f} | {label} | {zero:.1%} ({zero_ref:.1%}) | {sub:.0%} | {err:.2%} | {lost:.2%} |")


def sweep(args: argparse.Namespace) -> None:
    print(f"| tokens a step's loss is averaged over | fp16 unscaled: val loss | fp32: val loss | cost | "
          f"fp16 unscaled: gradient values 0 (fp32) |  ({args.steps} steps of pycode/tiny, batch 8 x 64)")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for tokens in (int(t) for t in args.step_tokens.split(",")):
            runs = {}
            for name, precision, scaler in (("fp16-unscaled", "fp16-mixed", {"enabled": False}),
                                            ("fp32", "fp32", None)):
                run = DemoRun(name=name, precision=precision, size="tiny", budget=args.steps, out=f"{tmp}/{tokens}-{name}",
                              step_tokens=tokens or None, loss_scaler=scaler, observe_every=max(1, args.steps // 10))
                runs[name] = train_in_fresh_process(run, (None, None), 8, False)
            bare, ref = runs["fp16-unscaled"], runs["fp32"]
            print(f"| {tokens or 512:,} | {bare['final_eval_loss']:.3f} | {ref['final_eval_loss']:.3f} | "
                  f"{bare['final_eval_loss'] / ref['final_eval_loss'] - 1:+.1%} | {bare['grads']['zero']:.1%} "
                  f"({ref['grads']['zero']:.2%}) |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="part", required=True)
    a = sub.add_parser("probe")
    a.add_argument("--size", default="tiny")
    a.add_argument("--batch-size", type=int, default=8)
    a.add_argument("--stages", default="0,300,1500")
    b = sub.add_parser("sweep")
    b.add_argument("--steps", type=int, default=200)
    b.add_argument("--step-tokens", default="0,32768,131072,262144,524288")
    args = p.parse_args()
    warnings.simplefilter("ignore")
    (probe if args.part == "probe" else sweep)(args)


if __name__ == "__main__":
    main()
