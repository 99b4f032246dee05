"""``run_bench``: the contestants built and warmed up, the interleaved rounds, each row's numbers,
the ratios against the baseline, and the notes."""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader

from mixprec.apps.bench.config import DEFAULT_PRECISIONS, BenchConfig, Job, build_job, tokens_per_sample
from mixprec.apps.bench.measure import dtype_name, matmul_peak, matmul_side, profile_step
from mixprec.apps.bench.memory import measure_memory
from mixprec.apps.bench.plan import BenchPlan
from mixprec.apps.bench.rivals import (
    RIVAL_FACTORIES,
    RIVALS,
    HFTrainerRunner,
    compare_precision,
    hf_missing,
    reset_hf_state,
)
from mixprec.apps.bench.runners import Runner, mixprec_runner
from mixprec.apps.progress import Progress
from mixprec.data import send_to_device
from mixprec.hardware import default_device, detect_capability
from mixprec.models import call_model, loss_of
from mixprec.precision import PLUGINS, PrecisionPerformanceWarning, policy_for

__all__ = ["run_bench"]

_LAST_LOSSES = 5  # training losses averaged into the final loss


# -- the run ------------------------------------------------------------------------------------
def _eval_loss(model: torch.nn.Module, batches: list[Any], device: torch.device,
               float_dtype: torch.dtype | None = None) -> float:
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            n = len(next(iter(batch.values())) if isinstance(batch, Mapping) else batch[0])
            batch = send_to_device(batch, device, float_dtype=float_dtype)
            total += float(loss_of(call_model(model, batch, model)).float()) * n
            count += n
    model.train(was_training)
    return total / max(count, 1)


def _resolve_device(name: str | None) -> torch.device:
    device = torch.device(name) if name is not None else default_device()
    detect_capability(device)  # raises, saying why, for a device that is not there
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def _machine(device: torch.device) -> dict[str, Any]:
    cap = detect_capability(device)
    return {"device": cap.device, "device_name": cap.name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}


