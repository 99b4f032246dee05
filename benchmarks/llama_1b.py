"""A Llama-style model of about 1B parameters on one GPU (issue 40, part 3): mixprec's Accelerator
(bf16-mixed, fp8, bf16-true) against Hugging Face Accelerate and a hand-written ``torch.autocast``
loop, in one run, on the same model, seed and data.

The model is transformers' ``LlamaForCausalLM`` built from a ``LlamaConfig`` (random weights, no
download, ``attn_implementation="sdpa"``). ``--size 1b`` is Llama 3.2 1B's shape with a 32000-token
vocabulary and untied embeddings: hidden 2048, 16 layers, 32 heads, 8 key/value heads,
intermediate 8192, about 1.10B parameters (with intermediate 5632, TinyLlama's, 16 layers hold
only 0.85B). ``--size tiny`` is a smoke-test model for the CPU.

The data are synthetic tokens with something to learn, so that the loss moves within a few steps:
half the tokens are drawn from a Zipf-like unigram, the other half follow the previous token
through a fixed random permutation. All batches are made once, on the device, before the first
job; every job builds a fresh model from the same seed and trains on the same batches with
``torch.optim.AdamW(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)``.

Jobs (``--jobs``, a comma list, run in the order given, one after the other in this process):

* ``torch:bf16``: the baseline, written as torch's tutorials write it (``torch.autocast`` around
  forward, ``loss.backward()``, ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``);
* ``mixprec:<precision>``: ``mixprec.Accelerator(mixed_precision=<precision>)``, e.g.
  ``mixprec:bf16-mixed``, ``mixprec:fp8`` (torchao's float8 training; emulated off an sm89+ GPU),
  ``mixprec:bf16-true`` (bf16 weights, Kahan-compensated AdamW);
* ``accelerate:<mixed_precision>``: ``accelerate.Accelerator(mixed_precision=...)``, e.g.
  ``accelerate:bf16``.

With ``--compile``: the hand loop compiles the model with ``torch.compile``, mixprec's Accelerator
gets ``compile=True``, Accelerate's gets ``dynamo_backend="inductor"``.

For each job: tokens per second over the steps after the warm-up (synchronised before and after),
the model FLOPs utilisation against the GPU's dense bf16 peak (fp8 too: the same yardstick), the
peak memory (``torch.cuda.max_memory_allocated`` from the model's build on), and the loss of the
last step (every step's loss is in the JSON).

Model FLOPs per token (PaLM's count, Appendix B; the usual MFU convention):

    6 * N + 12 * layers * hidden * seq_len

where N counts every parameter but the input embedding table (a lookup, no multiply; the LM head
is counted), and the second term is the attention scores and their weighted sum (counted over the
full, not the causal, matrix). MFU = FLOPs per token * tokens per second / peak.

A job that fails (out of memory, fp8 without kernels, a missing package) records its error and the
run goes on; a job is skipped, with a note, when the run has used ``--budget-s`` or would by
starting one more job as long as the longest so far.

    PYTHONPATH=src python benchmarks/llama_1b.py --out /tmp/llama             # on a GPU
    PYTHONPATH=src python benchmarks/llama_1b.py --compile --out /tmp/llama-c
    PYTHONPATH=src python benchmarks/llama_1b.py --device cpu --size tiny --steps 2 --warmup 1
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import math
import platform
import re
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

#: Dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, by a pattern of ``torch.cuda.get_device_name``;
#: the first match wins. Anything else needs ``--peak-tflops``.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"H200|GH200", 989.4),
    (r"H100.*PCIe", 756.0),
    (r"H100.*NVL", 835.0),
    (r"H100", 989.4),  # SXM ("NVIDIA H100 80GB HBM3")
    (r"A100", 312.0),
    (r"\bL4\b", 121.0),  # not L40 / L40S
)

SIZES: dict[str, dict[str, Any]] = {
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8),
    # Every dimension a multiple of 16, so that fp8 converts the inner Linear layers here too.
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}
DEFAULT_JOBS = "torch:bf16,mixprec:bf16-mixed,accelerate:bf16,mixprec:fp8,mixprec:bf16-true"
LR, BETAS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 0.1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="example: PYTHONPATH=src python benchmarks/llama_1b.py --compile --out /tmp/llama")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--size", choices=tuple(SIZES), default="1b")
    p.add_argument("--steps", type=int, default=20, help="timed steps per job (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3; compiling happens here)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 2048; tiny: 64)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 4; tiny: 2)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model in every job")
    p.add_argument("--jobs", default=DEFAULT_JOBS, help=f"comma list, run in this order (default {DEFAULT_JOBS})")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's dense bf16 peak, TFLOP/s (default: from the GPU's name, where known)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="skip the jobs left once the run has taken this long (default 480)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="folder for llama_1b.json and llama_1b.md")
    args = p.parse_args(argv)
    tiny = args.size == "tiny"
    args.seq_len = args.seq_len or (64 if tiny else 2048)
    args.batch_size = args.batch_size or (2 if tiny else 4)
    args.jobs = [j.strip() for j in args.jobs.split(",") if j.strip()]
    for job in args.jobs:
        kind, _, precision = job.partition(":")
        if kind not in ("torch", "mixprec", "accelerate") or not precision:
            p.error(f"--jobs: {job!r} is not torch:bf16, mixprec:<precision> or accelerate:<mixed_precision>")
        if kind == "torch" and precision not in ("bf16", "fp16", "fp32"):
            p.error(f"--jobs: {job!r}: the hand loop runs torch:bf16, torch:fp16 or torch:fp32")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be at least 1 and --warmup at least 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch sees no CUDA device here; use --device cpu")
    return args


# ----------------------------------------------------------------------------------------- model

def llama_config(size: str, seq_len: int):
    from transformers import LlamaConfig

    return LlamaConfig(**SIZES[size], max_position_embeddings=max(seq_len, 128), rms_norm_eps=1e-5,
                       tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False)


def build_model(config, device: torch.device, seed: int) -> torch.nn.Module:
    """A fresh ``LlamaForCausalLM`` in fp32, initialised on ``device`` from ``seed``."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.train()


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """(every parameter, the ones the FLOPs count: all but the input embedding table)."""
    total = sum(p.numel() for p in model.parameters())
    return total, total - model.get_input_embeddings().weight.numel()


