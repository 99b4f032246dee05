"""The Accelerator tier: the user keeps their loop; precision, devices and processes are ours.

Code written for Hugging Face Accelerate's core API runs with ``from mixprec import
Accelerator``. Unlike Accelerate there is no shared global state (several Accelerators with
different precisions may live in one process), and fp16 on the CPU is real.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from . import distributed as D
from .accelerator_state import AcceleratorState, DistributedType, GradientState
from .audit import PrecisionAudit, PrecisionReport, recording_ddp_hook
from .configs import DataLoaderConfiguration, GradientAccumulationPlugin, ProjectConfiguration, coerce_config
from .data import PreparedDataLoader
from .diagnostics.monitor import DiagnosticsConfig, Monitor
from .fallback import fallback_target, log_fallback
from .fsdp import FullyShardedDataParallelPlugin, full_state_dict, is_sharded, shard_model
from .hardware import default_device
from .nested import tree_map
from .precision import BF16TrueConfig, PrecisionPlugin, PrecisionPolicy, make_plugin, resolve_precision
from .preemption import Preemption
from .process_api import ProcessAPI
from .scaler import LossScaleCollapse, LossScaler
from .state import (
    PreparedObjects,
    StateHooks,
    load_accelerator_state,
    resolve_load_dir,
    resolve_save_dir,
    save_accelerator_state,
    save_model_weights,
)
from .wrappers import (
    AcceleratedOptimizer,
    AcceleratedScheduler,
    OptimizerHooks,
    patch_forward,
    unpatch_forward,
    unwrap,
    unwrap_keeping_compile,
)

__all__ = ["Accelerator"]

_ACCELERATE_NAMES = {"fp32": "no", "fp16-mixed": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16-true"}


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


class Accelerator(ProcessAPI):
    """Mixed precision, device placement and several processes for a training loop you write.

    Args:
        mixed_precision: any name :func:`~mixprec.resolve_precision` takes (``"no"``, ``"fp16"``,
            ``"bf16"``, ``"bf16-true"``, ``"auto"``, ...). ``None`` means fp32.
        gradient_accumulation_steps: micro-batches per optimizer step (with :meth:`accumulate`).
        cpu: train on the CPU even where CUDA is available.
        device_placement: move models and batches to :attr:`device`.
        loss_scaler: a :class:`~mixprec.LossScaler`, or a dict of its keyword arguments. fp16
            gets a default one; bf16-mixed may take one (it rarely needs it).
        ddp_comm_hook: ``"fp16"`` or ``"bf16"`` compresses DDP's gradient all-reduce with
            torch's own hooks; ``None`` leaves it in fp32.
        diagnostics: a :class:`~mixprec.diagnostics.DiagnosticsConfig` (or a dict of its fields):
            gradient statistics, overflow tracing. They observe only. Off by default.
        bf16_true_compensation: for ``bf16-true``, how the optimizer keeps updates smaller than
            bf16's resolution of the weights: ``"kahan"`` (default) or ``"stochastic"`` rounding;
            ``"none"`` keeps the user's optimizer as it is (small updates are then lost).
        bf16_true_state_dtype: for ``bf16-true`` with compensation, the dtype of the optimizer's
            moments: ``torch.float32`` (default, as accurate as fp32 training) or ``torch.bfloat16``
            (halves the optimizer's memory; ``"fp32"``/``"bf16"`` are accepted too).
        compile: ``True`` (or a dict of ``torch.compile`` arguments) compiles prepared models; it
            composes with autocast and the loss scaler. Off by default.
        on_loss_scale_collapse: ``"raise"`` (default) lets :class:`~mixprec.LossScaleCollapse`
            through; ``"fallback"`` switches the run to bf16-mixed where bf16 is native (else
            fp32), says so in one log line naming the module the tracer blames, and continues.
        split_batches, dataloader_config: how prepared dataloaders behave, a
            :class:`~mixprec.DataLoaderConfiguration` (Accelerate's own is accepted too).
        project_dir, project_config: the run's folder and checkpoint naming, a
            :class:`~mixprec.ProjectConfiguration` (or Accelerate's).
        gradient_accumulation_plugin: a :class:`~mixprec.GradientAccumulationPlugin` instead of
            ``gradient_accumulation_steps`` (not both).
        fsdp_plugin: a :class:`~mixprec.FullyShardedDataParallelPlugin` (or Accelerate's, or a
            dict): with several processes, prepared models are sharded with FSDP2 under the
            precision's ``MixedPrecisionPolicy``, and checkpoints are written by every rank with
            ``torch.distributed.checkpoint`` (they load on any number of ranks).
        skip_nonfinite_steps: in fp32, bf16-mixed and bf16-true too, skip an optimizer step whose
            gradients hold inf/NaN (the loss scaler's check at a scale pinned to 1: counted in
            ``skipped_steps``, no host sync with fused optimizers, one found-inf read per step in
            bf16-true; ``max_consecutive_skips`` in ``loss_scaler=`` applies; ``"auto"``: where the
            precision has it). fp16 always skips them. Off by default, as in Accelerate.
        step_scheduler_with_optimizer: a prepared scheduler steps with its optimizer, as many
            times per call as there are processes (a schedule written for one process's count
            of batches then ends on time), unless ``split_batches``. ``False``: it steps once
            per call, whatever the optimizer did (a schedule stepped per epoch).

    Example:
        >>> acc = Accelerator(mixed_precision="bf16", cpu=True)
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model, opt = acc.prepare(model, opt)
        >>> loss = model(torch.randn(8, 4)).float().pow(2).mean()
        >>> acc.backward(loss); opt.step(); opt.zero_grad()
    """

    def __init__(self, mixed_precision: str | PrecisionPolicy | None = None, gradient_accumulation_steps: int = 1,
                 cpu: bool = False, device_placement: bool = True, loss_scaler: LossScaler | dict | None = None,
                 ddp_comm_hook: str | None = None, diagnostics: DiagnosticsConfig | dict | None = None,
                 on_loss_scale_collapse: str = "raise", compile: bool | dict = False,
                 bf16_true_compensation: str = "kahan",
                 bf16_true_state_dtype: torch.dtype | str = torch.float32, *, split_batches: bool = False,
                 dataloader_config: DataLoaderConfiguration | None = None, project_dir: str | os.PathLike | None = None,
                 project_config: ProjectConfiguration | None = None,
                 gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
                 step_scheduler_with_optimizer: bool = True,
                 fsdp_plugin: FullyShardedDataParallelPlugin | dict | None = None,
                 skip_nonfinite_steps: bool | str = False) -> None:
        plugin = gradient_accumulation_plugin
        if plugin is not None:
            plugin = coerce_config(plugin, GradientAccumulationPlugin, "gradient_accumulation_plugin")
            if gradient_accumulation_steps != 1:
                raise ValueError("give gradient_accumulation_steps or gradient_accumulation_plugin, not both: "
                                 "set num_steps in the plugin")
            gradient_accumulation_steps = plugin.num_steps if plugin.num_steps is not None else 1
        else:
            plugin = GradientAccumulationPlugin(num_steps=gradient_accumulation_steps)
        if not isinstance(gradient_accumulation_steps, int) or isinstance(gradient_accumulation_steps, bool) \
                or gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be an int >= 1, got {gradient_accumulation_steps!r}")
        if ddp_comm_hook not in (None, "fp16", "bf16"):
            raise ValueError(f"ddp_comm_hook must be None, 'fp16' or 'bf16', got {ddp_comm_hook!r}")
        if on_loss_scale_collapse not in ("raise", "fallback"):
            raise ValueError(f"on_loss_scale_collapse must be 'raise' or 'fallback', got {on_loss_scale_collapse!r}")
        if not isinstance(compile, (bool, dict)):
            raise TypeError(f"compile must be True/False or a dict of torch.compile arguments, got {type(compile).__name__}")
        self.compile = compile
        self.bf16_true = BF16TrueConfig(compensation=bf16_true_compensation, state_dtype=bf16_true_state_dtype)
        self.diagnostics = DiagnosticsConfig.coerce(diagnostics)
        self.on_loss_scale_collapse = on_loss_scale_collapse
        self.dataloader_config = coerce_config(dataloader_config, DataLoaderConfiguration, "dataloader_config")
        self.dataloader_config.split_batches = self.dataloader_config.split_batches or split_batches
        self.project_configuration = coerce_config(project_config, ProjectConfiguration, "project_config")
        if project_dir is not None and self.project_configuration.project_dir is None:
            self.project_configuration.set_directories(project_dir)
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.fsdp_plugin = None if fsdp_plugin is None else FullyShardedDataParallelPlugin.from_config(fsdp_plugin)
        if self.fsdp_plugin is not None and ddp_comm_hook is not None:
            raise ValueError("ddp_comm_hook compresses DDP's all-reduce; with fsdp_plugin set "
                             "FullyShardedDataParallelPlugin(reduce_dtype=...) instead")
        self._sharded_params: dict[int, torch.nn.Parameter] = {}  # id(original) -> its sharded parameter
        self._pending_save: Any = None  # a checkpoint being written in the background
        self._preemption: Preemption | None = None
        self._async_group: Any = None
        device = torch.device("cpu") if cpu else default_device()
        self._process = D.init_from_env(device.type)
        if device.type == "cuda":
            device = torch.device("cuda", self._process.local_rank)
            torch.cuda.set_device(device)
        if os.environ.get("ACCELERATE_TORCH_DEVICE"):  # Accelerate's override of the device
            device = torch.device(os.environ["ACCELERATE_TORCH_DEVICE"])
        if self.dataloader_config.split_batches and self._process.world_size > 1:
            raise NotImplementedError("split_batches=True with several processes is not supported yet: each process "
                                      "draws its own batches; divide the batch size by the number of processes instead")
        #: Who this process is (Accelerate's ``accelerator.state``; this Accelerator's own, not global).
        self.state = AcceleratorState(self, device)
        #: Gradient accumulation as the loop sees it (Accelerate's ``accelerator.gradient_state``).
        self.gradient_state = GradientState(gradient_accumulation_steps, plugin.adjust_scheduler,
                                            plugin.sync_with_dataloader, plugin.sync_each_batch)
        policy = resolve_precision(mixed_precision if mixed_precision is not None else "fp32", self.device)
        #: What the run's precision does (read at call time by the prepared models and optimizers).
        self.skip_nonfinite_steps = skip_nonfinite_steps
        self.precision: PrecisionPlugin = make_plugin(policy, self.device, loss_scaler=loss_scaler,
                                                      bf16_true=self.bf16_true, skip_nonfinite_steps=skip_nonfinite_steps)
        self.device_placement = device_placement
        self.ddp_comm_hook = ddp_comm_hook
        self.step = 0  # micro-batches seen by accumulate(), as Accelerate counts them
        #: Everything prepared (and registered for checkpointing), in order; what save_state writes.
        self.prepared = PreparedObjects()
        self._state_hooks = StateHooks()
        self._optimizer_hooks = OptimizerHooks(step=self._step_optimizer, zero_grad=self._zero_grad,
                                               precision=self._current_precision)
        self.monitor: Monitor | None = None
        self.optimizer_steps = 0  # applied or skipped, counted by the first prepared optimizer
        self.precision_fallbacks: list[dict[str, Any]] = []
        #: What the prepared objects really train in (see :meth:`precision_report`).
        self.audit = PrecisionAudit()

    def _current_precision(self) -> PrecisionPlugin:
        return self.precision

    @property
    def device(self) -> torch.device:
        """The device models and batches are put on."""
        return self.state.device

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (settable)."""
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        self.gradient_state.num_steps = value

    @property
    def sync_gradients(self) -> bool:
        """Whether this micro-batch completes an accumulation group (the optimizer steps)."""
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = value

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def project_dir(self) -> str | None:
        """The run's folder (``project_dir=``, or the project configuration's)."""
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        """The number the next automatically named checkpoint gets."""
        return self.project_configuration.iteration

    @property
    def distributed_type(self) -> DistributedType:
        return self.state.distributed_type

    @property
    def policy(self) -> PrecisionPolicy:
        """The current precision's policy (names and dtypes)."""
        return self.precision.policy

    @property
    def scaler(self) -> LossScaler | None:
        """The current precision's loss scaler (``None`` without one, or after a precision fallback)."""
        return self.precision.scaler

    # Accelerate's names for the prepared objects (its users and tests read them).
    @property
    def _models(self) -> list[torch.nn.Module]:
        return self.prepared.models

    @property
    def _optimizers(self) -> list[AcceleratedOptimizer]:
        return self.prepared.optimizers

    @property
    def _schedulers(self) -> list[AcceleratedScheduler]:
        return self.prepared.schedulers

    @property
    def _dataloaders(self) -> list[PreparedDataLoader]:
        return self.prepared.dataloaders

    @property
    def _custom_objects(self) -> list[Any]:
        return self.prepared.custom

    # -- who am I (read from self.state, as Accelerate's are) ----------------------------
    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        return self.state.local_process_index

    @property
    def mixed_precision(self) -> str:
        """The precision in Accelerate's words: ``"no"``, ``"fp16"``, ``"bf16"`` (or ``"bf16-true"``)."""
        return _ACCELERATE_NAMES[self.policy.name]

    @property
    def use_distributed(self) -> bool:
        return self.state.use_distributed

    # -- prepare --------------------------------------------------------------------------
    def prepare(self, *objects: Any, device_placement: list[bool | None] | None = None) -> Any:
        """Wrap models, optimizers, schedulers and dataloaders; returns them in the order given.

        Anything else (``None``, a list, a tokenizer) comes back unchanged, as in Accelerate; an
        object prepared already comes back as it is. ``device_placement`` (one entry per object)
        overrides the Accelerator's for the models among them.
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
                if kind != wanted or getattr(obj, "_is_accelerate_prepared", False):
                    continue
                if kind == "model":
                    out[i] = self.prepare_model(obj, device_placement[i] if device_placement else None)
                else:
                    out[i] = {"optimizer": self.prepare_optimizer, "dataloader": self.prepare_data_loader,
                              "scheduler": self.prepare_scheduler}[kind](obj)
        return out[0] if len(out) == 1 else tuple(out)

    def _mark_prepared(self, obj: Any) -> Any:
        try:
            obj._is_accelerate_prepared = True  # Accelerate's mark, read by its users and by prepare()
        except AttributeError:  # pragma: no cover - objects with __slots__
            pass
        return obj

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None) -> torch.nn.Module:
        """Move ``model`` to the device, convert it for the precision (bf16 parameters for
        bf16-true), run its forward in the current precision, and wrap it in
        ``DistributedDataParallel`` when several processes run. A model prepared already is
        returned as it is."""
        if any(model is m for m in self.prepared.models):
            return model
        if getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False):
            device_map = getattr(model, "hf_device_map", None) or {}
            if any(d in ("cpu", "disk") for d in device_map.values()):
                raise ValueError("a model quantized by bitsandbytes with CPU or disk offload cannot be trained: "
                                 "load it wholly on the GPU (device_map={'': 0})")
        if device_placement if device_placement is not None else self.device_placement:
            model.to(self.device)
        self.precision.convert_module(model)
        patch_forward(model, self._current_precision)
        if self.use_distributed and self.fsdp_plugin is not None:
            # Every rank shards the same weights: rank 0's (as DDP does; FSDP2 alone would keep
            # each rank's own slice of differently initialised models).
            D.broadcast_module_state(model)
            before = dict(model.named_parameters())
            shard_model(model, self.fsdp_plugin, self.precision.sharding_policy(self.fsdp_plugin.reduce_dtype))
            # (activation checkpointing wraps the blocks: their names gain the wrapper's prefix)
            after = {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in model.named_parameters()}
            # fully_shard replaces the parameters: optimizers built on the old ones are pointed at them.
            self._sharded_params.update({id(p): after[n] for n, p in before.items() if n in after})
        self.audit.watch_model(model)
        if self.diagnostics.enabled:  # after sharding: the statistics read the sharded gradients
            if self.monitor is None:
                self.monitor = Monitor(self.diagnostics, scaler=self.scaler)
            self.monitor.watch(model)
        if self.use_distributed and self.fsdp_plugin is None:
            ids = [self.device.index] if self.device.type == "cuda" else None
            model = DistributedDataParallel(model, device_ids=ids)
            # The bucket's mean, compressed to ddp_comm_hook's dtype if set; the audit sees its dtype.
            wire = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(self.ddp_comm_hook or "")
            model.register_comm_hook(state=None, hook=recording_ddp_hook(self.audit.record_reduced, wire))
        if self.compile:
            # Compiled around the precision's forward, so autocast is traced into the graph.
            model = torch.compile(model, **(self.compile if isinstance(self.compile, dict) else {}))
        self.prepared.models.append(model)
        return self._mark_prepared(model)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> AcceleratedOptimizer:
        """Wrap ``optimizer`` so that ``step()`` goes through the precision plugin (bf16-true
        first swaps a fresh AdamW/SGD for its compensated twin)."""
        if isinstance(optimizer, AcceleratedOptimizer):
            optimizer = optimizer.optimizer
        if self._sharded_params:
            for group in optimizer.param_groups:
                group["params"] = [self._sharded_params.get(id(p), p) for p in group["params"]]
        converted = self.precision.convert_optimizer(optimizer)
        self.precision.track_optimizer(converted)
        wrapped = AcceleratedOptimizer(converted, self._optimizer_hooks, original=optimizer)
        self.prepared.optimizers.append(wrapped)
        return self._mark_prepared(wrapped)

    def prepare_scheduler(self, scheduler: Any, *, steps_per_call: int | None = None) -> AcceleratedScheduler:
        """Wrap ``scheduler`` so that it steps only when its optimizer's step was applied (see
        ``step_scheduler_with_optimizer``). ``steps_per_call`` overrides Accelerate's count of
        schedule steps per applied step (the number of processes, or 1 with ``split_batches``)."""
        optimizers = self.prepared.optimizers
        mine = [o for o in optimizers if scheduler.optimizer in (o.optimizer, o.original_optimizer)]
        per_call = steps_per_call or (1 if self.split_batches else self.num_processes)
        wrapped = AcceleratedScheduler(scheduler, mine or optimizers, self.gradient_state,
                                       step_with_optimizer=self.step_scheduler_with_optimizer, steps_per_call=per_call)
        self.prepared.schedulers.append(wrapped)
        return self._mark_prepared(wrapped)

    def prepare_data_loader(self, dataloader: DataLoader, *, checkpoint: bool = True) -> PreparedDataLoader:
        """Batches on the device, and each process its own shard of every batch round.

        Args:
            dataloader: the user's ``DataLoader``.
            checkpoint: save and restore its position in :meth:`save_state` (off for loaders
                made afresh for each evaluation).
        """
        # One seed for the shuffle order, the same on every process so the shards fit together;
        # drawn from torch's RNG (so torch.manual_seed decides it) only where a shuffle needs it.
        needs_seed = isinstance(dataloader.sampler, torch.utils.data.RandomSampler) and (
            dataloader.sampler.generator is None and dataloader.generator is None)
        config = self.dataloader_config
        if config.data_seed is not None:
            seed = int(config.data_seed)
        else:
            seed = D.broadcast_object(int(torch.randint(0, 2**62, (1,)).item())) if needs_seed else 0
        device = self.device if self.device_placement else None
        prepared = PreparedDataLoader(dataloader, device=device, world_size=self.num_processes, rank=self.process_index,
                                      seed=seed, float_dtype=self.precision.input_dtype,
                                      on_iter=self.gradient_state._add_dataloader,
                                      on_end=self.gradient_state._remove_dataloader,
                                      non_blocking=config.non_blocking, resume_position=config.use_stateful_dataloader)
        if checkpoint:
            self.prepared.dataloaders.append(prepared)
        return self._mark_prepared(prepared)

    def skip_first_batches(self, dataloader: PreparedDataLoader, num_batches: int = 0) -> PreparedDataLoader:
        """Start ``dataloader``'s next epoch at batch ``num_batches``, without loading the ones before.

        Returns the same prepared dataloader (the skip applies to one epoch). After
        :meth:`load_state` the dataloader already resumes at the saved batch; calling this sets
        the start instead of adding to it.
        """
        if not isinstance(dataloader, PreparedDataLoader):
            raise TypeError(f"skip_first_batches() takes a dataloader returned by prepare(), got "
                            f"{type(dataloader).__name__}; call accelerator.prepare(dataloader) first")
        dataloader.skip_batches(num_batches)
        return dataloader

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

    # -- the step ---------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        """The current precision's forward context (autocast; a no-op for fp32 and bf16-true)."""
        return self.precision.forward_context()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided by the accumulation steps and scaled where the precision needs it."""
        if self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        self.precision.backward(loss, **kwargs)

    @property
    def _end_of_dataloader(self) -> bool:
        return self.gradient_state.end_of_dataloader and self.gradient_state.sync_with_dataloader

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """Accumulate gradients over ``gradient_accumulation_steps`` micro-batches.

        Sets :attr:`sync_gradients`: True on the micro-batch that completes a group (or ends the
        dataloader), when the prepared optimizer steps; on the others DDP's ``no_sync`` skips the
        all-reduce and the optimizer's ``step``/``zero_grad`` do nothing.
        """
        if self._end_of_dataloader:
            self.step, self.sync_gradients = 0, True
        else:
            self.step += 1
            self.sync_gradients = self.step % self.gradient_accumulation_steps == 0
        with contextlib.ExitStack() as stack:
            if not (self.sync_gradients or self.gradient_state.sync_each_batch):
                for m in models:
                    stack.enter_context(self.no_sync(m))
            yield

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """DDP's ``no_sync`` for a prepared model (gradients stay local); a no-op in one process."""
        if isinstance(model, DistributedDataParallel):
            with model.no_sync():
                yield
        elif is_sharded(model):
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        else:
            yield

    def _optimizers_for(self, parameters: list[torch.Tensor]) -> list[torch.optim.Optimizer]:
        ids = {id(p) for p in parameters}
        return [o.optimizer for o in self.prepared.optimizers
                if any(id(p) in ids for g in o.optimizer.param_groups for p in g["params"])]

    def unscale_gradients(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Divide the gradients by the loss scale now, once per iteration (later calls do nothing)."""
        if not self.sync_gradients:
            return
        opts = [optimizer] if optimizer is not None else [o.optimizer for o in self.prepared.optimizers]
        with self._collapse_guard():
            for opt in opts:
                self.precision.unscale_gradients(opt.optimizer if isinstance(opt, AcceleratedOptimizer) else opt)

    def _clip(self, parameters: Iterable[torch.Tensor] | torch.Tensor, **how: Any) -> torch.Tensor | None:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        with self._collapse_guard():
            norm = self.precision.clip_gradients(params, self._optimizers_for(params), **how)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # sharded: the global norm

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor | None:
        """Unscale (exactly once per iteration, fused optimizers included), then clip the gradients' total norm.

        Returns the norm before clipping; ``None`` on accumulation steps that don't sync, where the
        gradients are still partial (call it inside ``if accelerator.sync_gradients:``).
        """
        return self._clip(parameters, max_norm=max_norm, norm_type=norm_type) if self.sync_gradients else None

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor] | torch.Tensor, clip_value: float) -> None:
        """Unscale (exactly once per iteration), then clamp every gradient element to ``[-clip_value, clip_value]``."""
        if self.sync_gradients:
            self._clip(parameters, clip_value=clip_value)

    # -- each prepared optimizer's step and zero_grad come here ---------------------------
    def _step_optimizer(self, wrapped: AcceleratedOptimizer, closure: Any) -> Any:
        if not self.sync_gradients:
            return None
        first = wrapped is self.prepared.optimizers[0]
        self.audit.observe_gradients(wrapped.optimizer)
        models = self._observe_before_step(wrapped)
        out = None
        with self._collapse_guard(wrapped):
            out = self.precision.optimizer_step(wrapped.optimizer, closure)
        if wrapped.original_optimizer is not wrapped.optimizer:
            # A scheduler built on the user's optimizer checks that *it* stepped (torch's flag).
            wrapped.original_optimizer._opt_called = True
        if self.monitor is not None:
            self.monitor.after_step(self.optimizer_steps, models)
        self.optimizer_steps += first
        return out

    def _zero_grad(self, wrapped: AcceleratedOptimizer, set_to_none: bool) -> None:
        if self.sync_gradients:  # on accumulation steps the gradients keep adding up
            self.precision.zero_grad(wrapped.optimizer, set_to_none=set_to_none)

    def _observe_before_step(self, wrapped: AcceleratedOptimizer) -> list[torch.nn.Module] | None:
        """Hand the diagnostics the gradients of the models this optimizer steps; returns those models."""
        if self.monitor is None:
            return None
        held = {id(p) for g in wrapped.optimizer.param_groups for p in g["params"]}
        models = [m for m in self.monitor.models if any(id(p) in held for p in m.parameters())]
        self.monitor.before_step(self.optimizer_steps, self.precision.grads_scaled_by(wrapped.optimizer), models)
        return models

    @contextlib.contextmanager
    def _collapse_guard(self, wrapped: AcceleratedOptimizer | None = None) -> Iterator[None]:
        """Let a loss-scale collapse through with the tracer's culprit, or fall back (``on_loss_scale_collapse``)."""
        try:
            yield
        except LossScaleCollapse as error:
            if wrapped is not None:
                wrapped.mark_skipped()
            blame = self.monitor.blame() if self.monitor is not None else \
                "turn on diagnostics (trace_overflow=True) to name the overflowing module"
            if self.on_loss_scale_collapse == "raise":
                raise LossScaleCollapse(f"{error} Tracer: {blame}.") from None
            # The skipped steps changed neither the parameters nor the optimizer state: they are
            # the last applied state already. Drop the overflowing gradients and switch precision.
            target, why = fallback_target(self.precision, self.device)
            before = self.policy.name
            for o in self.prepared.optimizers:
                o.optimizer.zero_grad(set_to_none=True)
            self._switch_precision(target)
            self.precision_fallbacks.append({"step": self.optimizer_steps, "from": before, "to": target})
            log_fallback(self.optimizer_steps, before, target, why, blame)

    def _switch_precision(self, name: str) -> None:
        """Run the rest of training in ``name``: one assignment, which every prepared model and
        optimizer reads at its next call."""
        self.precision.release()
        self.precision = make_plugin(name, self.device, bf16_true=self.bf16_true,
                                     skip_nonfinite_steps=self.skip_nonfinite_steps)
        for o in self.prepared.optimizers:
            self.precision.track_optimizer(o.optimizer)

    # -- preemption ----------------------------------------------------------------------
    def preemptible(self) -> Preemption:
        """A context in which SIGTERM (a scheduler's "stop soon") only sets :attr:`should_stop`:

            with accelerator.preemptible():
                for batch in dataloader:
                    ...; optimizer.step(); optimizer.zero_grad()
                    if accelerator.should_stop:          # every process stops at the same step
                        accelerator.save_state("ckpt"); break
        """
        self._preemption = Preemption()
        return self._preemption

    @property
    def should_stop(self) -> bool:
        """Whether any process got SIGTERM inside :meth:`preemptible` (with several processes,
        one small all-reduce on the host: read it at the same point of every process's loop)."""
        return self._preemption is not None and self._preemption.requested()

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last step of any prepared optimizer was skipped for inf/NaN gradients. Syncs with fp16."""
        return any(o.step_was_skipped for o in self.prepared.optimizers)

    # -- across processes ----------------------------------------------------------------
    def gather(self, tensor: Any) -> Any:
        """Concatenate ``tensor`` (or nested dicts/lists of tensors) from all processes on dim 0."""
        return D.gather(tensor)

    def gather_for_metrics(self, input_data: Any) -> Any:
        """:meth:`gather`, dropping the duplicates that padded the last uneven batch round."""
        data = D.gather(input_data)
        dl = self.gradient_state.active_dataloader
        remainder = dl.remainder if (dl is not None and dl.end_of_dataloader) else 0
        if remainder:
            data = _truncate(data, remainder)
        return data

    def reduce(self, tensor: Any, reduction: str = "sum") -> Any:
        """Sum (``"sum"``) or average (``"mean"``) ``tensor`` over all processes."""
        return D.reduce(tensor, reduction)

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

    def precision_report(self) -> PrecisionReport:
        """What precision is really in force, read from the live objects, and where it differs
        from the precision's contract (the README's table).

        Observed in the first step after ``prepare`` (forward, gradient reduction, optimizer step)
        and read now from the parameters, optimizer state and loss scaler: the dtype of the
        (sharded) master weights, of the parameters as forward sees them, the autocast dtype
        inside forward, of the matmul outputs, of the gradients as reduced (DDP's communication
        hook, FSDP2's reduce-scatter output) and as stored, of each optimizer state tensor, and
        whether the loss scaler was restored by the last :meth:`load_state`. No host sync but
        the scaler's scale.

        Example:
            >>> report = accelerator.precision_report()         # doctest: +SKIP
            >>> report.ok, report.violations, print(report.line())   # doctest: +SKIP
        """
        mode = ("fsdp" if self.fsdp_plugin is not None else "ddp") if self.use_distributed else "single"
        p = self.policy
        reduce_dtype = None
        if mode == "fsdp" and p.compute_dtype != torch.float32:
            reduce_dtype = self.fsdp_plugin.reduce_dtype or p.compute_dtype  # None: FSDP2 reduces in param_dtype
        elif mode == "ddp" and self.ddp_comm_hook:
            reduce_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[self.ddp_comm_hook]
        moments = None
        if p.name == "bf16-true":
            moments = self.bf16_true.state_dtype if self.bf16_true.compensation != "none" else p.param_dtype
        return self.audit.report(p.name, mode, [unwrap(m) for m in self.prepared.models],
                                 [o.optimizer for o in self.prepared.optimizers], self.scaler,
                                 reduce_dtype=reduce_dtype, moments=moments)

    def free_memory(self, *objects: Any) -> Any:
        """Forget every prepared object, collect garbage and empty the device cache (between two
        trainings in one process). Returns a list holding ``None`` for each object passed, to assign back."""
        self.prepared = PreparedObjects()
        self.precision.forget_optimizers()
        self.audit.close()
        self.audit = PrecisionAudit()  # the next run's objects are observed afresh
        self.gradient_state.dataloader_references.clear()
        self.monitor = None
        self.step = 0
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return [None] * len(objects)

    def clear(self, *objects: Any) -> Any:
        """Alias of :meth:`free_memory`."""
        return self.free_memory(*objects)

    def end_training(self) -> None:
        """Finish a checkpoint still being written, then release the process group, if several processes ran."""
        self.wait_for_checkpoint()
        if self.use_distributed and torch.distributed.is_initialized():
            self.wait_for_everyone()
            torch.distributed.destroy_process_group()

    def __repr__(self) -> str:
        return (f"Accelerator(precision={self.policy.name!r}, device={str(self.device)!r}, "
                f"num_processes={self.num_processes}, gradient_accumulation_steps={self.gradient_accumulation_steps})")


def _truncate(data: Any, n: int) -> Any:
    return tree_map(lambda t: t[: len(t) - n], data)
