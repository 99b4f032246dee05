"""The run's results written for people and scripts: ``log_metrics``, ``save_metrics``, as Hugging Face's."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["format_metrics", "print_metrics", "write_metrics"]


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