def flops_per_token(n_counted: int, config, seq_len: int) -> int:
    return 6 * n_counted + 12 * config.num_hidden_layers * config.hidden_size * seq_len


def peak_tflops(device: torch.device, given: float | None) -> tuple[float | None, str]:
    if given is not None:
        return given, "given (--peak-tflops)"
    if device.type != "cuda":
        return None, "no peak known for the CPU: pass --peak-tflops for an MFU"
    name = torch.cuda.get_device_name(device)
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, name):
            return tflops, f"dense bf16 peak of {name!r} (table in benchmarks/llama_1b.py)"
    return None, f"no bf16 peak known for {name!r}: pass --peak-tflops for an MFU"


def synthetic_batches(n: int, batch: int, seq: int, vocab: int, seed: int, device: torch.device) -> list[torch.Tensor]:
    """``n`` batches of token ids: half from a Zipf-like unigram, half the previous token's image
    under a fixed random permutation (learnable, so the loss falls within a few steps)."""
    g = torch.Generator().manual_seed(seed)
    successor = torch.randperm(vocab, generator=g)
    unigram = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1
    tokens = torch.multinomial(unigram / unigram.sum(), n * batch * seq, replacement=True, generator=g)
    tokens = tokens.view(n, batch, seq)
    follow = torch.rand(n, batch, seq, generator=g) < 0.5
    for t in range(1, seq):
        tokens[:, :, t] = torch.where(follow[:, :, t], successor[tokens[:, :, t - 1]], tokens[:, :, t])
    return [b.to(device) for b in tokens.unbind(0)]


# ------------------------------------------------------------------------------------------ jobs

def fused_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, fused=True)


