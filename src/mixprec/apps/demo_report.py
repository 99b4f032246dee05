"""What ``mixprec demo`` says of its runs, in the seed lesson's order: where 16-bit speed comes
from, fp16's narrow range and underflow, the loss scale at work, and a conclusion with this run's
numbers (:mod:`mixprec.cli.demo` prints it; :mod:`mixprec.apps.demo` trains the runs).

Every function takes :func:`mixprec.apps.demo.train_run`'s results and returns lines of text.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from mixprec.diagnostics.limits import FORMAT_LIMITS

__all__ = ["conclusion", "lesson_lines", "scale_lines", "speed_lines", "step_ratio", "table"]

Run = Mapping[str, Any]


def table(rows: Sequence[Run]) -> str:
    """The runs side by side: steps, seconds of training, throughput against the first row's,
    peak memory, validation loss.

    Example:
        >>> row = {"name": "fp32", "steps": 10, "training_seconds": 2.0, "tokens_per_second": 100.0,
        ...        "peak_memory_mb": 50.0, "final_eval_loss": 2.5, "final_bits_per_byte": 3.6}
        >>> print(table([row]).splitlines()[2])
        fp32                 10      2.0        100     1.00x           50     2.500     3.600
    """
    head = (f"{'run':<16} {'steps':>6} {'seconds':>8} {'tokens/s':>10} {'speed-up':>9} {'peak RSS MB':>12} "
            f"{'val loss':>9} {'bits/byte':>9}")
    base = rows[0]["tokens_per_second"]
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['name']:<16} {r['steps']:>6} {r['training_seconds']:>8.1f} {r['tokens_per_second']:>10.0f} "
                     f"{r['tokens_per_second'] / base:>8.2f}x {r['peak_memory_mb']:>12.0f} "
                     f"{r['final_eval_loss']:>9.3f} {r['final_bits_per_byte']:>9.3f}")
    return "\n".join(lines)


def step_ratio(fp32: Run, mixed: Run) -> float:
    """How many times longer ``mixed``'s median step took than ``fp32``'s (below 1: faster). The
    median, not the total: a burst of another process's work on the same cores moves a total, and
    the first steps' warm-up, which a run of a few hundred steps cannot spread."""
    return mixed["median_step_seconds"] / fp32["median_step_seconds"]


def _as_fast(ratio: float) -> str:
    """``"1.93x as fast as fp32"`` or ``"1.3x slower than fp32"`` from a throughput ratio."""
    return f"{ratio:.2f}x as fast as fp32" if ratio >= 1 else f"{1 / ratio:.1f}x slower than fp32"


def speed_lines(speed: Sequence[Run], raced: bool, why: str, native_figures: Sequence[str]) -> list[str]:
    """Lesson 1, 16-bit's speed: the race's speed-up, or the step-for-step times and where the
    speed is to be had (``native_figures``: measured elsewhere, each naming its machine)."""
    if len(speed) == 1:
        return [f"fp32 alone, as asked: nothing to set against it (a 16-bit --precision races it); validation loss "
                f"{speed[0]['final_eval_loss']:.3f}"]
    fp32, mixed = speed
    if raced:
        ratio = mixed["tokens_per_second"] / fp32["tokens_per_second"]
        same = (f"the same {mixed['budget']} steps" if isinstance(mixed["budget"], int)
                else f"the same {mixed['training_seconds']:.0f} s")
        lines = [f"{mixed['name']} trained {_as_fast(ratio)} in {same} ({why}); validation loss "
                 f"{mixed['final_eval_loss']:.3f} against fp32's {fp32['final_eval_loss']:.3f}, peak memory "
                 f"{mixed['peak_memory_mb']:.0f} MB against {fp32['peak_memory_mb']:.0f} MB"]
        if ratio < 1.1:
            lines.append("  (a small model's casts can cost what its matrix products save: the 16-bit speed-up grows "
                         "with the model; " + "; ".join(native_figures) + ")")
        return lines
    ratio = step_ratio(fp32, mixed)
    how = f"{ratio:.1f}x slower" if ratio >= 1 else f"{1 / ratio:.1f}x faster"
    return [f"{mixed['name']} ran {how} than fp32 here, step for step: a median step of "
            f"{1000 * mixed['median_step_seconds']:.0f} ms against {1000 * fp32['median_step_seconds']:.1f} ms, the "
            f"same {mixed['steps']} steps in {mixed['training_seconds']:.1f} s against {fp32['training_seconds']:.1f} s "
            f"of training ({why})",
            "where 16-bit is native, it is the fast path: " + "; ".join(native_figures)]


def _pow2(x: float) -> str:
    e = math.log2(x)
    return f"2^{e:g}" if e == int(e) else f"{x:g}"


