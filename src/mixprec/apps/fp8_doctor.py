"""``mixprec doctor --precision fp8``: whether a model trains in fp8, and which layers must stay bf16,
measured on the CPU before renting a GPU.

A bf16-mixed probe trains a fresh copy of the model for a few steps. At each step, for every
``nn.Linear``, its input, weight and output gradient are quantised exactly as torchao's float8
training would quantise them under each recipe (:func:`mixprec.precision.fp8.quantise_float8`,
byte for byte torchao's cast): the input as bf16 autocast hands it to the layer (the products on
the first 512 rows of each step's batch; the scales from the whole tensors). Per layer the
doctor reports the largest magnitude (amax) of each tensor, its range (binades from its median
magnitude to its amax), the fraction of values saturated (beyond the format's maximum after
scaling) and flushed to zero, and the relative error of the layer's *output* in fp8 against
bf16 (what the next layer sees), and of the input gradient it sends back.

The first recommendation keeps in bf16 the layers the kernels cannot take (dimensions not
multiples of 16), the first and the last, and every layer whose output error is ``error_ratio``
times the median layer's; it picks tensorwise unless rowwise at least halves the median error
(rowwise is slower). That recommendation is a claim, which loss probes then verify
(:mod:`mixprec.apps.fp8_search`): a second bf16-mixed seed sets the tolerance, a miss starts a
search over the layers ranked by every signal, and a search that finds nothing ends in a verdict
against fp8. The verified filter is written as the filter the fp8 precision takes
(:func:`write_fp8_filter`, read by :func:`mixprec.precision.fp8.load_fp8_filter`).
"""

from __future__ import annotations

import json
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mixprec.accelerator.accelerator import Accelerator
from mixprec.apps.fp8_search import ERROR_RATIO, loss_tolerance, verify_float8
from mixprec.models import call_model, loss_of
from mixprec.precision import PrecisionConfig, PrecisionPerformanceWarning
from mixprec.precision.fp8 import float8_casts, float8_layer_choice, quantise_float8, torchao_float8

__all__ = ["Fp8DoctorConfig", "probe_float8_layers", "recommend_float8", "run_fp8_doctor", "write_fp8_filter"]


@dataclass(frozen=True, kw_only=True)
class Fp8DoctorConfig:
    """How the fp8 doctor probes.

    Args:
        steps: optimizer steps of each probe.
        batch_size: samples per step.
        learning_rate: AdamW's learning rate in the probes.
        recipes: the torchao recipes whose quantisation is measured.
        error_ratio: a layer whose fp8 output error is this many times the median layer's is kept in bf16.
        cpu: probe on the CPU even where CUDA is available (the numerics are the same).
        seed: the model's initialisation seed (the same for every probe; ``seed + 1`` for the second
            bf16-mixed probe that sets the tolerance).
        max_probes: at most this many fp8 probes in the search when the recommended filter misses.
        tolerance: the relative loss gap to bf16-mixed a filter may end at; ``None``: two bf16-mixed
            seeds' gap, held between :data:`mixprec.apps.fp8_search.TOLERANCE_FLOOR` and
            :data:`~mixprec.apps.fp8_search.TOLERANCE_CAP`.
    """

    steps: int = 20
    batch_size: int = 8
    learning_rate: float = 1e-3
    recipes: tuple[str, ...] = ("tensorwise", "rowwise")
    error_ratio: float = ERROR_RATIO
    cpu: bool = True
    seed: int = 0
    max_probes: int = 4
    tolerance: float | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.max_probes, int) or self.max_probes < 0:
            raise ValueError(f"max_probes must be an int >= 0 (0: verify without searching), got {self.max_probes!r}")
        if self.tolerance is not None and not self.tolerance >= 0:
            raise ValueError(f"tolerance must be >= 0 (a relative loss gap, 0.02 for 2%) or None to measure it "
                             f"from two bf16-mixed seeds, got {self.tolerance!r}")
        for r in self.recipes:
            PrecisionConfig(fp8_recipe=r)  # an unknown recipe is refused there, with the valid ones
        if self.error_ratio <= 1:
            raise ValueError(f"error_ratio must be > 1, got {self.error_ratio!r}")


