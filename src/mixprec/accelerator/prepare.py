"""The Accelerator's ``prepare``: models, optimizers, schedulers and dataloaders made ready for
the precision, the device and the processes (Hugging Face Accelerate's names).

A model is moved to the device, converted for the precision (bf16 parameters for bf16-true),
given the precision's forward, observed by the precision audit and the diagnostics, and sharded
with FSDP2 or wrapped in DDP; an optimizer is pointed at the sharded parameters and wrapped so
its step goes through the precision plugin; a scheduler steps only when its optimizer's step was
applied; a dataloader is sharded over the processes and resumable. :class:`Preparer` is a part
the Accelerator holds; everything it uses is given to it when it is made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader

from mixprec.accelerator.audit import PrecisionAudit, recording_ddp_hook
from mixprec.accelerator.configs import DataLoaderConfiguration
from mixprec.accelerator.state import AcceleratorState, GradientState
from mixprec.accelerator.stepping import OptimizerSteps
from mixprec.accelerator.wrappers import (
    AcceleratedOptimizer,
    AcceleratedScheduler,
    OptimizerHooks,
    PreparedDDP,
    patch_forward,
    repoint_forward,
)
from mixprec.data import IterableLoader, PreparedDataLoader
from mixprec.diagnostics.monitor import DiagnosticsConfig, Monitor
from mixprec.distributed import groups as D
from mixprec.distributed.fsdp import FullyShardedDataParallelPlugin, shard_model
from mixprec.precision import PrecisionPlugin

__all__ = ["PreparedObjects", "Preparer"]


@dataclass
class PreparedObjects:
    """Everything ``prepare`` returned that a checkpoint holds, in the order it was prepared.

    ``custom`` are the objects given to ``register_for_checkpointing``.
    """

    models: list[torch.nn.Module] = field(default_factory=list)
    optimizers: list[Any] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    dataloaders: list[Any] = field(default_factory=list)
    custom: list[Any] = field(default_factory=list)

    def stateful(self) -> dict[str, list[Any]]:
        """The objects saved with their own ``state_dict()``, by the file name they are saved under."""
        return {"optimizer": self.optimizers, "scheduler": self.schedulers, "dataloader": self.dataloaders,
                "custom": self.custom}

    def clear(self) -> None:
        """Forget every object (``Accelerator.free_memory``)."""
        for objects in (self.models, self.optimizers, self.schedulers, self.dataloaders, self.custom):
            objects.clear()


def _kind(obj: Any) -> str | None:
    """What ``prepare`` makes of ``obj``: an optimizer is checked before the scheduler duck type
    (a prepared optimizer also has ``step`` and an ``.optimizer``)."""
    if isinstance(obj, torch.nn.Module):
        return "model"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, DataLoader):
        return "dataloader"
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or (
            hasattr(obj, "step") and isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer)):
        return "scheduler"
    return None


class Preparer:
    """``prepare`` and its parts, for one Accelerator (see :meth:`Accelerator.prepare`).

    Args:
        state: who this process is and its device.
        gradient_state: gradient accumulation as the loop sees it (the schedulers and dataloaders report to it).
        steps: what a prepared optimizer's ``step`` and ``zero_grad`` do, and the run's current
            precision, which prepared models and optimizers read at each call (a precision fallback
            is one assignment there); it keeps the diagnostics' monitor.
        prepared: where the prepared objects are kept (what a checkpoint holds).
        audit: the precision audit, which watches each model's first step.
        diagnostics: gradient statistics and overflow tracing (observe only).
        fsdp_plugin: shard models with FSDP2 when several processes run (else DDP).
        ddp_wire_dtype: the dtype DDP's all-reduce sends gradients in (``None``: as they are).
        ddp_kwargs: more arguments of ``DistributedDataParallel`` (``find_unused_parameters``...).
        compile: ``torch.compile`` prepared models (a dict: its arguments).
        dataloader_config: how prepared dataloaders behave.
        device_placement: move models and batches to the device.
        step_scheduler_with_optimizer: a prepared scheduler steps with its optimizer.
    """

    def __init__(self, *, state: AcceleratorState, gradient_state: GradientState,
                 steps: OptimizerSteps, prepared: PreparedObjects, audit: PrecisionAudit, diagnostics: DiagnosticsConfig,
                 fsdp_plugin: FullyShardedDataParallelPlugin | None, ddp_wire_dtype: torch.dtype | None,
                 ddp_kwargs: dict[str, Any] | None = None,
                 compile: bool | dict, dataloader_config: DataLoaderConfiguration, device_placement: bool,
                 step_scheduler_with_optimizer: bool) -> None:
        self.state, self.gradient_state, self.steps = state, gradient_state, steps
        self.current_precision: Callable[[], PrecisionPlugin] = steps.current
        self.prepared, self.audit = prepared, audit
        #: What the optimizers this Accelerator prepares call (``steps``, which holds nothing of theirs).
        self.optimizer_hooks = OptimizerHooks(step=steps.step, zero_grad=steps.zero_grad, precision=steps.current)
        self.diagnostics, self.fsdp_plugin, self.ddp_wire_dtype = diagnostics, fsdp_plugin, ddp_wire_dtype
        self.ddp_kwargs = dict(ddp_kwargs or {})  # DistributedDataParallelKwargs' arguments of DDP
        self.compile, self.dataloader_config = compile, dataloader_config
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.sharded_params: dict[int, torch.nn.Parameter] = {}  # id(original) -> its sharded parameter

    def forget(self) -> None:
        """Forget what was prepared and observed (``Accelerator.free_memory``)."""
        self.prepared.clear()
        self.steps.monitor = None
        self.sharded_params.clear()

    def prepare(self, *objects: Any, device_placement: list[bool | None] | None = None) -> Any:
        """Wrap models, optimizers, schedulers and dataloaders; returns them in the order given.

        Anything else (``None``, a list, a tokenizer) comes back unchanged, as in Accelerate; an
        object prepared already comes back as it is. ``device_placement`` (one entry per object)
        overrides the Accelerator's for the models, optimizers and dataloaders among them.
        """
        self.state.num_processes  # noqa: B018 - after state._reset_state() this says so, early
        if device_placement is not None and len(device_placement) != len(objects):
            raise ValueError(f"device_placement has {len(device_placement)} entries for {len(objects)} objects")
        kinds = [_kind(obj) for obj in objects]
        out: list[Any] = list(objects)
        # Models before optimizers (bf16-true casts the parameters the optimizer holds), and
        # schedulers last, since they must find their prepared optimizer.
        for wanted in ("model", "optimizer", "dataloader", "scheduler"):
            for i, (obj, kind) in enumerate(zip(objects, kinds)):
                if kind != wanted:
                    continue
                if getattr(obj, "_is_accelerate_prepared", False):
                    out[i] = self._register_again(obj, kind)
                elif kind == "scheduler":
                    out[i] = self.prepare_scheduler(obj)
                else:
                    out[i] = {"model": self.prepare_model, "optimizer": self.prepare_optimizer,
                              "dataloader": self.prepare_data_loader}[kind](
                        obj, device_placement=device_placement[i] if device_placement else None)
        return out[0] if len(out) == 1 else tuple(out)

    def _register_again(self, obj: Any, kind: str) -> Any:
        """An object prepared already comes back as it is and, as in Accelerate, is registered
        again if this Accelerator no longer holds it (after ``free_memory``: transformers' Trainer
        prepares its model and optimizer again for a second ``train()``); the precision audit and
        the loss scaler's bookkeeping take it up again. An optimizer or dataloader another
        Accelerator prepared is prepared afresh here (its step and batches must be this one's)."""
        held = {"model": self.prepared.models, "optimizer": self.prepared.optimizers,
                "scheduler": self.prepared.schedulers, "dataloader": self.prepared.dataloaders}[kind]
        if any(obj is o for o in held):
            return obj
        if kind == "optimizer" and getattr(obj, "hooks", None) is not self.optimizer_hooks:
            return self.prepare_optimizer(obj)  # another Accelerator's: wrapped afresh
        if kind == "model":
            repoint_forward(obj, self.current_precision)  # its forward runs in this Accelerator's precision
            self.audit.watch_model(obj)
        elif kind == "optimizer":
            self.current_precision().track_optimizer(obj.optimizer)
        held.append(obj)
        return obj

    def _mark_prepared(self, obj: Any) -> Any:
        try:
            obj._is_accelerate_prepared = True  # Accelerate's mark, read by its users and by prepare()
        except AttributeError:  # pragma: no cover - objects with __slots__
            pass
        return obj

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        """Move ``model`` to the device, convert it for the precision (bf16 parameters for
        bf16-true), run its forward in the current precision, and wrap it in
        ``DistributedDataParallel`` when several processes run. A model prepared already is
        returned as it is. ``evaluation_mode``: for inference only (Accelerate's): neither DDP nor
        FSDP2 wraps it, each process runs its own copy."""
        if getattr(model, "_is_accelerate_prepared", False):
            return self._register_again(model, "model")
        if getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False):
            device_map = getattr(model, "hf_device_map", None) or {}
            if any(d in ("cpu", "disk") for d in device_map.values()):
                raise ValueError("a model quantized by bitsandbytes with CPU or disk offload cannot be trained: "
                                 "load it wholly on the GPU (device_map={'': 0})")
        state, precision = self.state, self.current_precision()
        if device_placement if device_placement is not None else self.device_placement:
            model.to(state.device)
        given = dict(model.named_parameters())
        precision.convert_module(model)
        # A conversion may put new Parameter objects in (fp8's float8 all-gather wraps each weight):
        # optimizers built on the given ones are pointed at them, as at sharding below.
        self.sharded_params.update({id(p): q for n, q in model.named_parameters() if (p := given.get(n)) is not None
                                    and p is not q})
        patch_forward(model, self.current_precision)
        if state.use_distributed and self.fsdp_plugin is not None and not evaluation_mode:
            # Every rank shards the same weights: rank 0's (as DDP does; FSDP2 alone would keep
            # each rank's own slice of differently initialised models).
            D.broadcast_module_state(model)
            before = dict(model.named_parameters())
            shard_model(model, self.fsdp_plugin, precision.sharding_policy(self.fsdp_plugin.reduce_dtype))
            # (activation checkpointing wraps the blocks: their names gain the wrapper's prefix)
            after = {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in model.named_parameters()}
            # fully_shard replaces the parameters: optimizers built on the old ones are pointed at them.
            moved = {id(p): after[n] for n, p in before.items() if n in after}
            # the given parameters a conversion replaced follow theirs to the shards
            self.sharded_params.update({k: moved.get(id(v), v) for k, v in self.sharded_params.items()})
            self.sharded_params.update(moved)
        self.audit.watch_model(model)
        if self.diagnostics.enabled:  # after sharding: the statistics read the sharded gradients
            if self.steps.monitor is None:
                self.steps.monitor = Monitor(self.diagnostics, scaler=precision.scaler)
            self.steps.monitor.watch(model)
        if state.use_distributed and self.fsdp_plugin is None and not evaluation_mode \
                and any(p.requires_grad for p in model.parameters()):  # (DDP refuses a frozen model)
            ids = [state.device.index] if state.device.type == "cuda" else None
            model = PreparedDDP(model, device_ids=ids, **self.ddp_kwargs)
            # The bucket's mean, compressed to ddp_comm_hook's dtype if set; the audit sees its dtype.
            model.register_comm_hook(state=None, hook=recording_ddp_hook(self.audit.record_reduced,
                                                                          self.ddp_wire_dtype))
        if self.compile:
            # Compiled around the precision's forward, so autocast is traced into the graph.
            model = torch.compile(model, **(self.compile if isinstance(self.compile, dict) else {}))
        self.prepared.models.append(model)
        return self._mark_prepared(model)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          device_placement: bool | None = None) -> AcceleratedOptimizer:
        """Wrap ``optimizer`` so that ``step()`` goes through the precision plugin (bf16-true
        first swaps a fresh AdamW/SGD for its compensated twin); ``device_placement`` (default:
        the Accelerator's): a state loaded into it goes to the device."""
        if isinstance(optimizer, AcceleratedOptimizer):
            if optimizer.hooks is self.optimizer_hooks:  # this Accelerator's own
                return self._register_again(optimizer, "optimizer")
            optimizer = optimizer.optimizer
        if self.sharded_params:
            for group in optimizer.param_groups:
                group["params"] = [self.sharded_params.get(id(p), p) for p in group["params"]]
        precision = self.current_precision()
        converted = precision.convert_optimizer(optimizer)
        precision.track_optimizer(converted)
        wrapped = AcceleratedOptimizer(converted, self.optimizer_hooks, original=optimizer, accelerator_state=self.state,
                                       gradient_state=self.gradient_state,
                                       device_placement=self.device_placement if device_placement is None
                                       else device_placement)
        self.prepared.optimizers.append(wrapped)
        return self._mark_prepared(wrapped)

    def prepare_scheduler(self, scheduler: Any, *, steps_per_call: int | None = None) -> AcceleratedScheduler:
        """Wrap ``scheduler`` so that it steps only when its optimizer's step was applied (see
        ``step_scheduler_with_optimizer``). ``steps_per_call`` overrides Accelerate's count of
        schedule steps per applied step (the number of processes, or 1 with ``split_batches``)."""
        optimizers = self.prepared.optimizers
        mine = [o for o in optimizers if scheduler.optimizer in (o.optimizer, o.original_optimizer)]
        per_call = steps_per_call or (1 if self.dataloader_config.split_batches else self.state.num_processes)
        wrapped = AcceleratedScheduler(scheduler, mine or optimizers, self.gradient_state,
                                       step_with_optimizer=self.step_scheduler_with_optimizer, steps_per_call=per_call,
                                       split_batches=self.dataloader_config.split_batches)
        self.prepared.schedulers.append(wrapped)
        return self._mark_prepared(wrapped)

    def prepare_data_loader(self, dataloader: DataLoader, device_placement: bool | None = None, *,
                            checkpoint: bool = True, presharded: bool = False) -> PreparedDataLoader:
        """Batches on the device, and each process its own shard of every batch round.

        Args:
            dataloader: the user's ``DataLoader``.
            device_placement: move its batches to the device (default: the Accelerator's).
            checkpoint: save and restore its position in :meth:`save_state` (off for loaders
                made afresh for each evaluation).
            presharded: its batch sampler already gives this process its own batches (a
                rank-aware one, transformers' ``BatchRebalanceSampler``): not sharded again.
        """
        # The shuffle order as Accelerate's prepared loader gives it for the same seed: with
        # use_seedable_sampler (or a data_seed), seed + epoch; in one process, torch's RandomSampler
        # drawing from the global RNG at each epoch (dispatched: process 0's); in several, one
        # generator seeded by a draw at prepare time, rank 0's, that runs on from epoch to epoch.
        needs_seed = isinstance(dataloader.sampler, torch.utils.data.RandomSampler) and (
            dataloader.sampler.generator is None and dataloader.generator is None)
        config = self.dataloader_config
        # Accelerate's default: dispatch an IterableDataset's batches from process 0.
        dispatch = (config.dispatch_batches if config.dispatch_batches is not None
                    else isinstance(dataloader.dataset, torch.utils.data.IterableDataset))
        if config.use_seedable_sampler or config.data_seed is not None:
            shuffle = "seedable"
            seed = int(config.data_seed) if config.data_seed is not None else torch.initial_seed()
        elif self.state.num_processes == 1 or dispatch:
            shuffle, seed = "per_epoch", 0
        else:
            shuffle = "continue"
            seed = D.broadcast_object(int(torch.empty((), dtype=torch.int64).random_().item())) if needs_seed else 0
        place = self.device_placement if device_placement is None else device_placement
        device = self.state.device if place else None
        world, rank = (1, 0) if presharded else (self.state.num_processes, self.state.process_index)
        prepared = PreparedDataLoader(dataloader, device=device, world_size=world, rank=rank, seed=seed, float_dtype=self.current_precision().input_dtype,
                                      on_iter=self.gradient_state._add_dataloader,
                                      on_end=self.gradient_state._remove_dataloader,
                                      non_blocking=config.non_blocking, resume_position=config.use_stateful_dataloader,
                                      shuffle=shuffle, split_batches=config.split_batches,
                                      even_batches=config.even_batches, dispatch_batches=dispatch,
                                      gradient_state=self.gradient_state)
        if checkpoint:
            self.prepared.dataloaders.append(prepared)
        return self._mark_prepared(prepared)

    def prepare_iterable(self, iterable: Any, *, checkpoint: bool = True) -> IterableLoader:
        """Any iterable of batches as a loop reads a prepared dataloader (batches on the device,
        ``end_of_dataloader`` for ``accumulate``, the position saved and restored), not sharded:
        what the Trainer makes of an overridden ``get_train_dataloader`` returning something other
        than a prepared loader (transformers iterates such a loader as it is too)."""
        device = self.state.device if self.device_placement else None
        wrapped = IterableLoader(iterable, device=device, float_dtype=self.current_precision().input_dtype,
                                 on_iter=self.gradient_state._add_dataloader,
                                 on_end=self.gradient_state._remove_dataloader,
                                 non_blocking=self.dataloader_config.non_blocking)
        if checkpoint:
            self.prepared.dataloaders.append(wrapped)
        return wrapped

    def skip_first_batches(self, dataloader: PreparedDataLoader, num_batches: int = 0) -> PreparedDataLoader:
        """Start ``dataloader``'s next epoch at batch ``num_batches``, without loading the ones before.

        Returns the same prepared dataloader (the skip applies to one epoch). After
        :meth:`load_state` the dataloader already resumes at the saved batch; calling this sets
        the start instead of adding to it.
        """
        if not isinstance(dataloader, (PreparedDataLoader, IterableLoader)):
            raise TypeError(f"skip_first_batches() takes a dataloader returned by prepare(), got "
                            f"{type(dataloader).__name__}; call accelerator.prepare(dataloader) first")
        dataloader.skip_batches(num_batches)
        return dataloader
