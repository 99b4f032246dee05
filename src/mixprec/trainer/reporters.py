"""What shows and records a run: the progress bar, printer, ``metrics.jsonl`` and TensorBoard callbacks,
and Hugging Face's ``log_metrics`` / ``save_metrics`` output."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from mixprec.trainer.callbacks import TrainerCallback
from mixprec.trainer.nonfinite import describe_steps

__all__ = ["ProgressCallback", "PrinterCallback", "JsonlLoggerCallback", "TensorBoardCallback", "TrackerCallback",
           "format_metrics",
           "print_metrics", "write_metrics"]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


class _LogLines:
    """What tqdm writes to when stderr is a log, a pipe or CI's console rather than a terminal.

    On a terminal tqdm redraws its bar in place after a carriage return; in a log every redraw
    stays, run together on one line. Here each redraw becomes one line of its own, and the bar's
    ``mininterval`` keeps them ``ProgressCallback(log_interval=...)`` seconds apart.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()  # tqdm pads a shorter frame with spaces to cover the last
        if line:
            self._stream.write(line + "\n")

    def flush(self) -> None:
        self._stream.flush()


def _bar_options(stream: Any, log_interval: float) -> dict[str, Any]:
    """tqdm's options for ``stream``: a bar redrawn in place on a terminal (or a notebook's widget),
    one line every ``log_interval`` seconds anywhere else."""
    from tqdm.autonotebook import tqdm as shown_bar
    from tqdm.std import tqdm as text_bar

    isatty = getattr(stream, "isatty", None)
    if shown_bar is not text_bar or (isatty is not None and isatty()):
        return {"file": stream, "dynamic_ncols": True}
    return {"file": _LogLines(stream), "mininterval": log_interval, "ncols": 100}


class ProgressCallback(TrainerCallback):
    """A tqdm bar over optimizer steps, showing loss, learning rate, loss scale and skipped steps.

    On a terminal the bar is redrawn in place. When stderr is not a terminal (a log file, a pipe,
    a CI console) it prints one line every ``log_interval`` seconds instead of a frame per step.
    Skipped steps are summarised once per log, by number ("3 steps skipped for overflow (inf/NaN
    gradients) since the last log: steps 3, 4, 9; scale 2048"), never one line per step.

    Args:
        max_str_len: longer string values of a log are shown as a note of their length
            (transformers' argument of this name).
        log_interval: seconds between the bar's lines when stderr is not a terminal.

    Example:
        >>> trainer.remove_callback(ProgressCallback)  # doctest: +SKIP
        >>> trainer.add_callback(ProgressCallback(log_interval=30.0))  # a line every 30 s in a log  # doctest: +SKIP
    """

    def __init__(self, max_str_len: int = 100, log_interval: float = 5.0) -> None:
        self.max_str_len = max_str_len
        self.log_interval = log_interval
        self.training_bar = None
        self.prediction_bar = None  # transformers' evaluation bar: mixprec shows none
        self._skipped_at_last_log = 0

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            from tqdm.auto import tqdm

            self.training_bar = tqdm(total=state.max_steps, initial=state.global_step, desc="train",
                            **_bar_options(sys.stderr, self.log_interval))
            self._skipped_at_last_log = state.skipped_steps

    def on_step_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            self.training_bar.update(state.global_step - self.training_bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.training_bar is None or not logs:
            return
        shown = {k: logs[k] for k in ("loss", "learning_rate", "loss_scale", "skipped_steps") if k in logs}
        self.training_bar.set_postfix({k: _fmt(v) for k, v in shown.items()}, refresh=False)
        at = logs.get("skipped_steps_at")
        new = len(at) if at is not None else state.skipped_steps - self._skipped_at_last_log
        if new > 0:
            self.training_bar.write(f"{new} step{'s' if new > 1 else ''} skipped for overflow (inf/NaN gradients) since the "
                           f"last log{': ' + describe_steps(at) if at else ''}; scale {state.loss_scale:g}")
        self._skipped_at_last_log = state.skipped_steps
        if any(k.startswith("eval_") for k in logs):
            self.training_bar.write(" ".join(f"{k}={self._shown(v)}" for k, v in logs.items()))

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        # An evaluation inside training can take longer than many steps: say so on the bar (a line
        # of its own in a log), where transformers opens a second bar.
        if self.training_bar is not None and self.training_bar.desc != "train (evaluating)":
            self.training_bar.set_description_str("train (evaluating)", refresh=True)

    def on_evaluate(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            self.training_bar.set_description_str("train", refresh=False)

    def _shown(self, value: Any) -> str:
        if isinstance(value, str) and len(value) > self.max_str_len:
            return f"[String too long to display, length: {len(value)} > {self.max_str_len}]"
        return _fmt(value)

    def on_train_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            self.training_bar.close()
            self.training_bar = None


class PrinterCallback(TrainerCallback):
    """Print every log (the Trainer's progress display when ``disable_tqdm=True``)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_local_process_zero and logs:
            print({k: _fmt(v) if isinstance(v, float) else v for k, v in logs.items() if k != "total_flos"})


class JsonlLoggerCallback(TrainerCallback):
    """Append every log (training and evaluation) as one JSON line to ``output_dir/metrics.jsonl``."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        path = Path(args.output_dir) / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        row = {"step": state.global_step, "epoch": state.epoch, **logs}
        with open(path, "a") as fh:
            fh.write(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                 for k, v in row.items()}) + "\n")


