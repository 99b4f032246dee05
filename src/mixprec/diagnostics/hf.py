"""mixprec's diagnostics for the Hugging Face Trainer, without switching trainers.

    from transformers import Trainer
    from mixprec.diagnostics.hf import DiagnosticsCallback

    trainer = Trainer(..., callbacks=[DiagnosticsCallback(every_n_steps=50, trace_overflow=True)])

Every observed step appends one line to ``output_dir/diagnostics.jsonl``: the worst fp16
flush-to-zero fraction per module (with and without a loss scale of ``2**16``, the Hugging Face
Trainer's starting scale) and the module the tracer names for the first overflow.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mixprec.diagnostics.gradient_stats import GradientStats
from mixprec.diagnostics.tracer import OverflowTracer

__all__ = ["DiagnosticsCallback"]


def DiagnosticsCallback(every_n_steps: int = 50, trace_overflow: bool = False, loss_scale: float = 2.0**16) -> Any:  # noqa: N802
    """A ``transformers.TrainerCallback`` running mixprec's gradient statistics and overflow tracer.

    Gradients are observed in ``on_pre_optimizer_step``: after the Hugging Face Trainer's
    gradient clipping, which unscales fp16 gradients first, so they are the true values (with
    ``max_grad_norm=0`` and fp16 they would still carry the scale: keep clipping on).

    Args:
        every_n_steps: observe every N optimizer steps.
        trace_overflow: hook every module to name the first one that overflows.
        loss_scale: the scale the "at scale" statistics assume.

    Raises:
        ImportError: when ``transformers`` is not installed.
    """
    try:
        import transformers
    except ImportError as e:
        raise ImportError("DiagnosticsCallback is for the Hugging Face Trainer: pip install transformers") from e

    class _Callback(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.stats: GradientStats | None = None
            self.tracer: OverflowTracer | None = None

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.stats = GradientStats(model, every_n_steps=every_n_steps, scale_source=loss_scale)
            self.tracer = OverflowTracer(model, enabled=trace_overflow)

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if self.stats is not None:
                self.stats.observe(state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            if self.stats is None:
                return
            event = self.tracer.end_step(state.global_step) if self.tracer.enabled else None
            observed = (state.global_step - 1) % every_n_steps == 0
            if not (observed or event) or not state.is_world_process_zero:
                return
            row: dict[str, Any] = {"step": state.global_step}
            summary = self.stats.summary()
            self.stats.clear()
            if summary:
                row["fp16_flush"] = {m: round(v["fp16_flush_unscaled"], 6) for m, v in summary.items()}
                row["fp16_flush_at_scale"] = {m: round(v["fp16_flush_at_scale"], 6) for m, v in summary.items()}
            if event is not None:
                row["overflow"] = {"module": event.module_path, "kind": event.kind, "dtype": event.dtype,
                                   "max_abs": event.max_abs}
            path = Path(args.output_dir) / "diagnostics.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as fh:
                fh.write(json.dumps(row, allow_nan=True) + "\n")

        def on_train_end(self, args, state, control, **kwargs):
            if self.tracer is not None:
                self.tracer.remove()

    return _Callback()
