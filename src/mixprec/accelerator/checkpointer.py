"""The Accelerator's checkpoints and exported weights, under Hugging Face Accelerate's names.

``save_state`` / ``load_state`` (everything needed to continue bit for bit, written atomically,
verified before it is read; sharded models through ``torch.distributed.checkpoint``, in the
background with ``async_save``), their pre-hooks, ``register_for_checkpointing``, and the model
out: ``unwrap_model``, ``get_state_dict`` (gathered whole from shards) and ``save_model``
(consolidated safetensors). A mixin of :class:`~mixprec.Accelerator`, whose state it reads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from mixprec.accelerator.state_files import (
    load_accelerator_state,
    resolve_load_dir,
    resolve_save_dir,
    save_accelerator_state,
    save_model_weights,
)
from mixprec.accelerator.wrappers import unpatch_forward, unwrap, unwrap_keeping_compile
from mixprec.distributed.fsdp import full_state_dict, is_sharded

__all__ = ["CheckpointAPI"]


class CheckpointAPI:
    """Mixin: checkpoints in and out, and the trained model out."""

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore these objects (anything with ``state_dict``/``load_state_dict``) in ``save_state``.

        Raises:
            ValueError: listing every object (by its index) that has no ``state_dict``/``load_state_dict``.
        """
        bad = [f"- Item at index {i}, `{type(obj).__name__}`" for i, obj in enumerate(objects)
               if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"))]
        if bad:
            raise ValueError("All `objects` must include a `state_dict` and `load_state_dict` function to be stored; "
                             "these do not (wrap a tensor in a torch.nn.Module, or register an object that has "
                             "both):\n" + "\n".join(bad))
        self.prepared.custom.extend(objects)

    # -- models out ---------------------------------------------------------------------
    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> torch.nn.Module:
        """The user's module without the DDP wrapper; with ``keep_torch_compile=True`` (Accelerate's
        default) a compiled model stays compiled around it, and with ``keep_fp32_wrapper=False``
        its forward loses the precision's autocast."""
        model = unwrap_keeping_compile(model) if keep_torch_compile else unwrap(model)
        if not keep_fp32_wrapper:
            unpatch_forward(unwrap(model))
        return model

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The model's ``state_dict`` (of the user's module, without wrapper prefixes, when ``unwrap``).

        A sharded model's is gathered whole onto the CPU of every rank (call it on every rank).
        """
        inner = self.unwrap_model(model, keep_torch_compile=False)
        if is_sharded(inner):
            return full_state_dict(inner)
        return (inner if unwrap else model).state_dict()

    def save_model(self, model: torch.nn.Module, save_directory: str | os.PathLike, max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> Path:
        """Write the model's weights into ``save_directory`` (main process only), atomically.

        ``model.safetensors``, or ``pytorch_model.bin`` with ``safe_serialization=False`` (tensors
        only: it loads with ``torch.load(weights_only=True)``); above ``max_shard_size`` (bytes,
        or ``"500MB"``, ``"10GB"``) the weights are split into numbered shards with an index, in
        the layout ``transformers``' and Accelerate's loaders read.
        """
        path = Path(save_directory)
        inner = unwrap(model)
        full = full_state_dict(inner) if is_sharded(inner) else None  # every rank takes part in the gather
        if self.is_main_process:
            save_model_weights(inner, path, max_shard_size=max_shard_size, safe_serialization=safe_serialization,
                               state=full)
        self.wait_for_everyone()
        return path

    # -- checkpoints -------------------------------------------------------------------
    def register_save_state_pre_hook(self, hook: Any) -> Any:
        """Call ``hook(models, weights, output_dir)`` before :meth:`save_state` writes.

        ``weights`` are the models' state dicts; removing one from the list (with its model)
        leaves that model to the hook. Files the hook writes into ``output_dir`` join the same
        atomic write. Returns a handle whose ``remove()`` unregisters the hook.
        """
        return self._state_hooks.add_save(hook)

    def register_load_state_pre_hook(self, hook: Any) -> Any:
        """Call ``hook(models, input_dir)`` before :meth:`load_state` reads; removing a model from
        the list leaves its weights to the hook. Returns a handle whose ``remove()`` unregisters it."""
        return self._state_hooks.add_load(hook)

    def save_state(self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True, *,
                   extra_files: dict[str, str | bytes] | None = None, async_save: bool = False) -> Path:
        """Write everything needed to continue bit for bit into ``output_dir``, atomically.

        Model weights as safetensors (whatever ``safe_serialization`` says: the checkpoint is read
        back only by :meth:`load_state`); optimizer, scheduler, scaler, dataloader positions and
        RNG states (one file per process) with ``torch.save``; a manifest with sizes and sha256.
        The folder appears only when complete. Without ``output_dir``, a project configuration
        with ``automatic_checkpoint_naming`` names it ``checkpoints/checkpoint_<i>`` and, with
        ``total_limit``, deletes the oldest once the new one is complete. ``extra_files`` (name ->
        text or bytes) join the same atomic write (the Trainer puts ``trainer_state.json`` there).
        An iteration left open (an optimizer stepped, another not yet) is closed first.

        With ``async_save=True`` the models and optimizers are written by
        ``torch.distributed.checkpoint``'s asynchronous save: the call returns once they are copied
        to CPU memory, the files are written in the background, and the folder still appears only
        when complete (:meth:`wait_for_checkpoint` waits for it; the next save, ``load_state`` and
        ``end_training`` do so themselves).
        """
        self.wait_for_checkpoint()  # one checkpoint in flight at a time
        final = resolve_save_dir(output_dir, self.project_configuration)
        self.precision.finish_iteration()
        meta = {"step": self.step, "precision": self.policy.name, "optimizer_steps": self.optimizer_steps,
                "precision_fallback": bool(self.precision_fallbacks)}
        automatic = output_dir is None and self.project_configuration.automatic_checkpoint_naming
        project = self.project_configuration
        group = None
        if async_save and self.use_distributed:
            if self._async_group is None:  # background writes coordinate on their own gloo group
                self._async_group = torch.distributed.new_group(backend="gloo")
            group = self._async_group
        self._pending_save = save_accelerator_state(
            final, self.prepared, self._process, self.precision.state_dict(), meta, extra_files or {},
            hooks=self._state_hooks, sharded=self.fsdp_plugin is not None or async_save, asynchronous=async_save,
            process_group=group, after_commit=(lambda: self._state_hooks.rotate(project)) if automatic else None)
        if automatic:
            project.iteration += 1
        return final

    def wait_for_checkpoint(self) -> Path | None:
        """Block until the checkpoint being written in the background (``async_save``) is in place;
        returns its folder (``None`` if none was pending). Raises what made it fail."""
        pending, self._pending_save = self._pending_save, None
        return pending.wait() if pending is not None else None

    def load_state(self, input_dir: str | os.PathLike | None = None, **load_kwargs: Any) -> None:
        """Restore what :meth:`save_state` wrote, after verifying every file against the manifest.

        Without ``input_dir``, the newest automatically named checkpoint of the project. A
        dataloader resumes at the start of the epoch that was running (the loop skips what it
        has seen, e.g. with :meth:`skip_first_batches`), or, with
        ``DataLoaderConfiguration(use_stateful_dataloader=True)``, at the next unseen batch.

        Raises:
            FileNotFoundError: no checkpoint folder there (a :class:`~mixprec.CheckpointError`).
            CheckpointError: naming the file that is missing, truncated, altered, or that holds
                anything but tensors (nothing in it is run).
        """
        self.wait_for_checkpoint()
        path = resolve_load_dir(input_dir, self.project_configuration)
        meta, precision_state = load_accelerator_state(path, self.prepared, self._process, self.device,
                                                       hooks=self._state_hooks)
        if meta.get("precision_fallback") and meta["precision"] != self.policy.name:
            self._switch_precision(meta["precision"])  # the run had fallen back: keep it so
            self.precision_fallbacks.append({"step": meta.get("optimizer_steps", 0), "to": meta["precision"]})
        self.precision.load_state_dict(precision_state)
        self.audit.scaler_loaded(self.precision.state_dict(), precision_state, enabled=self.scaler is not None)
        self.step = int(meta["step"])
        self.optimizer_steps = int(meta.get("optimizer_steps", 0))