def trim_logs_after(output_dir: str | Path, step: int) -> None:
    """Drop the rows of ``output_dir/metrics.jsonl`` logged after ``step`` (by a run that died after
    its last checkpoint, whose steps a resume replays), so each step is there once. Atomic."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines(keepends=True)
            if line.strip() and json.loads(line).get("step", 0) <= step]
    tmp = path.with_name(".metrics.jsonl.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


class TensorBoardCallback(TrainerCallback):
    """Write every numeric log value to TensorBoard via ``torch.utils.tensorboard``."""

    #: On a resume, the first step the new events hold: TensorBoard drops the older events from it on.
    purge_step: int | None = None

    def __init__(self) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # tensorboard is an optional dependency
            raise ImportError("report_to='tensorboard' needs the tensorboard package: pip install tensorboard, "
                              "or set report_to='jsonl'") from e
        self._writer_cls = SummaryWriter
        self.writer = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if self.writer is None:
            self.writer = self._writer_cls(log_dir=str(Path(args.output_dir) / "runs"), purge_step=self.purge_step)
        for k, v in logs.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                tag = k.replace("eval_", "eval/", 1) if k.startswith("eval_") else f"train/{k}"
                self.writer.add_scalar(tag, v, state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None


class TrackerCallback(TrainerCallback):
    """Log to the trackers ``report_to`` names beyond mixprec's own (``wandb``, ``mlflow``,
    ``comet_ml``, ``aim``, ``clearml``, ``dvclive``, ``swanlab``, ``trackio``), through
    :mod:`mixprec.tracking`, on the main process: started at ``on_train_begin`` with the arguments
    as the run's configuration (named ``run_name``, else the output folder's name; files under
    ``output_dir/runs`` for the trackers that write to a folder), every numeric log value at its
    step, finished at ``on_train_end``. Each tracker's own settings (``WANDB_MODE=offline``,
    ``MLFLOW_TRACKING_URI``, ...) come from its environment variables, as with transformers."""

    def __init__(self, names: list[str]) -> None:
        self.names = list(names)
        self.trackers: list[Any] = []

    def on_train_begin(self, args, state, control, **kwargs):
        from mixprec.tracking.registry import resolve_log_with, start_trackers

        if not state.is_world_process_zero or self.trackers:
            return
        logging_dir = str(Path(args.output_dir) / "runs")
        config = args.to_sanitized_dict() if hasattr(args, "to_sanitized_dict") else None
        self.trackers = start_trackers(resolve_log_with(self.names, logging_dir),
                                       args.run_name or Path(args.output_dir).name, logging_dir, config,
                                       is_main_process=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        values = {k: v for k, v in (logs or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for tracker in self.trackers:
            tracker.log(values, step=state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        from mixprec.tracking.registry import finish_trackers

        trackers, self.trackers = self.trackers, []
        finish_trackers(trackers)


def format_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics made readable: runtimes as ``h:mm:ss.ss``, memory in MB, other floats to 4 digits."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if k.endswith("_runtime") and isinstance(v, (int, float)):
            h, rest = divmod(float(v), 3600)
            m, s = divmod(rest, 60)
            out[k] = f"{int(h)}:{int(m):02d}:{s:05.2f}"
        elif k.endswith("_mem_") and isinstance(v, (int, float)):
            out[k] = f"{int(v) >> 20}MB"
        elif isinstance(v, float):
            out[k] = round(v, 4)
        else:
            out[k] = v
    return out


def print_metrics(split: str, metrics: dict[str, Any]) -> None:
    """Print ``***** {split} metrics *****`` and one aligned ``key = value`` line per metric."""
    shown = format_metrics(metrics)
    width = max((len(k) for k in shown), default=0)
    print(f"***** {split} metrics *****")
    for k in sorted(shown):
        print(f"  {k:<{width}} = {shown[k]:>9}")


def write_metrics(output_dir: str | Path, split: str, metrics: dict[str, Any], combined: bool = True) -> Path:
    """Write ``{split}_results.json`` (``all_results.json`` for ``split="all"``) and, with
    ``combined``, merge the metrics into ``all_results.json``; returns the split's file."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
    path = out / ("all_results.json" if split == "all" else f"{split}_results.json")
    path.write_text(json.dumps(clean, indent=4, sort_keys=True) + "\n")
    if combined and split != "all":
        everything = out / "all_results.json"
        merged = json.loads(everything.read_text()) if everything.is_file() else {}
        merged.update(clean)
        everything.write_text(json.dumps(merged, indent=4, sort_keys=True) + "\n")
    return path
