"""The Trainer's way out: the model's weights and arguments as Hugging Face's Trainer writes them
(``Trainer.save_model`` calls :func:`save_model_files` with what it holds)."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch

from mixprec.trainer.adapters import is_peft_model, save_adapter
from mixprec.trainer.callbacks import log
from mixprec.trainer.checkpoints import MAX_SHARD_SIZE

__all__ = ["args_bin", "save_model_files", "write_model_card"]


def save_model_files(accelerator: Any, model: torch.nn.Module, args: Any, processing_class: Any, out: Path) -> Path:
    """Save ``model``'s weights into ``out`` as transformers' Trainer does (a Hugging Face model's
    through ``save_pretrained``: its config, and ``model.safetensors`` or shards with their index
    above its ``max_shard_size``; a plain module's ``model.safetensors``; with
    ``args.save_safetensors=False``, ``pytorch_model.bin``; a peft model's adapter, as its
    ``save_pretrained`` writes it), the arguments (``training_args.json``,
    and ``training_args.bin`` as Hugging Face writes it) and the tokenizer or processor beside
    them. Every process calls it."""
    model = accelerator.unwrap_model(model)
    safe = getattr(args, "save_safetensors", True)
    if is_peft_model(model):  # the adapter alone (adapter_model.bin without safetensors), as transformers saves it
        if accelerator.is_main_process:
            save_adapter(model, out, safe)
        accelerator.wait_for_everyone()
    elif hasattr(model, "save_pretrained") and hasattr(model, "config") and safe:
        if accelerator.is_main_process:
            model.save_pretrained(str(out))
        accelerator.wait_for_everyone()
    else:
        accelerator.save_model(model, out, max_shard_size=MAX_SHARD_SIZE, safe_serialization=safe)
        if accelerator.is_main_process and hasattr(getattr(model, "config", None), "save_pretrained"):
            model.config.save_pretrained(str(out))  # from_pretrained(out) loads the .bin with it
    if accelerator.is_main_process:
        args.to_json_file(out / "training_args.json")
        if pickled := args_bin(args):
            (out / "training_args.bin").write_bytes(pickled)
        if hasattr(processing_class, "save_pretrained"):  # the tokenizer beside the model, as in HF
            processing_class.save_pretrained(str(out))
    return out


def args_bin(args: Any) -> bytes:
    """``training_args.bin``: the arguments pickled with ``torch.save``, as Hugging Face writes them
    (for tools that read them back; mixprec itself never unpickles it). ``b""`` where they cannot be."""
    buf = io.BytesIO()
    try:
        torch.save(args, buf)
    except (pickle.PicklingError, AttributeError, TypeError) as e:  # e.g. a subclass defined in a function
        log.warning(f"training_args.bin not written: the arguments cannot be pickled ({e}); "
                    "training_args.json holds them")
        return b""
    return buf.getvalue()


def _listed(value: Any) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def write_model_card(trainer: Any, *, language: Any = None, license: str | None = None, tags: Any = None,
                     model_name: str | None = None, finetuned_from: str | None = None, tasks: Any = None,
                     dataset_tags: Any = None, dataset: Any = None, dataset_args: Any = None) -> Path:
    """``trainer.args.output_dir/README.md``: a draft model card (YAML metadata, then the
    hyperparameters, the evaluation results logged and the versions), as transformers' Trainer
    drafts one."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("mixprec")
    except PackageNotFoundError:  # run from a source tree without installing
        ours = "(source tree)"
    args, state = trainer.args, trainer.state
    name = model_name or Path(args.output_dir).name
    meta = {"language": _listed(language), "license": license, "tags": ["generated_from_trainer", "mixprec",
                                                                       *_listed(tags)],
            "base_model": finetuned_from, "datasets": _listed(dataset_tags) or _listed(dataset),
            "pipeline_tag": (_listed(tasks) or [None])[0]}
    lines = ["---"]
    for key, value in meta.items():
        if value:
            lines += [f"{key}:"] + [f"- {v}" for v in value] if isinstance(value, list) else [f"{key}: {value}"]
    lines += ["---", "", f"# {name}", ""]
    about = f"This model is a fine-tuned version of {finetuned_from}" if finetuned_from else "This model was trained"
    on = ", ".join(_listed(dataset)) + (f" ({', '.join(_listed(dataset_args))})" if dataset_args else "")
    lines += [about + (f" on {on}." if on else " on an unknown dataset."), ""]
    hyper = {"learning_rate": args.learning_rate, "train_batch_size": args.train_batch_size,
             "eval_batch_size": args.eval_batch_size, "seed": args.seed,
             "gradient_accumulation_steps": args.gradient_accumulation_steps,
             "total_train_batch_size": trainer.get_total_train_batch_size(args), "optimizer": args.optim,
             "lr_scheduler_type": args.lr_scheduler_type, "warmup_steps": args.warmup_steps,
             "training_steps" if args.max_steps > 0 else "num_epochs":
                 args.max_steps if args.max_steps > 0 else args.num_train_epochs,
             "precision": trainer.accelerator.policy.name}
    lines += ["## Training hyperparameters", ""] + [f"- {k}: {v}" for k, v in hyper.items()] + [""]
    evals = [row for row in state.log_history if any(k.endswith("_loss") and k != "train_loss" for k in row)]
    if evals:
        keys = sorted({k for row in evals for k in row if k.startswith("eval_") and not k.endswith(
            ("_runtime", "_per_second"))})
        lines += ["## Training results", "", "| Step | Epoch | " + " | ".join(keys) + " |",
                  "|---|---|" + "---|" * len(keys)]
        for row in evals:
            cells = [f"{row[k]:.4g}" if isinstance(row.get(k), float) else str(row.get(k, "")) for k in keys]
            lines.append(f"| {row.get('step', '')} | {row.get('epoch', '')} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Framework versions", "", f"- mixprec {ours}", f"- PyTorch {torch.__version__}", ""]
    path = Path(args.output_dir) / "README.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path