def torch_job(model, device, precision: str, compile: bool) -> tuple[Callable, dict]:
    """The hand-written loop, as torch's tutorials write it."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    optimizer = fused_adamw(model)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    if compile:
        model = torch.compile(model)

    def step(input_ids):
        with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(input_ids=input_ids, labels=input_ids).loss
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step, {"holds": (model, optimizer)}


def _accelerator_step(acc, model, optimizer) -> Callable:
    """One training step through an Accelerator (mixprec's or Accelerate's: the same loop)."""

    def step(input_ids):
        loss = model(input_ids=input_ids, labels=input_ids).loss
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def mixprec_job(model, device, precision: str, compile: bool) -> tuple[Callable, dict]:
    from mixprec import Accelerator

    acc = Accelerator(mixed_precision=precision, cpu=device.type == "cpu", compile=compile)
    model, optimizer = acc.prepare(model, fused_adamw(model))
    step = _accelerator_step(acc, model, optimizer)

    def note() -> str:
        try:
            return acc.precision_report().line()
        except Exception as e:  # the report is a note, never the job's failure
            return f"precision_report failed: {type(e).__name__}: {e}"

    return step, {"holds": (acc, model, optimizer), "note": note}


def accelerate_job(model, device, precision: str, compile: bool) -> tuple[Callable, dict]:
    import accelerate

    acc = accelerate.Accelerator(mixed_precision=precision, cpu=device.type == "cpu",
                                 dynamo_backend="inductor" if compile else "no")
    model, optimizer = acc.prepare(model, fused_adamw(model))
    return _accelerator_step(acc, model, optimizer), {"holds": (acc, model, optimizer)}


JOB_KINDS = {"torch": torch_job, "mixprec": mixprec_job, "accelerate": accelerate_job}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Drop what the last job left: Accelerate's process-wide state too (mixprec's Accelerator sets
    it up where Accelerate is imported), so that the next job starts with its own precision."""
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def run_job(name: str, args, config, batches, device, flops_tok: int, peak: float | None) -> dict:
    kind, _, precision = name.partition(":")
    row: dict[str, Any] = {"job": name, "status": "ok"}
    t_start = time.perf_counter()
    model = build_model(config, device, args.seed)
    step, extra = JOB_KINDS[kind](model, device, precision, args.compile)
    del model
    losses = []
    for b in batches[:args.warmup]:
        losses.append(step(b).detach())
    sync(device)
    t0 = time.perf_counter()
    for b in batches[args.warmup:]:
        losses.append(step(b).detach())
    sync(device)
    seconds = time.perf_counter() - t0
    tokens_per_s = args.steps * args.batch_size * args.seq_len / seconds
    losses_f = torch.stack(losses).float().cpu().tolist()
    row.update(tokens_per_s=tokens_per_s, step_ms=1000 * seconds / args.steps,
               mfu=flops_tok * tokens_per_s / (peak * 1e12) if peak else None,
               peak_mem_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
               loss=losses_f[-1], losses=losses_f, job_seconds=time.perf_counter() - t_start)
    if "note" in extra:
        row["note"] = extra["note"]()
    return row


# ----------------------------------------------------------------------------------------- report