def run_bench(config: BenchConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Train the job under each precision, interleaved, and measure it; returns every number.

    Precisions the device cannot run are reported with ``status="skipped"`` and the reason. That
    fp16 is emulated on a CPU without AMX-FP16 lands in ``notes``, not in a warning.

    Args:
        config: what to measure.
        progress: where to say what runs now (warm-up, round k of n, the matmul peak...) and the
            time left; ``None``: say nothing (``mixprec bench`` passes one on stderr).

    Returns:
        ``{"machine", "config", "task", "baseline", "matmul_size", "matmul_peak_tflops",
        "memory_method", "results", "notes", "profile"}``; ``matmul_size`` maps each dtype to the
        side its peak was measured at (``config.matmul_size``, else sized to the device:
        :func:`~mixprec.apps.bench.measure.matmul_side`); ``results`` maps a row name (a
        precision, ``"bf16-true (none)"`` for a further bf16-true update, or a compared
        contestant's ``"torch-loop bf16-mixed"``, ``"hf-trainer bf16-mixed"``...) to its numbers.

    Example:
        >>> out = run_bench(BenchConfig(size="tiny", precisions=["fp32"], steps=2, rounds=1, memory=False))
        >>> out["results"]["fp32"]["speedup"]
        1.0
    """
    progress = progress if progress is not None else Progress("bench", enabled=False)
    if not config.compile:
        return _run_bench(config, progress)
    # Every contestant's forward is one code object (the precision's forward wrapper), and each
    # model adds entries to its compile cache (a Float8Linear is another type, the first step's
    # observing hooks another guard): past dynamo's recompile limit (8) the later contestants would
    # silently run uncompiled. Room for all of them.
    import torch._dynamo

    limit = max(64, torch._dynamo.config.recompile_limit)
    with torch._dynamo.config.patch(recompile_limit=limit, accumulated_recompile_limit=max(
            limit * 4, torch._dynamo.config.accumulated_recompile_limit)):
        return _run_bench(config, progress)


def _run_bench(config: BenchConfig, progress: Progress) -> dict[str, Any]:
    progress.stage("loading the task", config.model or config.task)
    device = _resolve_device(config.device)
    cap = detect_capability(device)
    left_out = []
    if config.precisions is None:
        left_out = [f"{p} left out: {cap.impractical[p]} (name it in --precisions to run it anyway)"
                    for p in DEFAULT_PRECISIONS if p in cap.impractical]
        config = dataclasses.replace(config, precisions=tuple(p for p in DEFAULT_PRECISIONS
                                                              if p not in cap.impractical))
    try:
        job = build_job(config)
    except (ImportError, AttributeError, TypeError) as exc:  # load_factory's, naming the spec and the fix
        raise ValueError(f"cannot build the task: {exc}") from exc
    for line in left_out:  # said before the run, and again in the notes
        progress.note(line)
    notes = left_out + [f"{p} is emulated here: {cap.reasons[p]}" for p in config.precisions
                        if cap.support.get(p) == "emulated" and p in cap.reasons]
    mixprec_rows = _mixprec_rows(config)
    rows: dict[str, dict[str, Any]] = dict(mixprec_rows)
    compared = []
    for c in config.compare:
        precision = compare_precision(config.precisions, c)
        rows[f"{RIVALS[c]} {precision}"] = {"runner": RIVALS[c], "precision": precision}
        compared.append((c, precision, f"{RIVALS[c]} {precision}"))
    dtypes = sorted({torch.float32} | {policy_for(r["precision"]).compute_dtype for r in rows.values()}, key=str)
    memory_rows = sum(r["runner"] == "mixprec" for r in rows.values()) if config.memory and device.type == "cpu" else 0
    plan = BenchPlan(progress, config, list(rows), memory_rows, len(dtypes))
    runners: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionPerformanceWarning)  # said once, in the notes
        for name, row in mixprec_rows:
            _start(row, runners, name, lambda row=row: mixprec_runner(job, row["precision"], config, device,
                                                                       row.get("compensation")), device, config, plan)
        for c, precision, name in compared:
            if hf_missing(c):
                _skip(rows[name], hf_missing(c))
                plan.skipped(name)
                continue
            _start(rows[name], runners, name,
                   lambda c=c, p=precision: RIVAL_FACTORIES[c](job, p, config, device, notes), device, config, plan)
        max_side = 2048 if device.type == "cpu" else 4096
        sizes = {dtype_name(d): config.matmul_size for d in dtypes} if config.matmul_size else {}

        def peak() -> dict[str, float]:
            if not sizes:  # sized once, on the first round's measurement: every round measures alike
                sizes.update({dtype_name(d): matmul_side(device, d, max_side) for d in dtypes})
            return matmul_peak(device, dtypes, sizes)

        try:
            profiles, round_peaks = _run_rounds(rows, runners, job, config, device, peak, plan)
        finally:
            for runner in runners.values():
                runner.finish()
            reset_hf_state()
        plan.memory(sum(rows[n]["runner"] == "mixprec" for n in runners) if memory_rows else 0)
        memory_method = measure_memory(rows, runners, config, device)
    peaks = {k: max(p[k] for p in round_peaks) for k in round_peaks[0]}
    sample = next(iter(DataLoader(job.train, batch_size=config.batch_size, collate_fn=job.collate_fn)))
    tokens = tokens_per_sample(sample)
    for name, runner in runners.items():
        _finish_row(rows[name], runner, config, round_peaks, rows, tokens)
    baseline = "fp32" if rows.get("fp32", {}).get("status") == "ok" else next(
        (n for n, r in rows.items() if r.get("status") == "ok" and r["runner"] == "mixprec"), None)
    if baseline not in (None, "fp32"):
        notes.append(f"fp32 was not measured: speed-ups and loss differences are against {baseline}")
    add_ratios(rows, baseline)
    notes += drift_note(rows)
    notes += [f"{n} trains with {r['optimizer']}: the Accelerator's replacement for the fused torch AdamW"
              for n, r in rows.items() if r.get("status") == "ok" and r["runner"] == "mixprec"
              and r["optimizer"] != "torch.optim.AdamW (fused)"]
    notes += _compare_notes(rows, config)
    model = next(iter(runners.values())).model if runners else job.build_model()
    return {
        "machine": _machine(device),
        "config": dataclasses.asdict(config),
        "task": {"name": job.name, "description": job.description, "batch_size": config.batch_size,
                 "tokens_per_sample": tokens, "parameters": sum(p.numel() for p in model.parameters())},
        "baseline": baseline,
        "matmul_size": sizes,
        "matmul_peak_tflops": peaks,
        "matmul_peak_tflops_per_round": round_peaks,
        "memory_method": memory_method,
        "results": rows,
        "notes": list(dict.fromkeys(notes)),
        "profile": profiles,
    }


def _mixprec_rows(config: BenchConfig) -> list[tuple[str, dict[str, Any]]]:
    """mixprec.Accelerator's rows: one per precision, and one per variant where its plugin has some
    (bf16-true's compensations: the config's field of the plugin's ``variant_field`` name)."""
    rows = []
    for p in config.precisions:
        field = PLUGINS[p].variant_field
        if field is None:
            rows.append((p, {"runner": "mixprec", "precision": p}))
            continue
        for i, comp in enumerate(getattr(config, field)):
            rows.append((p if i == 0 else f"{p} ({comp})", {"runner": "mixprec", "precision": p, "compensation": comp,
                                                           "state_dtype": config.bf16_true_state_dtype}))
    return rows


def _compare_notes(rows: dict[str, dict[str, Any]], config: BenchConfig) -> list[str]:
    ok = {n: r for n, r in rows.items() if r.get("status") == "ok" and r["runner"] != "mixprec"}
    if not ok:
        return []
    notes = [f"compared rows ({', '.join(ok)}): same init, data order (the bench's dataloader) and fused AdamW as "
             "mixprec's" + (", compiled alike" if config.compile else "") + "; their memory is not measured; "
             "vs mixprec: their throughput over mixprec.Accelerator's at the same precision"
             + ("; vs torch loop: each row's throughput over the hand-written torch loop's at the same precision"
                if any("throughput_vs_torch_loop" in r for r in rows.values()) else "")]
    if any(r["runner"] == "hf-trainer" for r in ok.values()):
        notes.append("hf-trainer's FLOPs per step are mixprec's count for the same job (its steps are not counted alone)")
    torch_row = next((r for r in ok.values() if r["runner"] == "torch-loop"), None)
    twin = rows.get(torch_row["precision"], {}) if torch_row is not None else {}
    if twin.get("compensation"):  # a precision with an update of its own (bf16-true): torch's loop has none
        p = torch_row["precision"]
        notes.append(f"torch-loop {p}: the model cast to {dtype_name(policy_for(p).param_dtype)} and torch's fused AdamW, "
                     f"uncompensated; its vs mixprec is against the {p} row ({twin['compensation']} compensation)")
    return notes


def _skip(row: dict[str, Any], reason: str) -> None:
    row.update(status="skipped", reason=reason)


def _start(row: dict[str, Any], runners: dict[str, Any], name: str, build: Callable[[], Any],
           device: torch.device, config: BenchConfig, plan: BenchPlan) -> None:
    """Build a contestant, count its FLOPs on one step, warm it up; a failure skips it, saying why."""
    plan.building(name)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    runner = None
    try:
        runner = build()
        if isinstance(runner, Runner):  # Hugging Face's Trainer warms up in its own run (_run_rounds)
            # Warm-up first: a compiled model's first call compiles, and a first call under the FLOP
            # counter (a dispatch mode) would leave it uncompiled for good (measured: no graph).
            runner.run_chunk(config.warmup)
            row["flops_per_step"] = runner.count_flops()
            row["host_syncs_per_step"] = runner.count_syncs()  # after the warm-up: steady state
    except Exception as exc:  # e.g. resolve_precision's ValueError for a precision the device lacks
        _skip(row, f"{type(exc).__name__}: {exc}")
        plan.skipped(name)
        if runner is not None:
            runner.finish()
        return
    plan.built(name, runner.times)
    runner.times.clear()
    runner.losses.clear()
    if device.type == "cuda" and config.memory and row["runner"] == "mixprec":
        row["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device) - before
    row.update(status="ok", optimizer=runner.optimizer)
    runners[name] = runner


def _run_rounds(rows: dict[str, dict[str, Any]], runners: dict[str, Any], job: Job, config: BenchConfig,
                device: torch.device, peak: Callable[[], dict[str, float]],
                plan: BenchPlan) -> tuple[dict[str, Any], list[dict]]:
    """The interleaved rounds, each ending with a matmul-peak measurement (so the peak drifts with
    the steps it is compared to); then each contestant's eval loss and (if asked) a profiled step."""
    played, peaks = [], []
    trainer = next(((n, r) for n, r in runners.items() if isinstance(r, HFTrainerRunner)), None)

    def play_round(r: int) -> None:
        if trainer is not None and trainer[0] in runners:  # it drives: its chunk of round r just ended
            plan.chunk_done(r, trainer[0], trainer[1].times)
        for name, runner in list(runners.items()):
            if isinstance(runner, Runner):
                plan.chunk(r, name)
                try:
                    runner.run_chunk(config.steps)
                except Exception as exc:  # one contestant failing must not lose the others' numbers
                    _skip(rows[name], f"failed in round {r + 1}: {type(exc).__name__}: {exc}")
                    runners.pop(name).finish()
                    plan.skipped(name)
                    continue
                plan.chunk_done(r, name, runner.times)
        plan.peak(r)
        peaks.append(peak())
        plan.peak_done()
        played.append(r)
        if trainer is not None and trainer[0] in runners and r + 1 < config.rounds:
            plan.chunk(r + 1, trainer[0])

    if trainer is not None:
        plan.chunk(0, trainer[0])
        try:
            trainer[1].train(config, play_round)
        except Exception as exc:
            _skip(rows[trainer[0]], f"failed: {type(exc).__name__}: {exc}")
            runners.pop(trainer[0]).finish()
            plan.skipped(trainer[0])
    for r in range(len(played), config.rounds):
        play_round(r)
    eval_set = job.eval_batches(config)
    for name, runner in runners.items():
        plan.evaluating(name)
        rows[name]["eval_loss"] = _eval_loss(runner.model, eval_set, device, getattr(runner, "input_dtype", None))
        plan.evaluated()
    profiles = {}
    for n, r in runners.items():
        if config.profile and rows[n]["runner"] == "mixprec":
            plan.phase("profile", n)
            profiles[n] = profile_step(r, device)
    return profiles, peaks


def _finish_row(row: dict[str, Any], runner: Any, config: BenchConfig, round_peaks: list[dict[str, float]],
                rows: dict[str, dict[str, Any]], tokens: int | None) -> None:
    median = statistics.median(runner.times)
    per_round = [statistics.median(runner.times[r * config.steps:(r + 1) * config.steps])
                 for r in range(config.rounds)]
    samples = config.batch_size / median
    row.update(step_time_s=median, step_time_per_round_s=per_round, step_time_min_s=min(runner.times),
               round_spread=max(per_round) / min(per_round), step_times_s=list(runner.times),
               samples_per_s=samples, tokens_per_s=samples * tokens if tokens else None,
               compute_dtype=dtype_name(policy_for(row["precision"]).compute_dtype))
    if not row.get("flops_per_step"):  # a compare row: the same job's FLOPs, counted on our run
        row["flops_per_step"] = rows.get(row["precision"], {}).get("flops_per_step")
    flops = row["flops_per_step"]
    row["tflops"] = flops / median / 1e12 if flops else None
    # Each round against the peak measured right after it, so a slower machine lowers both alike.
    row["fraction_of_peak"] = statistics.median(
        flops / t / 1e12 / p[row["compute_dtype"]] for t, p in zip(per_round, round_peaks)) if flops else None
    row["train_loss"] = float(torch.stack(runner.losses[-_LAST_LOSSES:]).float().mean())


def _round_ratio(base: dict[str, Any], row: dict[str, Any]) -> float:
    """The median over rounds of the per-round throughput ratio: drift between rounds cancels."""
    return statistics.median(b / t for b, t in zip(base["step_time_per_round_s"], row["step_time_per_round_s"]))


def add_ratios(rows: dict[str, dict[str, Any]], baseline: str | None) -> None:
    base = rows.get(baseline, {}) if baseline else {}
    loop = next((r for r in rows.values() if r["runner"] == "torch-loop" and r.get("status") == "ok"), None)
    for row in rows.values():
        if row.get("status") != "ok":
            continue
        # Equal batches, so the step-time ratio is the throughput ratio.
        row["speedup"] = _round_ratio(base, row) if base else None
        # Other work only ever slows a step down: the fastest steps are the least disturbed.
        row["speedup_fastest_steps"] = base["step_time_min_s"] / row["step_time_min_s"] if base else None
        for key in ("train_loss", "eval_loss"):
            b = base.get(key)
            row[f"{key}_rel_diff"] = (row[key] - b) / abs(b) if b else None
        twin = rows.get(row["precision"], {})
        if row["runner"] != "mixprec" and twin.get("status") == "ok":
            row["throughput_vs_mixprec"] = _round_ratio(twin, row)
        if loop is not None and row is not loop and row["precision"] == loop["precision"]:
            row["throughput_vs_torch_loop"] = _round_ratio(loop, row)


def drift_note(rows: dict[str, dict[str, Any]], tolerance: float = 1.25) -> list[str]:
    """A warning, in words, when the machine's speed changed so much between rounds that the
    interleaving cannot cancel it (other work on a shared machine comes and goes in bursts)."""
    ok = {n: r for n, r in rows.items() if r.get("status") == "ok"}
    worst = max(ok.items(), key=lambda kv: kv[1]["round_spread"], default=None)
    if worst is None or worst[1]["round_spread"] <= tolerance:
        return []
    fastest = ", ".join(f"{n} {r['speedup_fastest_steps']:.2f}x" for n, r in ok.items()
                        if r.get("speedup_fastest_steps") is not None)
    return [f"the machine's speed changed during the run ({worst[0]}'s round medians differ by "
            f"{worst[1]['round_spread']:.1f}x; other work running?): the speed-ups are unreliable. On each one's "
            f"fastest steps, the least disturbed: {fastest}. Rerun on an idle machine, or with more, shorter rounds"]
