"""The Trainer's way out: the model's weights and arguments, its state, and its metrics files,
as Hugging Face's Trainer writes them (a mixin of :class:`~mixprec.Trainer`, whose state it reads)."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch

from mixprec.trainer.callbacks import log
from mixprec.trainer.reporters import format_metrics, print_metrics, write_metrics

__all__ = ["ExportAPI"]


class ExportAPI:
    """``save_model``, ``save_state``, ``log_metrics``, ``save_metrics``, ``metrics_format``."""

    # -- models out ------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> Path:
        """Save the model's weights (safetensors; ``save_pretrained`` for Hugging Face models) and
        the arguments (``training_args.json``, and ``training_args.bin`` as Hugging Face writes it)."""
        out = Path(output_dir or self.args.output_dir)
        model = self.accelerator.unwrap_model(self.model)
        if hasattr(model, "save_pretrained") and hasattr(model, "config"):
            if self.accelerator.is_main_process:
                model.save_pretrained(str(out), safe_serialization=True)
            self.accelerator.wait_for_everyone()
        else:
            self.accelerator.save_model(model, out)
        if self.accelerator.is_main_process:
            self.args.to_json_file(out / "training_args.json")
            if args_bin := self._args_bin():
                (out / "training_args.bin").write_bytes(args_bin)
            if hasattr(self.processing_class, "save_pretrained"):  # the tokenizer beside the model, as in HF
                self.processing_class.save_pretrained(str(out))
        return out

    def save_state(self) -> None:
        """Write ``trainer_state.json`` into ``output_dir`` (main process only), as Hugging Face does."""
        if self.accelerator.is_main_process:
            Path(self.args.output_dir).mkdir(parents=True, exist_ok=True)
            self.state.save_to_json(Path(self.args.output_dir) / "trainer_state.json")

    def log_metrics(self, split: str, metrics: dict[str, Any]) -> None:
        """Print ``metrics`` readably under ``***** {split} metrics *****`` (main process only)."""
        if self.accelerator.is_main_process:
            print_metrics(split, metrics)

    def save_metrics(self, split: str, metrics: dict[str, Any], combined: bool = True) -> None:
        """Write ``output_dir/{split}_results.json`` (and merge into ``all_results.json``)."""
        if self.accelerator.is_main_process:
            write_metrics(self.args.output_dir, split, metrics, combined)

    def metrics_format(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """``metrics`` made readable (runtimes as h:mm:ss, floats to 4 digits)."""
        return format_metrics(metrics)

    def _args_bin(self) -> bytes:
        """``training_args.bin``: the arguments pickled with ``torch.save``, as Hugging Face writes them
        (for tools that read them back; mixprec itself never unpickles it)."""
        buf = io.BytesIO()
        try:
            torch.save(self.args, buf)
        except (pickle.PicklingError, AttributeError, TypeError) as e:  # e.g. a subclass defined in a function
            log.warning(f"training_args.bin not written: the arguments cannot be pickled ({e}); "
                        "training_args.json holds them")
            return b""
        return buf.getvalue()