def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("transformers", "accelerate", "torchao", "mixprec"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def fmt(v: Any, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def short_note(note: str) -> str:
    """The table's cut of mixprec's precision report (the JSON holds all of it): the float8 layer
    count, and whether the precision in force is the contract's."""
    if not note:
        return ""
    parts = re.findall(r"\d+ of \d+ Linear layers in float8 \([^)]*\)", note)
    parts.append("precision as its contract says" if note.endswith("as the contract says")
                 else "precision report: see the JSON")
    return "; ".join(parts)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def markdown(result: dict) -> str:
    base = next((r for r in result["jobs"] if r["job"].startswith("torch:") and r["status"] == "ok"), None)
    lines = [f"Llama {result['size']} ({result['params'] / 1e6:,.1f}M parameters), {result['device']}, "
             f"batch {result['batch_size']} x {result['seq_len']} tokens, {result['steps']} steps after "
             f"{result['warmup']} of warm-up, {'compiled' if result['compile'] else 'eager'}; "
             f"MFU against {fmt(result['peak_tflops'], '.1f')} TFLOP/s ({result['peak_note']})",
             "",
             "| job | tokens/s | step ms | vs hand loop | MFU | peak GiB | loss | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["jobs"]:
        if r["status"] != "ok":
            lines.append(f"| {r['job']} | - | - | - | - | - | - | {r['status']}: {r.get('error', '')} |")
            continue
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        note = short_note(r.get("note", ""))
        lines.append(f"| {r['job']} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | {ratio} | {mfu} | "
                     f"{fmt(r['peak_mem_gib'], '.2f')} | {r['loss']:.4f} | {note} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    t_run = time.perf_counter()
    args = parse_args(argv)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    config = llama_config(args.size, args.seq_len)
    probe = build_model(config, "meta", args.seed)
    n_total, n_counted = count_params(probe)
    del probe
    flops_tok = flops_per_token(n_counted, config, args.seq_len)
    peak, peak_note = peak_tflops(device, args.peak_tflops)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({cpu_name()})"
    print(f"Llama {args.size}: {n_total:,} parameters ({n_counted:,} counted for FLOPs: all but the input "
          f"embedding), {flops_tok / 1e9:.2f} GFLOP per token at seq {args.seq_len}; {name}; {peak_note}",
          flush=True)
    batches = synthetic_batches(args.warmup + args.steps, args.batch_size, args.seq_len, config.vocab_size,
                                args.seed, device)
    result: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]), "device": name, "versions": versions(), "size": args.size,
        "config": {k: getattr(config, k) for k in SIZES[args.size]}, "params": n_total,
        "params_counted_for_flops": n_counted, "flops_per_token": flops_tok,
        "flops_formula": "6 * N + 12 * layers * hidden * seq_len (N: all parameters but the input embedding)",
        "peak_tflops": peak, "peak_note": peak_note, "batch_size": args.batch_size, "seq_len": args.seq_len,
        "steps": args.steps, "warmup": args.warmup, "compile": args.compile, "seed": args.seed,
        "optimizer": f"torch.optim.AdamW(lr={LR}, betas={BETAS}, weight_decay={WEIGHT_DECAY}, fused=True)",
        "budget_s": args.budget_s, "jobs": []}
    longest = 0.0
    for job in args.jobs:
        elapsed = time.perf_counter() - t_run
        if elapsed + longest > args.budget_s:
            row = {"job": job, "status": "skipped",
                   "error": f"budget: {elapsed:.0f} s used, the longest job took {longest:.0f} s, --budget-s "
                            f"{args.budget_s:.0f}"}
        else:
            free_memory(device)
            t_job = time.perf_counter()
            try:
                row = run_job(job, args, config, batches, device, flops_tok, peak)
            except Exception as e:  # out of memory, fp8 without kernels, a missing package: say so, go on
                row = {"job": job, "status": "failed", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
                traceback.print_exc()
            longest = max(longest, time.perf_counter() - t_job)
            free_memory(device)
        result["jobs"].append(row)
        if row["status"] == "ok":
            mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "-"
            print(f"{job}: {row['tokens_per_s']:,.0f} tokens/s, {row['step_ms']:.1f} ms/step, MFU {mfu}, "
                  f"peak {fmt(row['peak_mem_gib'], '.2f')} GiB, "
                  f"loss {row['loss']:.4f} ({row['job_seconds']:.0f} s)", flush=True)
        else:
            print(f"{job}: {row['status']}: {row['error']}", flush=True)
        result["run_seconds"] = time.perf_counter() - t_run
        write(result, args.out)  # after every job: a run cut short by a timeout keeps what it measured
    print("\n" + markdown(result), flush=True)
    if args.out is not None:
        print(f"wrote {args.out / 'llama_1b.json'} and {args.out / 'llama_1b.md'}", flush=True)
    return result


def write(result: dict, out: Path | None) -> None:
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "llama_1b.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "llama_1b.md").write_text(markdown(result))


if __name__ == "__main__":
    main()
