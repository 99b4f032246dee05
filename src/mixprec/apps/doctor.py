"""``mixprec doctor``: probe a model under fp32, fp16-mixed and bf16-mixed, explain, recommend.

Each probe trains a fresh copy of the model (same seed, same batches) for a few steps with the
gradient statistics and the overflow tracer on. The fp32 probe's gradients are the truth: their
histogram over the fp16 and bf16 number lines, with and without fp16's starting loss scale,
shows what each format would keep. The fp16 probe shows what the loss scaler did.

The doctor drives the Accelerator, so it sits above it, beside the CLI: ``mixprec.diagnostics``
stays the observation-only instruments that the doctor (and every tier) switches on.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mixprec.accelerator.accelerator import Accelerator
from mixprec.apps.progress import Progress
from mixprec.diagnostics import FORMAT_LIMITS, DiagnosticsConfig, GradientStats
from mixprec.hardware import detect_capability
from mixprec.models import call_model, loss_of
from mixprec.precision import PrecisionPerformanceWarning

__all__ = ["DoctorConfig", "run_doctor", "recommend"]

PROBES = ("fp32", "fp16-mixed", "bf16-mixed")
FP16_INIT_SCALE = 2.0**16  # torch.amp.GradScaler's (and the Hugging Face Trainer's) starting scale


@dataclass(frozen=True, kw_only=True)
class DoctorConfig:
    """How long and on what each probe runs.

    Args:
        steps: optimizer steps per precision.
        batch_size: samples per step.
        learning_rate: AdamW's learning rate in the probes.
        cpu: probe on the CPU even where CUDA is available.
        seed: the model's initialisation seed (the same for every probe).
    """

    steps: int = 20
    batch_size: int = 8
    learning_rate: float = 1e-3
    cpu: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {self.steps!r}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {self.batch_size!r}")


def _probe(precision: str, build_model: Callable[[], torch.nn.Module], dataset: Any, collate: Any,
           cfg: DoctorConfig, stepped: Callable[[int], None] = lambda step: None) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionPerformanceWarning)
        acc = Accelerator(mixed_precision=precision, cpu=cfg.cpu, diagnostics=DiagnosticsConfig(trace_overflow=True))
    torch.manual_seed(cfg.seed)
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
    # In fp32 the "at scale" pass predicts what fp16's starting loss scale would do to the same gradients.
    stats = GradientStats(model, every_n_steps=1, scale_source=acc.scaler or FP16_INIT_SCALE)
    dl = torch.utils.data.DataLoader(dataset, batch_size=cfg.batch_size, shuffle=False, collate_fn=collate)
    model, opt, dl = acc.prepare(model, opt, dl)
    losses, step, it = [], 0, iter(dl)
    while step < cfg.steps:
        batch = next(it, None)
        if batch is None:
            it = iter(dl)
            continue
        outputs = call_model(model, batch, model)
        loss = loss_of(outputs)
        acc.backward(loss)
        stats.observe(step, grads_are_scaled_by=acc.scaler)  # before unscaling: they carry the scale
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach().float()))
        step += 1
        stepped(step)
    scaler = acc.scaler
    events = acc.monitor.events if acc.monitor is not None else []
    acc.monitor.remove()
    return {
        "precision": precision,
        "losses": losses,
        "final_loss": sum(losses[-3:]) / len(losses[-3:]),
        "skipped_steps": scaler.skipped_steps if scaler else 0,
        "scale_history": [(i + 1, s, k) for i, (s, k) in enumerate(scaler.scale_history)] if scaler else [],
        "trace_events": [{"step": e.step, "module": e.module_path, "kind": e.kind, "dtype": e.dtype,
                          "max_abs": e.max_abs, "nonfinite": e.nonfinite} for e in events],
        "stats": stats.report(),
        "summary": stats.summary(),
        "hist_edges": stats.hist_edges,
    }


def _layers(probe: dict[str, Any]) -> list[dict[str, Any]]:
    """Per module, the worst fraction over the probe's steps, from its gradient statistics."""
    rows: dict[str, dict[str, Any]] = {}
    for rec in probe["stats"]:
        for name, entry in rec["modules"].items():
            row = rows.setdefault(name or "(root)", {"module": name or "(root)", "numel": entry["numel"],
                                                     "fp16_flush": 0.0, "fp16_flush_at_scale": 0.0,
                                                     "fp16_subnormal_at_scale": 0.0, "fp16_overflow_at_scale": 0.0,
                                                     "bf16_flush": 0.0, "zero": 0.0})
            u, a = entry["unscaled"], entry["at_scale"]
            for key, value in (("fp16_flush", u["fp16"]["flush"]), ("fp16_flush_at_scale", a["fp16"]["flush"]),
                               ("fp16_subnormal_at_scale", a["fp16"]["subnormal"]),
                               ("fp16_overflow_at_scale", a["fp16"]["overflow"]), ("bf16_flush", u["bf16"]["flush"]),
                               ("zero", u["zero"])):
                row[key] = max(row[key], value)
    return list(rows.values())