def lesson_lines(lesson: Mapping[str, Run]) -> tuple[list[str], list[str]]:
    """Lessons 2 and 3: fp16's range, and what flushed to zero without the loss scale and with it,
    and what that did to the loss, against fp32 (``lesson``: ``"fp32"``, ``"fp16-mixed"``,
    ``"fp16-unscaled"`` -> their results). Returns the lines before the runs' table and after it."""
    fp32, scaled, bare = lesson["fp32"], lesson["fp16-mixed"], lesson["fp16-unscaled"]
    f16 = FORMAT_LIMITS["fp16"]
    tokens, batch = scaled["step_tokens"], scaled["batch_tokens"]
    lines = [f"2. fp16's range is narrow: from {f16.smallest_subnormal:.1e} (2^-24) to {f16.max:g}; below "
             f"{_pow2(f16.flush_threshold)} a value flushes to 0, below {_pow2(f16.smallest_normal)} it keeps fewer "
             f"bits (fp32 and bf16 reach {_pow2(FORMAT_LIMITS['bf16'].smallest_normal)})",
             f"3. Underflow: fp32, and fp16 without and with loss scaling, the same {scaled['steps']} steps on "
             f"pycode/{scaled['size']}, each step's loss averaged over {tokens:,} tokens as in a GPT-2-sized "
             f"step of pretraining"]
    if tokens > batch:
        lines.append(f"   (averaged over the batch's own {batch:,} tokens, the gradients are {tokens // batch:,}x "
                     "larger and fit fp16 without a scale: a few minutes of CPU training cannot show underflow "
                     "otherwise; benchmarks/RESULTS.md)")
    intro, lines = lines, []
    gap = bare["final_eval_loss"] / fp32["final_eval_loss"] - 1
    g_bare, g_scaled, g_fp32 = bare.get("grads"), scaled.get("grads"), fp32.get("grads")
    lost = (f"{g_bare['zero']:.1%} of its gradient values were 0 (fp32's: {g_fp32['zero']:.2%}; layer "
            f"`{g_bare['worst_module']}`: {g_bare['worst_module_lost']:.0%}), and " if g_bare and g_fp32 else "")
    lines.append(f"   fp16 without loss scaling: {lost}its validation loss ended at {bare['final_eval_loss']:.3f} "
                 f"against fp32's {fp32['final_eval_loss']:.3f} ({gap:+.1%})")
    gap = scaled["final_eval_loss"] / fp32["final_eval_loss"] - 1
    kept = (f"{g_scaled['flush']:.1%} of the gradient values lie below fp16's flush threshold as they are, "
            f"{g_scaled['flush_at_scale']:.2%} times the loss scale, and " if g_scaled else "")
    lines.append(f"   fp16 with loss scaling: {kept}its validation loss ended at {scaled['final_eval_loss']:.3f} "
                 f"({gap:+.1%})")
    return intro, lines


def scale_lines(run: Run, growth_interval: int) -> list[str]:
    """Lesson 4, the loss scale at work: how it grew and backed off in this run, and which setting
    made it move."""
    history = run.get("scale_history") or []
    if not history:
        return []
    scales = [s for _, s, _ in history]
    grew = sum(b > a for a, b in zip(scales, scales[1:]))
    skipped = [st for st, _, k in history if k]
    backed = (f"halved {len(skipped)} times on overflow, skipping each such step (the first at step "
              f"{skipped[0]})" if skipped else "never overflowed, so never halved")
    first = (run.get("grads") or {}).get("first")
    already = (f" ({first['flush_at_scale']:.2%} of the gradient values were still below the flush threshold at "
               f"{_pow2(first['scale'])}, step {first['step']})" if first else "")
    return [f"4. Loss scaling: the loss is multiplied by the scale before backward and the gradients divided by "
            f"it after; the scale went from {_pow2(scales[0])} to {_pow2(max(scales))} and ended at "
            f"{_pow2(scales[-1])}: doubled {grew} times, each after {growth_interval} clean steps, and {backed}",
            f"   the growth interval is {growth_interval} here, so that the scale moves within the demo's few hundred "
            f"steps; a real run keeps torch's 2000: torch's first scale, 2^16, already lifts nearly every gradient "
            f"clear of the flush threshold{already}, and growing every 2000 steps costs at most one skipped step "
            f"in 2000, not one in {growth_interval}"]


def conclusion(speed: Sequence[Run], raced: bool, lesson: Mapping[str, Run] | None, native: str) -> list[str]:
    """The lesson's conclusion, in two or three lines with this run's numbers: printed last
    (``native``: what makes 16-bit fast here, or why it is not)."""
    fp32, mixed = speed if len(speed) == 2 else (speed[0], None)
    if mixed is None:
        lines = ["In this run fp32 trained alone (--precision fp32)."]
    elif raced:
        lines = [f"In this run {mixed['name']} trained "
                 f"{_as_fast(mixed['tokens_per_second'] / fp32['tokens_per_second'])} ({native})."]
    else:
        ratio = step_ratio(fp32, mixed)
        how = f"{ratio:.1f}x slower" if ratio >= 1 else f"{1 / ratio:.1f}x faster"
        lines = [f"In this run {mixed['name']} ran {how} than fp32, step for step ({native}): 16-bit's speed "
                 "needs hardware that has it."]
    if lesson:
        bare, scaled, ref = lesson["fp16-unscaled"], lesson["fp16-mixed"], lesson["fp32"]
        lost = f" lost {bare['grads']['zero']:.0%} of its gradient values to zero and" if bare.get("grads") else ""
        gap = bare["final_eval_loss"] / ref["final_eval_loss"] - 1
        scales = [s for _, s, _ in scaled.get("scale_history") or []]
        backed = f", backing off {scaled['skipped_steps']} times" if scaled["skipped_steps"] else ""
        moved = f" (grown from {_pow2(scales[0])} to {_pow2(max(scales))}{backed})" if scales else ""
        lines += [f"fp16 without loss scaling{lost} ended {gap:+.0%} from fp32's loss ({bare['final_eval_loss']:.3f} "
                  f"against {ref['final_eval_loss']:.3f});",
                  f"with the loss scale{moved} it kept them and ended at {scaled['final_eval_loss']:.3f}."]
    return lines