def _loader(dataset: Any, collate: Any, cfg: Fp8DoctorConfig) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset, batch_size=cfg.batch_size, shuffle=False, collate_fn=collate)


def _steps(model: torch.nn.Module, opt: Any, acc: Accelerator, dl: Any, steps: int,
           after_backward: Callable[[int], None] | None = None) -> list[float]:
    losses, step, it = [], 0, iter(dl)
    while step < steps:
        batch = next(it, None)
        if batch is None:
            it = iter(dl)
            continue
        loss = loss_of(call_model(model, batch, model))
        acc.backward(loss)
        if after_backward is not None:
            after_backward(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach().float()))
        step += 1
    return losses


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    norm = float(torch.linalg.vector_norm(b))
    return float(torch.linalg.vector_norm(a - b)) / norm if norm > 0 else 0.0


_ROWS = 512  # rows (tokens) of a step's batch the products are measured on; the casts see all of them


_EPS = 1 + 2 ** -20  # a scaled amax may land a rounding above the format's maximum; that is not clipping


def _range(a: torch.Tensor, dim: int | None) -> float | None:
    """Binades from the median magnitude up to the amax of ``a`` (magnitudes), per slice the recipe
    scales as one: the whole tensor for tensorwise (its median from at most 65536 values), else the
    worst of at most 64 slices along ``dim``."""
    if dim is None:
        flat = a.flatten()
        amax, median = flat.max().float()[None], flat[:: max(1, flat.numel() // 65536)].float().median()[None]
    else:
        rows = a.movedim(dim, -1).reshape(-1, a.shape[dim])
        rows = rows[:: max(1, rows.shape[0] // 64)].float()
        amax, median = rows.amax(-1), rows.median(-1).values
    ok = median > 0
    return float(torch.log2(amax[ok] / median[ok]).max()) if bool(ok.any()) else None


def _cast_stats(t: torch.Tensor, cast: dict[str, Any], rows: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """``t`` as the matrix product sees it after the cast (its first ``rows`` rows: the scale is
    the whole tensor's, as in training), and what the cast did to all of it."""
    bits, scale = quantise_float8(t, **cast)
    values = bits.float()
    limit = torch.finfo(cast["dtype"]).max
    a = t.detach().abs()
    amax = a.amax() if cast["dim"] is None else a.amax(cast["dim"], keepdim=True)
    # Saturated: beyond the format's maximum after scaling, so clipped to it (never under the dynamic
    # scaling torchao uses, whose scale maps each amax onto the maximum: checked, not assumed).
    clipped = bool((amax.float() * scale > limit * _EPS).any())
    stats = {"amax": float(amax.max()),
             "saturated": float((a.float() * scale > limit * _EPS).float().mean()) if clipped else 0.0,
             "flushed": float(((values == 0) & (t != 0)).float().mean()), "range": _range(a, cast["dim"]),
             "format": "e4m3" if cast["dtype"] == torch.float8_e4m3fn else "e5m2"}
    if rows is not None:
        values, scale = values[:rows], (scale[:rows] if scale.dim() and scale.shape[0] > 1 else scale)
    return values / scale, stats


def _layer_errors(x: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor,
                  casts: dict[str, Any]) -> dict[str, Any]:
    """One layer, one step, one recipe: the fp8 output and input gradient against bf16's."""
    x = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # what bf16 autocast hands the layer
    g = grad_out.reshape(-1, grad_out.shape[-1]).to(torch.bfloat16)
    w16 = weight.to(torch.bfloat16).float()
    out: dict[str, Any] = {}
    xq, out["input"] = _cast_stats(x, casts["input"], _ROWS)
    wq, out["weight"] = _cast_stats(weight.t(), casts["weight"])
    out["output_error"] = _relative(xq @ wq, x[:_ROWS].float() @ w16.t())
    if casts["grad_output"] is not None:
        gq, out["grad_output"] = _cast_stats(g, casts["grad_output"], _ROWS)
        wgi = casts["weight_for_grad_input"] or casts["weight"]
        wq_gi = wq if wgi == casts["weight"] else _cast_stats(weight.t(), wgi)[0]  # tensorwise: the same cast
        out["grad_input_error"] = _relative(gq @ wq_gi.t(), g[:_ROWS].float() @ w16)
    return out


def probe_float8_layers(build_model: Callable[[], torch.nn.Module], dataset: Any, *, collate: Any = None,
                        config: Fp8DoctorConfig | None = None) -> dict[str, Any]:
    """Train a bf16-mixed probe and measure, per ``nn.Linear`` and recipe, what float8 would do.

    Returns ``{"losses", "layers": {name: {"shape", "default", recipe: {"input", "weight",
    "grad_output": {"amax", "saturated", "flushed"}, "output_error", "grad_input_error"}}}}``,
    each figure the worst (amax, fractions) or the mean (errors) over the steps.
    """
    cfg = config or Fp8DoctorConfig()
    float8 = torchao_float8()
    casts = {r: float8_casts(float8.Float8LinearConfig.from_recipe_name(r)) for r in cfg.recipes}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionPerformanceWarning)
        acc = Accelerator(mixed_precision="bf16-mixed", cpu=cfg.cpu)
    torch.manual_seed(cfg.seed)
    model = build_model()
    choice = float8_layer_choice(model)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    seen: dict[str, dict[str, torch.Tensor]] = {name: {} for name in linears}
    handles = []

    def capture(name: str, args: Any, out: torch.Tensor) -> None:
        seen[name]["x"] = args[0].detach()
        if out.requires_grad:  # the output's gradient: what the layer's backward receives
            out.register_hook(lambda g: seen[name].update(g=g.detach()))

    for name, m in linears.items():
        handles.append(m.register_forward_hook(lambda mod, args, out, name=name: capture(name, args, out)))
    per_step: dict[str, dict[str, list[dict[str, Any]]]] = {n: {r: [] for r in cfg.recipes} for n in linears}

    def measure(step: int) -> None:
        for name, m in linears.items():
            if "x" not in seen[name] or "g" not in seen[name]:
                continue  # a layer this step did not use
            for r in cfg.recipes:
                per_step[name][r].append(_layer_errors(seen[name]["x"], m.weight.detach(), seen[name]["g"], casts[r]))
            seen[name].clear()

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
    dl = _loader(dataset, collate, cfg)
    model, opt, dl = acc.prepare(model, opt, dl)
    try:
        losses = _steps(model, opt, acc, dl, cfg.steps, measure)
    finally:
        for h in handles:
            h.remove()
    layers = {}
    for name, m in linears.items():
        row: dict[str, Any] = {"shape": [m.out_features, m.in_features], "default": choice[name]}
        for r in cfg.recipes:
            steps = per_step[name][r]
            if not steps:
                continue
            agg: dict[str, Any] = {}
            for tensor in ("input", "weight", "grad_output"):
                if tensor in steps[0]:
                    agg[tensor] = {k: max(s[tensor][k] for s in steps) for k in ("amax", "saturated", "flushed")}
                    ranges = [s[tensor]["range"] for s in steps if s[tensor]["range"] is not None]
                    agg[tensor].update(range=max(ranges) if ranges else None, format=steps[0][tensor]["format"])
            for key in ("output_error", "grad_input_error"):
                if key in steps[0]:
                    agg[key] = statistics.fmean(s[key] for s in steps)
            row[r] = agg
        layers[name] = row
    return {"losses": losses, "layers": layers}


def recommend_float8(layers: dict[str, dict[str, Any]], recipes: tuple[str, ...], error_ratio: float = ERROR_RATIO
                     ) -> dict[str, Any]:
    """Which layers stay bf16 and why, and which recipe, from :func:`probe_float8_layers`'s layers."""
    measured = [n for n, row in layers.items() if all(r in row for r in recipes)]
    candidates = [n for n in measured if layers[n]["default"] is None]
    keep = {n: row["default"] for n, row in layers.items() if row["default"] is not None}
    median = {r: statistics.median(layers[n][r]["output_error"] for n in candidates) if candidates else 0.0
              for r in recipes}
    recipe = recipes[0]
    for r in recipes[1:]:
        if median[r] < 0.5 * median[recipe]:
            recipe = r
    reasons = []
    for n in candidates:
        err = layers[n][recipe]["output_error"]
        if median[recipe] > 0 and err > error_ratio * median[recipe]:
            keep[n] = (f"its fp8 output error is {err:.3g}, {err / median[recipe]:.1f}x the median layer's "
                       f"({median[recipe]:.3g})")
            x = layers[n][recipe]["input"]
            reasons.append(f"`{n}`: {keep[n]}; its input's amax is {x['amax']:.3g} and {x['flushed']:.1%} of its "
                           "values flush to zero after scaling")
    if recipe != recipes[0]:
        reasons.append(f"{recipe} halves the median layer's output error against {recipes[0]} "
                       f"({median[recipe]:.3g} against {median[recipes[0]]:.3g})")
    converted = [n for n in layers if n not in keep]
    return {"recipe": recipe, "keep_in_bf16": keep, "converted": converted, "median_output_error": median,
            "reasons": reasons}


def write_fp8_filter(recommendation: dict[str, Any], path: str | Path) -> Path:
    """Write the recommendation as the fp8 precision's filter (JSON: ``fp8_recipe``, ``fp8_filter``
    the layer names kept in bf16), for ``PrecisionConfig(**load_fp8_filter(path))``; a verdict
    against fp8 has no filter, and is refused."""
    if recommendation.get("fp8") is False:
        raise ValueError("the doctor recommends against fp8 for this model, so there is no fp8 filter to write: "
                         f"{recommendation.get('reason', '')} (train it in bf16-mixed)")
    path = Path(path)
    path.write_text(json.dumps({"fp8_recipe": recommendation["recipe"],
                                "fp8_filter": sorted(recommendation["keep_in_bf16"]),
                                "why": recommendation["keep_in_bf16"]}, indent=2) + "\n")
    return path


def _loss_probe(precision: str, build_model: Callable[[], torch.nn.Module], dataset: Any, collate: Any,
                cfg: Fp8DoctorConfig, seed: int | None = None, **fp8: Any) -> float:
    """The loss a short run ends at (the mean of its last 3 steps), ``precision`` with ``fp8``'s
    :class:`PrecisionConfig` fields, from the model built after ``torch.manual_seed(seed)``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionPerformanceWarning)
        acc = Accelerator(mixed_precision=precision, cpu=cfg.cpu, precision_config=PrecisionConfig(**fp8))
    torch.manual_seed(cfg.seed if seed is None else seed)
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
    model, opt, dl = acc.prepare(model, opt, _loader(dataset, collate, cfg))
    losses = _steps(model, opt, acc, dl, cfg.steps)
    return statistics.fmean(losses[-3:])


def run_fp8_doctor(build_model: Callable[[], torch.nn.Module], dataset: Any, out: str | Path, *,
                   collate: Any = None, config: Fp8DoctorConfig | None = None, task_name: str = "model",
                   write_filter: str | Path | None = None) -> dict[str, Any]:
    """Measure, recommend, verify (search, or refuse), and write ``report.md``, ``report.json`` and two
    plots into ``out`` (and the verified filter to ``write_filter``, unless fp8 is refused); returns
    the report. Its ``probes`` list every run the verdict rests on, with its loss gap.

    Example:
        >>> from mixprec.tasks import get_task  # doctest: +SKIP
        >>> t = get_task("pycode", "tiny")  # doctest: +SKIP
        >>> run_fp8_doctor(t.build_model, t.train_dataset, "fp8-doctor", collate=t.collate_fn)["recommendation"]  # doctest: +SKIP
    """
    from mixprec.apps.fp8_report import report_markdown
    from mixprec.apps.plots import plot_float8_errors, plot_float8_histogram
    from mixprec.trainer.datasets import collate as default_collate

    cfg = config or Fp8DoctorConfig()
    collate = collate or default_collate
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    probe = probe_float8_layers(build_model, dataset, collate=collate, config=cfg)
    t1 = time.perf_counter()
    first = recommend_float8(probe["layers"], cfg.recipes, cfg.error_ratio)
    # The measuring run is a bf16-mixed run (its hooks observe, never change a number): its loss is bf16-mixed's.
    bf16 = statistics.fmean(probe["losses"][-3:])
    other = _loss_probe("bf16-mixed", build_model, dataset, collate, cfg, seed=cfg.seed + 1)
    t2 = time.perf_counter()
    tolerance = loss_tolerance(bf16, other, override=cfg.tolerance)
    verdict = verify_float8(probe["layers"], first, lambda keep: _loss_probe(
        "fp8", build_model, dataset, collate, cfg, fp8_recipe=first["recipe"], fp8_filter=keep),
        bf16_loss=bf16, tolerance=tolerance["value"], max_probes=cfg.max_probes, error_ratio=cfg.error_ratio)
    probes = [{"label": f"bf16-mixed, seed {cfg.seed} (the measuring run)", "keep_in_bf16": None, "loss": bf16,
               "gap": 0.0, "within": None, "seconds": t1 - t0},
              {"label": f"bf16-mixed, seed {cfg.seed + 1} (sets the tolerance)", "keep_in_bf16": None, "loss": other,
               "gap": (other - bf16) / abs(bf16), "within": None, "seconds": t2 - t1}, *verdict.pop("probes")]
    rec = {"fp8": verdict["fp8"], "recipe": verdict["recipe"], "keep_in_bf16": verdict["keep_in_bf16"],
           "converted": verdict["converted"], "reason": verdict["reason"], "reasons": first["reasons"],
           "median_output_error": first["median_output_error"], "measured_rule": first["keep_in_bf16"]}
    worst = max(probe["layers"], key=lambda n: probe["layers"][n].get(rec["recipe"], {}).get("output_error", -1.0))
    plots = {"errors": plot_float8_errors(probe["layers"], cfg.recipes, rec, out / "fp8_layer_errors.png",
                                          title=f"{task_name}: each Linear's output error in fp8 against bf16"),
             "histogram": plot_float8_histogram(_input_sample(build_model, dataset, collate, cfg, worst),
                                                out / "fp8_input_histogram.png", recipe=rec["recipe"],
                                                title=f"{task_name}: `{worst}`'s input on the e4m3 number line")}
    fp8_seconds = sum(p["seconds"] for p in probes[2:])
    report = {"task": task_name,
              "config": {"steps": cfg.steps, "batch_size": cfg.batch_size, "learning_rate": cfg.learning_rate,
                         "recipes": list(cfg.recipes), "seed": cfg.seed, "max_probes": cfg.max_probes},
              "recommendation": rec, "tolerance": tolerance, "probes": probes, "ranking": verdict["ranking"],
              "loss": {"bf16-mixed": bf16, **{p["label"]: p["loss"] for p in probes[1:]}},
              "loss_gap": {p["label"]: p["gap"] for p in probes[1:]}, "layers": probe["layers"],
              "seconds": {"measuring": t1 - t0, "tolerance": t2 - t1, "fp8 probes": fp8_seconds,
                          "search": sum(p["seconds"] for p in probes if p["label"].startswith(("search", "prune"))),
                          "total": time.perf_counter() - t0},
              "plots": {k: str(v) for k, v in plots.items()}, "filter": None}
    if write_filter is not None and rec["fp8"]:
        report["filter"] = str(write_fp8_filter(rec, write_filter))
    (out / "report.json").write_text(json.dumps(report, indent=2, default=float) + "\n")
    (out / "report.md").write_text(report_markdown(report))
    return report


def _input_sample(build_model: Callable[[], torch.nn.Module], dataset: Any, collate: Any, cfg: Fp8DoctorConfig,
                  name: str) -> torch.Tensor:
    """Layer ``name``'s input on the first batch (a fresh model: the histogram's sample)."""
    torch.manual_seed(cfg.seed)
    model = build_model()
    layer = dict(model.named_modules())[name]
    got: list[torch.Tensor] = []
    handle = layer.register_forward_hook(lambda m, args, out: got.append(args[0].detach()))
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            call_model(model, next(iter(_loader(dataset, collate, cfg))), model)
    finally:
        handle.remove()
    return got[0].to(torch.bfloat16)