def _max_log2(probe: dict[str, Any]) -> int | None:
    """The upper log2 edge of the largest gradient magnitude seen (from the histograms)."""
    edges, top = probe["hist_edges"], None
    for rec in probe["stats"]:
        for entry in rec["modules"].values():
            hist = entry["unscaled"]["log2_hist"]
            nz = [i for i, c in enumerate(hist) if c]
            if nz:
                i = nz[-1]
                edge = edges[min(i, len(edges) - 1)] + (1 if i >= len(edges) else 0)
                top = edge if top is None else max(top, edge)
    return top


def recommend(probes: dict[str, dict[str, Any]], layers: list[dict[str, Any]], bf16_native: bool,
              device_type: str) -> dict[str, Any]:
    """The precision to train in, the reasons, and the initial fp16 loss scale."""
    fp16, fp32 = probes["fp16-mixed"], probes["fp32"]
    worst = max(layers, key=lambda r: r["fp16_flush_at_scale"]) if layers else None
    top = _max_log2(fp32)
    # Largest power of two that keeps the biggest gradient 8x below fp16's max (headroom for growth).
    init_scale = 2.0 ** max(0, min(24, math.floor(math.log2(FORMAT_LIMITS["fp16"].max / 8)) - top)) if top else FP16_INIT_SCALE
    reasons = []
    scale = fp16["scale_history"][-1][1] if fp16["scale_history"] else FP16_INIT_SCALE
    if worst is not None and worst["fp16_flush_at_scale"] > 0.01:
        reasons.append(f"{worst['fp16_flush_at_scale']:.0%} of fp16 gradient values in layer `{worst['module']}` "
                       f"underflow even at scale {FP16_INIT_SCALE:g}")
    elif worst is not None:
        unscaled = max(layers, key=lambda r: r["fp16_flush"])
        reasons.append(f"without a loss scale {unscaled['fp16_flush']:.0%} of fp16 gradient values in layer "
                       f"`{unscaled['module']}` would flush to zero; at scale {FP16_INIT_SCALE:g} at most "
                       f"{worst['fp16_flush_at_scale']:.1%} do")
    if fp16["skipped_steps"]:
        reasons.append(f"the fp16 probe skipped {fp16['skipped_steps']} of {len(fp16['losses'])} steps for overflow "
                       f"(scale fell to {scale:g})")
    if fp16["trace_events"]:
        e = fp16["trace_events"][0]
        reasons.append(f"in fp16 the first overflow is in module `{e['module']}` ({e['kind']}, max |x| = {e['max_abs']:g})")
    risky = bool(fp16["skipped_steps"] > len(fp16["losses"]) // 2 or fp16["trace_events"]
                 or (worst is not None and worst["fp16_flush_at_scale"] > 0.01))
    drift = {p: probes[p]["final_loss"] - fp32["final_loss"] for p in ("fp16-mixed", "bf16-mixed")}
    if bf16_native:
        choice = "bf16-mixed"
        reasons.append("bf16 is native here and has fp32's range, so it needs no loss scaling")
    elif device_type == "cuda" and not risky:
        choice = "fp16-mixed"
        reasons.append(f"fp16 has tensor cores here and the loss scaler copes; start it at {init_scale:g}")
    else:
        choice = "fp32"
        reasons.append("no 16-bit format is both native and safe for this model here")
    reasons.append("final probe loss minus fp32's: " + ", ".join(f"{p} {d:+.4f}" for p, d in drift.items()))
    return {"precision": choice, "reasons": reasons, "fp16_init_scale": init_scale, "fp16_risky": risky}


def run_doctor(build_model: Callable[[], torch.nn.Module], dataset: Any, out: str | Path, *,
               collate: Any = None, config: DoctorConfig | None = None, task_name: str = "model",
               progress: Progress | None = None) -> dict[str, Any]:
    """Probe, write ``report.md``, ``report.json`` and three PNGs into ``out``; returns the report.

    Args:
        build_model: builds a fresh model (each probe trains its own).
        dataset: the training samples.
        out: the report's folder.
        collate: the batches' collate function (default: the Trainer's).
        config: the probes' steps, batch size and learning rate.
        task_name: the report's title.
        progress: where to say which probe runs (probe k of 3, step i of n) and the time left;
            ``None``: say nothing (``mixprec doctor`` passes one on stderr).

    Example:
        >>> from mixprec.tasks import get_task  # doctest: +SKIP
        >>> t = get_task("pycode", "tiny")  # doctest: +SKIP
        >>> run_doctor(t.build_model, t.train_dataset, "doctor", collate=t.collate_fn)["recommendation"]  # doctest: +SKIP
    """
    from mixprec.apps.plots import plot_gradient_histogram, plot_layer_underflow, plot_loss_scale
    from mixprec.trainer.datasets import collate as default_collate

    cfg = config or DoctorConfig()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    progress = progress if progress is not None else Progress("doctor", enabled=False)
    probes, step_s = {}, {}
    for i, p in enumerate(PROBES):
        began = time.perf_counter()

        def stepped(step: int, p: str = p, i: int = i, began: float = began) -> None:
            # This probe's mean step so far; the later probes' are not known yet: assume the same.
            step_s[p] = (time.perf_counter() - began) / step
            left = (cfg.steps - step) * step_s[p] + (len(PROBES) - 1 - i) * cfg.steps * step_s[p]
            progress.stage(f"probe {i + 1}/{len(PROBES)}", f"{p}, step {step}/{cfg.steps}", left_s=left)

        progress.stage(f"probe {i + 1}/{len(PROBES)}", f"{p}, building the model")
        probes[p] = _probe(p, build_model, dataset, collate or default_collate, cfg, stepped)
    progress.stage("report", "the plots, report.md and report.json")
    device = Accelerator(cpu=cfg.cpu).device
    cap = detect_capability(device)
    layers = _layers(probes["fp32"])
    rec = recommend(probes, layers, cap.is_native("bf16-mixed"), device.type)
    plots = {
        "gradient_histogram": plot_gradient_histogram(probes["fp32"], out / "gradient_histogram.png",
                                                      scale=FP16_INIT_SCALE, title=f"{task_name}: gradients (fp32 probe)"),
        "loss_scale": plot_loss_scale(probes["fp16-mixed"]["scale_history"], out / "loss_scale.png",
                                      title=f"{task_name}: fp16 loss scale in the probe"),
        "layer_underflow": plot_layer_underflow(layers, out / "layer_underflow.png", scale=FP16_INIT_SCALE,
                                                title=f"{task_name}: gradient values lost per layer"),
    }
    report = {
        "task": task_name, "device": cap.device, "device_name": cap.name, "support": cap.support,
        "config": {"steps": cfg.steps, "batch_size": cfg.batch_size, "learning_rate": cfg.learning_rate},
        "recommendation": rec, "layers": layers,
        "probes": {p: {k: v for k, v in r.items() if k not in ("stats", "summary", "hist_edges")} for p, r in probes.items()},
        "plots": {k: str(v) for k, v in plots.items()},
    }
    (out / "report.json").write_text(json.dumps(report, indent=2, default=float) + "\n")
    (out / "report.md").write_text(_markdown(report))
    return report


def _markdown(r: dict[str, Any]) -> str:
    rec = r["recommendation"]
    lines = [f"# mixprec doctor: {r['task']}", "", f"Device: {r['device']} ({r['device_name']}); "
             f"{r['config']['steps']} steps per probe, batch {r['config']['batch_size']}.", "",
             f"## Recommendation: {rec['precision']}", ""]
    lines += [f"- {reason}" for reason in rec["reasons"]]
    lines += ["", f"Initial loss scale for fp16: {rec['fp16_init_scale']:g}", "", "## Probes", "",
              "| precision | final loss | skipped steps | first overflow |", "|---|---|---|---|"]
    for p, pr in r["probes"].items():
        first = pr["trace_events"][0]["module"] if pr["trace_events"] else "-"
        lines.append(f"| {p} | {pr['final_loss']:.4f} | {pr['skipped_steps']} | {first} |")
    lines += ["", "## Per layer (worst over the fp32 probe's steps)", "",
              "| module | values | zero | fp16 flush | fp16 flush at scale | fp16 subnormal at scale | bf16 flush |",
              "|---|---|---|---|---|---|---|"]
    for row in sorted(r["layers"], key=lambda x: -x["fp16_flush_at_scale"]):
        lines.append(f"| `{row['module']}` | {row['numel']} | {row['zero']:.2%} | {row['fp16_flush']:.2%} | "
                     f"{row['fp16_flush_at_scale']:.2%} | {row['fp16_subnormal_at_scale']:.2%} | {row['bf16_flush']:.2%} |")
    lines += ["", "## Plots", ""] + [f"- `{Path(p).name}`" for p in r["plots"].values()]
    return "\n".join(lines) + "\n"
