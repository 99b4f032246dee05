"""The Accelerator tier: the user keeps their loop; precision, devices and processes are ours.

Code written for Hugging Face Accelerate's core API runs with ``from mixprec import
Accelerator``. Unlike Accelerate there is no shared global state (several Accelerators with
different precisions may live in one process), and fp16 on the CPU is real.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from mixprec.accelerator.audit import PrecisionAudit, PrecisionReport
from mixprec.accelerator.checkpointer import Checkpointer
from mixprec.accelerator.configs import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    ProjectConfiguration,
    coerce_config,
)
from mixprec.accelerator.handlers import DDPCommunicationHookType, read_kwargs_handlers
from mixprec.accelerator.prepare import PreparedObjects, Preparer
from mixprec.accelerator.processes import PROCESS_API, Processes, expose
from mixprec.accelerator.state import AcceleratorState, DistributedType, GradientState
from mixprec.accelerator.stepping import CurrentPrecision, OptimizerSteps, accelerate_word, build_precision
from mixprec.accelerator.utils import gather_object
from mixprec.accelerator.wrappers import AcceleratedOptimizer, AcceleratedScheduler, unwrap
from mixprec.data import PreparedDataLoader
from mixprec.diagnostics.monitor import DiagnosticsConfig, Monitor
from mixprec.distributed import groups as D
from mixprec.distributed.fsdp import FullyShardedDataParallelPlugin, is_sharded
from mixprec.distributed.preemption import Preemption
from mixprec.hardware import default_device
from mixprec.nested import tree_leaves, tree_map
from mixprec.precision import (
    PrecisionConfig,
    PrecisionPlugin,
    PrecisionPolicy,
    resolve_precision,
)
from mixprec.precision.scaler import LossScaleCollapse, LossScaler
from mixprec.tracking import Trackers

__all__ = ["Accelerator"]

_PRECISION_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PrecisionConfig)}
# DDP's gradient compression (``ddp_comm_hook``): the dtype its all-reduce sends gradients in.
_DDP_WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@expose(PROCESS_API, "state")  # who am I, read from self.state as Accelerate's are
class Accelerator:
    """Mixed precision, device placement and several processes for a training loop you write.

    The Accelerator holds its parts and hands each call to the one that does it: ``preparer``
    (:meth:`prepare` and its parts), ``checkpointer`` (:meth:`save_state`, :meth:`load_state`,
    the model out), ``processes`` (which process runs what: ``state`` holds the same one, and the
    process names, ``num_processes``, ``is_main_process``, ``wait_for_everyone``, ..., are read
    through ``state`` as in Accelerate, so after ``state._reset_state()`` they say so), and
    ``steps`` (each prepared optimizer's step, in ``precision``, the current precision plugin).
    Nothing it hands out holds the Accelerator back: dropped, it is freed at once.

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
        precision_config: a :class:`~mixprec.precision.PrecisionConfig` holding ``loss_scaler``,
            ``skip_nonfinite_steps``, ``bf16_true_compensation``, ``bf16_true_state_dtype`` and
            ``on_loss_scale_collapse`` in one object (then leave those arguments out).
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
                 skip_nonfinite_steps: bool | str = False, precision_config: PrecisionConfig | None = None,
                 kwargs_handlers: list[Any] | None = None, log_with: Any = None, rng_types: list[str] | None = None,
                 dynamo_backend: str | None = None, dynamo_plugin: Any = None, deepspeed_plugin: Any = None,
                 deepspeed_plugins: Any = None, megatron_lm_plugin: Any = None, torch_tp_plugin: Any = None,
                 parallelism_config: Any = None) -> None:
        unsupported = {"deepspeed_plugin": deepspeed_plugin, "deepspeed_plugins": deepspeed_plugins,
                       "megatron_lm_plugin": megatron_lm_plugin, "torch_tp_plugin": torch_tp_plugin,
                       "parallelism_config": parallelism_config}
        if given := [k for k, v in unsupported.items() if v is not None]:
            raise NotImplementedError(f"{', '.join(given)}: mixprec does not run DeepSpeed, Megatron-LM, tensor or "
                                      "composable parallelism; shard with FSDP2 instead: "
                                      "Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())")
        backend = getattr(dynamo_plugin, "backend", None) if dynamo_plugin is not None else dynamo_backend
        backend = str(getattr(backend, "value", backend) or os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no")).lower()
        if backend != "no" and compile is False:  # Accelerate's torch.compile switch
            compile = {"backend": backend}
            mode = getattr(dynamo_plugin, "mode", None) or os.environ.get("ACCELERATE_DYNAMO_MODE")
            if mode and mode != "default":
                compile["mode"] = mode
        if rng_types is not None:
            self.rng_types = list(rng_types)  # the RNGs to synchronise: mixprec seeds its loaders' own generator
        # What `accelerate launch` / `accelerate config` set, where the script passes no argument.
        env = os.environ
        if mixed_precision is None and env.get("ACCELERATE_MIXED_PRECISION"):
            mixed_precision = env["ACCELERATE_MIXED_PRECISION"].lower()
        cpu = cpu or _env_flag("ACCELERATE_USE_CPU")
        if gradient_accumulation_plugin is None and gradient_accumulation_steps == 1 \
                and env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"):
            gradient_accumulation_steps = int(env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"])
        if fsdp_plugin is None and _env_flag("ACCELERATE_USE_FSDP"):
            fsdp_plugin = FullyShardedDataParallelPlugin.from_env(env)
        #: The ``kwargs_handlers`` given, by class name (mixprec's objects; Accelerate's are converted).
        self._handlers = handlers = read_kwargs_handlers(kwargs_handlers)
        ddp_kwargs = handlers["DistributedDataParallelKwargs"].to_kwargs() if "DistributedDataParallelKwargs" in \
            handlers else {}
        hook = ddp_kwargs.pop("comm_hook", DDPCommunicationHookType.NO)
        if ddp_kwargs.pop("comm_wrapper", "no") != "no" or hook not in (DDPCommunicationHookType.NO,
                                                                       DDPCommunicationHookType.FP16,
                                                                       DDPCommunicationHookType.BF16):
            raise ValueError(f"DistributedDataParallelKwargs: the communication hook {hook.value!r} (and comm_wrapper) "
                             "is not supported; mixprec compresses DDP's all-reduce to fp16 or bf16 "
                             "(comm_hook=DDPCommunicationHookType.FP16 / BF16)")
        ddp_kwargs.pop("comm_state_option", None)
        if hook is not DDPCommunicationHookType.NO:
            if ddp_comm_hook not in (None, hook.value):
                raise ValueError(f"ddp_comm_hook={ddp_comm_hook!r} and DistributedDataParallelKwargs(comm_hook="
                                 f"{hook.value!r}) disagree: give one")
            ddp_comm_hook = hook.value
        scaler_kwargs = handlers["GradScalerKwargs"].to_kwargs() if "GradScalerKwargs" in handlers else {}
        group = handlers.get("InitProcessGroupKwargs")
        self.autocast_handler = handlers.get("AutocastKwargs")
        self.profile_handler = handlers.get("ProfileKwargs")
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
        if ddp_comm_hook is not None and ddp_comm_hook not in _DDP_WIRE_DTYPES:
            raise ValueError(f"ddp_comm_hook must be None, 'fp16' or 'bf16', got {ddp_comm_hook!r}")
        given = {"loss_scaler": loss_scaler, "skip_nonfinite_steps": skip_nonfinite_steps,
                 "bf16_true_compensation": bf16_true_compensation, "bf16_true_state_dtype": bf16_true_state_dtype,
                 "on_loss_scale_collapse": on_loss_scale_collapse}
        if precision_config is None:
            precision_config = PrecisionConfig(**given)
        elif changed := [k for k, v in given.items() if v != _PRECISION_DEFAULTS[k]]:
            raise ValueError(f"give precision_config= or its fields ({', '.join(changed)}), not both: set them in "
                             "the PrecisionConfig")
        #: What the precision does beyond its name (loss scaler, inf/NaN guard, bf16-true's optimizer).
        self.precision_config = precision_config
        if not isinstance(compile, (bool, dict)):
            raise TypeError(f"compile must be True/False or a dict of torch.compile arguments, got {type(compile).__name__}")
        self.diagnostics = DiagnosticsConfig.coerce(diagnostics)
        self.dataloader_config = coerce_config(dataloader_config, DataLoaderConfiguration, "dataloader_config")
        self.dataloader_config.split_batches = self.dataloader_config.split_batches or split_batches
        self.project_configuration = coerce_config(project_config, ProjectConfiguration, "project_config")
        if project_dir is not None and self.project_configuration.project_dir is None:
            self.project_configuration.set_directories(project_dir)
        self.fsdp_plugin = None if fsdp_plugin is None else FullyShardedDataParallelPlugin.from_config(fsdp_plugin)
        if self.fsdp_plugin is not None and ddp_comm_hook is not None:
            raise ValueError("ddp_comm_hook compresses DDP's all-reduce; with fsdp_plugin set "
                             "FullyShardedDataParallelPlugin(reduce_dtype=...) instead")
        self._preemption: Preemption | None = None
        device = torch.device("cpu") if cpu else default_device()
        timeout = group.timeout if group is not None and group.timeout is not None else None
        # A backend named in InitProcessGroupKwargs, but its default "nccl" only where there is CUDA.
        backend = group.backend if group is not None and (device.type == "cuda" or group.backend != "nccl") else None
        info = D.init_from_env(device.type, *([timeout.total_seconds()] if timeout else []), backend=backend)
        if device.type == "cuda":
            device = torch.device("cuda", info.local_rank)
            torch.cuda.set_device(device)
        if os.environ.get("ACCELERATE_TORCH_DEVICE"):  # Accelerate's override of the device
            device = torch.device(os.environ["ACCELERATE_TORCH_DEVICE"])
        #: Which process this is among all of them, and what runs where (a part; ``state`` holds it too).
        self.processes = Processes(info, device)
        policy = resolve_precision(mixed_precision if mixed_precision is not None else "fp32", device)
        # (bf16-true computes in bf16: Accelerate's code that reads the precision reads "bf16")
        _share_with_accelerate(cpu=device.type == "cpu", mixed_precision=accelerate_word(policy).split("-")[0])
        #: What the run's precision does (read at call time by the prepared models and optimizers).
        if scaler_kwargs and policy.needs_loss_scaler and precision_config.loss_scaler is None:
            # GradScalerKwargs set the fp16 scaler (where there is none, Accelerate ignores it too).
            precision_config = self.precision_config = dataclasses.replace(precision_config, loss_scaler=scaler_kwargs)
        ao = handlers.get("AORecipeKwargs")
        if ao is not None and policy.float8_linears:
            precision_config = self.precision_config = dataclasses.replace(precision_config, **_fp8_fields(ao))
        current = CurrentPrecision(build_precision(policy, device, precision_config, sharded=self.fsdp_plugin is not None))
        #: Who this process is (Accelerate's ``accelerator.state``; this Accelerator's own, not global).
        self.state = AcceleratorState(self.processes, mixed_precision=accelerate_word(policy))
        self.state.is_fsdp2 = self.fsdp_plugin is not None
        self.state.fsdp_plugin = self.fsdp_plugin
        #: Experiment tracking (``log_with``): started by :meth:`init_trackers`, on the main process.
        self.tracking = Trackers(log_with, self.project_configuration.logging_dir)
        #: Gradient accumulation as the loop sees it (Accelerate's ``accelerator.gradient_state``).
        self.gradient_state = GradientState(gradient_accumulation_steps, plugin.adjust_scheduler,
                                            plugin.sync_with_dataloader, plugin.sync_each_batch)
        self.ddp_comm_hook = ddp_comm_hook
        self.step = 0  # micro-batches seen by accumulate(), as Accelerate counts them
        #: Everything prepared (and registered for checkpointing), in order; what save_state writes.
        self.prepared = PreparedObjects()
        #: What the prepared objects really train in (see :meth:`precision_report`).
        self.audit = PrecisionAudit()
        #: What each prepared optimizer's ``step()`` does, in :attr:`precision` (which it holds).
        self.steps = OptimizerSteps(current=current, gradient_state=self.gradient_state, prepared=self.prepared,
                                    audit=self.audit, state=self.state, precision_config=precision_config,
                                    device=device, sharded=self.fsdp_plugin is not None)
        self._clip_owners: tuple[Any, list[Any]] | None = None  # (ids of the parameters clipped and optimizers, theirs)
        #: ``prepare`` and its parts.
        self.preparer = Preparer(
            state=self.state, gradient_state=self.gradient_state, steps=self.steps,
            prepared=self.prepared, audit=self.audit, diagnostics=self.diagnostics, fsdp_plugin=self.fsdp_plugin,
            # The dtype DDP's all-reduce sends gradients in, when ddp_comm_hook compresses them.
            ddp_wire_dtype=_DDP_WIRE_DTYPES.get(ddp_comm_hook),
            compile=compile, dataloader_config=self.dataloader_config, device_placement=device_placement,
            step_scheduler_with_optimizer=step_scheduler_with_optimizer, ddp_kwargs=ddp_kwargs)
        #: Checkpoints in and out, and the model out.
        self.checkpointer = Checkpointer(processes=self.processes, prepared=self.prepared,
                                         project=self.project_configuration, device=device,
                                         sharded=self.fsdp_plugin is not None)

    @property
    def precision(self) -> PrecisionPlugin:
        """The run's current precision plugin (the step); assigning one switches the run to it."""
        return self.steps.current.plugin

    @precision.setter
    def precision(self, plugin: PrecisionPlugin) -> None:
        self.steps.current.plugin = plugin

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken, applied or skipped, counted by the first prepared optimizer."""
        return self.steps.count

    @optimizer_steps.setter
    def optimizer_steps(self, value: int) -> None:
        self.steps.count = value

    @property
    def precision_fallbacks(self) -> list[dict[str, Any]]:
        """The run's switches to another precision (``{"step", "from", "to"}``), oldest first."""
        return self.steps.fallbacks

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
        """The current precision's loss scaler (``None`` without one, or after a precision fallback).

        Assignable, as Accelerate's: a :class:`~mixprec.LossScaler` or a ``torch.amp.GradScaler``
        (taken with its settings and state) steps every prepared optimizer from then on; ``None``
        scales nothing (see :meth:`~mixprec.precision.base.PrecisionPlugin.use_scaler`)."""
        return self.precision.scaler

    @scaler.setter
    def scaler(self, scaler: LossScaler | torch.amp.GradScaler | None) -> None:
        self.precision.use_scaler(scaler)
        if self.monitor is not None:
            self.monitor.use_scaler(self.precision.scaler)

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

    @property
    def mixed_precision(self) -> str:
        """The precision in Accelerate's words: ``"no"``, ``"fp16"``, ``"bf16"`` (or ``"bf16-true"``)."""
        return accelerate_word(self.policy)

    @property
    def use_distributed(self) -> bool:
        return self.state.use_distributed

    # -- settings the preparer holds -------------------------------------------------------
    @property
    def device_placement(self) -> bool:
        """Whether prepared models and batches are moved to :attr:`device` (settable)."""
        return self.preparer.device_placement

    @device_placement.setter
    def device_placement(self, value: bool) -> None:
        self.preparer.device_placement = value

    @property
    def compile(self) -> bool | dict:
        """``torch.compile`` of prepared models (``True`` or its arguments; ``False``: off)."""
        return self.preparer.compile

    @property
    def step_scheduler_with_optimizer(self) -> bool:
        return self.preparer.step_scheduler_with_optimizer

    @property
    def monitor(self) -> Monitor | None:
        """The diagnostics' monitor of the prepared models (``None`` with diagnostics off)."""
        return self.steps.monitor

    # -- prepare (the preparer's) ------------------------------------------------------------
    def prepare(self, *objects: Any, device_placement: list[bool | None] | None = None) -> Any:
        """Wrap models, optimizers, schedulers and dataloaders; returns them in the order given.

        Anything else (``None``, a list, a tokenizer) comes back unchanged, as in Accelerate; an
        object prepared already comes back as it is. ``device_placement`` (one entry per object)
        overrides the Accelerator's for the models among them.
        """
        return self.preparer.prepare(*objects, device_placement=device_placement)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        """Move ``model`` to the device, convert it for the precision (bf16 parameters for
        bf16-true), run its forward in the current precision, and shard it with FSDP2 or wrap it
        in ``DistributedDataParallel`` when several processes run. A model prepared already is
        returned as it is (registered again after :meth:`free_memory`). ``evaluation_mode=True``
        (Accelerate's; transformers' Trainer uses it to evaluate without training, trl for a
        reference model): for inference, neither DDP nor FSDP2 wraps it."""
        return self.preparer.prepare_model(model, device_placement, evaluation_mode)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          device_placement: bool | None = None) -> AcceleratedOptimizer:
        """Wrap ``optimizer`` so that ``step()`` goes through the precision plugin (bf16-true
        first swaps a fresh AdamW/SGD for its compensated twin); ``device_placement`` (default:
        the Accelerator's): a state loaded into it goes to the device."""
        return self.preparer.prepare_optimizer(optimizer, device_placement)

    def prepare_scheduler(self, scheduler: Any, *, steps_per_call: int | None = None) -> AcceleratedScheduler:
        """Wrap ``scheduler`` so that it steps only when its optimizer's step was applied (see
        ``step_scheduler_with_optimizer``). ``steps_per_call`` overrides Accelerate's count of
        schedule steps per applied step (the number of processes, or 1 with ``split_batches``)."""
        return self.preparer.prepare_scheduler(scheduler, steps_per_call=steps_per_call)

    def prepare_data_loader(self, data_loader: torch.utils.data.DataLoader, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None, *, checkpoint: bool = True) -> PreparedDataLoader:
        """Batches on the device (``device_placement``, default: the Accelerator's), and each
        process its own shard of every batch round; ``checkpoint``: save and restore its position
        in :meth:`save_state`.

        Raises:
            NotImplementedError: ``slice_fn_for_dispatch`` given: a dispatched batch round is sent
                whole, one batch per process, not sliced from one joined batch.
        """
        if slice_fn_for_dispatch is not None:
            raise NotImplementedError("slice_fn_for_dispatch: mixprec's dispatch sends each process a whole batch "
                                      "of its own (Accelerate's order), it does not slice one joined batch; leave "
                                      "it out, or slice inside the loop (accelerator.process_index)")
        return self.preparer.prepare_data_loader(data_loader, device_placement, checkpoint=checkpoint)

    def skip_first_batches(self, dataloader: PreparedDataLoader, num_batches: int = 0) -> PreparedDataLoader:
        """Start ``dataloader``'s next epoch at batch ``num_batches``, without loading the ones before.

        Returns the same prepared dataloader (the skip applies to one epoch). After
        :meth:`load_state` the dataloader already resumes at the saved batch; calling this sets
        the start instead of adding to it.
        """
        return self.preparer.skip_first_batches(dataloader, num_batches)

    # -- checkpoints and the model out (the checkpointer's) ------------------------------------
    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore these objects (anything with ``state_dict``/``load_state_dict``) in ``save_state``.

        Raises:
            ValueError: listing every object (by its index) that has no ``state_dict``/``load_state_dict``.
        """
        self.checkpointer.register(*objects)

    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> torch.nn.Module:
        """The user's module without the DDP wrapper; with ``keep_torch_compile=True`` (Accelerate's
        default) a compiled model stays compiled around it, and with ``keep_fp32_wrapper=False``
        its forward loses the precision's autocast."""
        return self.checkpointer.unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The model's ``state_dict`` (of the user's module, without wrapper prefixes, when ``unwrap``).

        A sharded model's is gathered whole onto the CPU of every rank (call it on every rank).
        """
        return self.checkpointer.get_state_dict(model, unwrap)

    def save_model(self, model: torch.nn.Module, save_directory: str | os.PathLike, max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> Path:
        """Write the model's weights into ``save_directory`` (main process only), atomically.

        ``model.safetensors``, or ``pytorch_model.bin`` with ``safe_serialization=False`` (tensors
        only: it loads with ``torch.load(weights_only=True)``); above ``max_shard_size`` (bytes,
        or ``"500MB"``, ``"10GB"``) the weights are split into numbered shards with an index, in
        the layout ``transformers``' and Accelerate's loaders read.
        """
        return self.checkpointer.save_model(model, save_directory, max_shard_size, safe_serialization)

    def register_save_state_pre_hook(self, hook: Any) -> Any:
        """Call ``hook(models, weights, output_dir)`` before :meth:`save_state` writes.

        As in Accelerate: ``models`` are the prepared models, ``weights`` their state dicts; a hook
        that saves a model itself (``save_pretrained`` of a peft adapter) pops its state dict from
        ``weights``, and the state dicts left are written as ``model_0.safetensors``,
        ``model_1.safetensors``... in order. Called on every process; ``output_dir`` is the staging
        folder, and files the hook writes there join the same atomic write and its manifest.
        Returns a handle whose ``remove()`` unregisters the hook.
        """
        return self.checkpointer.hooks.add_save(hook)

    def register_load_state_pre_hook(self, hook: Any) -> Any:
        """Call ``hook(models, input_dir)`` in :meth:`load_state`, after the checkpoint's files
        verify and before anything is restored, on every process. As in Accelerate, a hook that
        loads a model itself pops it from ``models``; the models left take ``model_0.safetensors``,
        ``model_1.safetensors``... in order, so files a save hook kept out are not needed. Returns
        a handle whose ``remove()`` unregisters it."""
        return self.checkpointer.hooks.add_load(hook)

    def save_state(self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True, *,
                   extra_files: dict[str, str | bytes] | None = None, async_save: bool = False,
                   finish: Callable[[Path, dict[str, list[str]]], None] | None = None,
                   model_only: bool = False) -> Path:
        """Write everything needed to continue bit for bit into ``output_dir``, atomically.

        Model weights as safetensors (whatever ``safe_serialization`` says: the checkpoint is read
        back only by :meth:`load_state`); optimizer, scheduler, scaler, dataloader positions and
        RNG states (one file per process) with ``torch.save``; a manifest with sizes and sha256.
        The folder appears only when complete. Without ``output_dir``, a project configuration
        with ``automatic_checkpoint_naming`` names it ``checkpoints/checkpoint_<i>`` and, with
        ``total_limit``, deletes the oldest once the new one is complete. ``extra_files`` (name ->
        text or bytes) join the same atomic write (the Trainer puts ``trainer_state.json`` there);
        ``finish(folder, written)`` is called on the main process with the staging folder and the
        files written by role (``{"model": ["model_0.safetensors"], "optimizer": [...], ...}``)
        before the one commit (the Trainer adds Hugging Face's names there). An iteration left
        open (an optimizer stepped, another not yet) is closed first. ``model_only=True`` writes the
        models alone (the Trainer's ``save_only_model``): weights to load, not a state to resume.

        With ``async_save=True`` the models and optimizers are written by
        ``torch.distributed.checkpoint``'s asynchronous save: the call returns once they are copied
        to CPU memory, the files are written in the background, and the folder still appears only
        when complete (:meth:`wait_for_checkpoint` waits for it; the next save, ``load_state`` and
        ``end_training`` do so themselves).

        Raises:
            OSError: the checkpoint could not be written (a full disk, a file size limit, an I/O
                error), naming it, the reason and the bytes it needs; nothing is left behind.
        """
        self.precision.finish_iteration()
        meta = {"step": self.step, "precision": self.policy.name, "optimizer_steps": self.optimizer_steps,
                "precision_fallback": bool(self.precision_fallbacks)}
        return self.checkpointer.save(output_dir, meta=meta, precision_state=self.precision.state_dict(),
                                      extra_files=extra_files, async_save=async_save, finish=finish,
                                      model_only=model_only)

    def wait_for_checkpoint(self) -> Path | None:
        """Block until the checkpoint being written in the background (``async_save``) is in place;
        returns its folder (``None`` if none was pending). Raises what made it fail."""
        return self.checkpointer.wait()

    def load_state(self, input_dir: str | os.PathLike | None = None, load_kwargs: dict[str, Any] | None = None,
                   **load_model_func_kwargs: Any) -> None:
        """Restore what :meth:`save_state` wrote, after verifying every file against the manifest.

        Without ``input_dir``, the newest automatically named checkpoint of the project. A
        dataloader resumes at the start of the epoch that was running (the loop skips what it
        has seen, e.g. with :meth:`skip_first_batches`), or, with
        ``DataLoaderConfiguration(use_stateful_dataloader=True)``, at the next unseen batch.
        ``load_kwargs`` and ``load_model_func_kwargs`` (Accelerate's arguments of its ``torch.load``
        and model loading) are accepted and not used: every file is read as tensors only
        (safetensors, ``weights_only``), onto the device of what it restores.

        Raises:
            FileNotFoundError: no checkpoint folder there (a :class:`~mixprec.CheckpointError`).
            CheckpointError: naming the file that is missing, truncated, altered, or that holds
                anything but tensors (nothing in it is run).
        """
        meta, precision_state = self.checkpointer.load(input_dir)
        if meta.get("precision_fallback") and meta["precision"] != self.policy.name:
            self.steps.switch(meta["precision"])  # the run had fallen back: keep it so
            self.precision_fallbacks.append({"step": meta.get("optimizer_steps", 0), "to": meta["precision"]})
        self.precision.load_state_dict(precision_state)
        self.audit.scaler_loaded(self.precision.state_dict(), precision_state, enabled=self.scaler is not None)
        self.step = int(meta["step"])
        self.optimizer_steps = int(meta.get("optimizer_steps", 0))

    # -- the step ---------------------------------------------------------------------------
    def autocast(self, autocast_handler: Any = None) -> contextlib.AbstractContextManager:
        """The current precision's forward context (autocast; a no-op for fp32 and bf16-true).
        ``autocast_handler`` (an ``AutocastKwargs``; else the one given in ``kwargs_handlers``)
        with ``enabled=False`` turns it off inside the block."""
        handler = autocast_handler or self.autocast_handler
        if handler is not None and not handler.enabled:
            return torch.autocast(self.device.type, enabled=False)
        return self.precision.forward_context()

    @contextlib.contextmanager
    def profile(self, profile_handler: Any = None) -> Iterator[torch.profiler.profile]:
        """``torch.profiler.profile`` over the block, set by ``profile_handler`` (a ``ProfileKwargs``;
        else the one in ``kwargs_handlers``; else the profiler's defaults). With ``output_trace_dir``
        each process writes ``trace_<process_index>.json`` (Chrome's format) there at the end."""
        from mixprec.accelerator.handlers import ProfileKwargs

        handler = profile_handler or self.profile_handler or ProfileKwargs()
        if not isinstance(handler, ProfileKwargs):
            handler = read_kwargs_handlers([handler])["ProfileKwargs"]
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir is not None:
            os.makedirs(handler.output_trace_dir, exist_ok=True)
            profiler.export_chrome_trace(os.path.join(handler.output_trace_dir, f"trace_{self.process_index}.json"))
            self.wait_for_everyone()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided by the accumulation steps and scaled where the precision needs it."""
        steps = self.gradient_state.num_steps  # (attributes read directly: this runs on every step)
        if steps > 1:
            loss = loss / steps
        self.precision.backward(loss, **kwargs)

    def accumulate(self, *models: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Accumulate gradients over ``gradient_accumulation_steps`` micro-batches.

        Sets :attr:`sync_gradients` when the block is entered: True on the micro-batch that
        completes a group (or ends the dataloader), when the prepared optimizer steps; on the
        others DDP's ``no_sync`` skips the all-reduce and the optimizer's ``step``/``zero_grad``
        do nothing.
        """
        return _Accumulate(self, models)

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
        try:
            for opt in opts:
                self.precision.unscale_gradients(opt.optimizer if isinstance(opt, AcceleratedOptimizer) else opt)
        except LossScaleCollapse as error:
            self.steps.on_collapse(error)

    def _clip(self, parameters: Iterable[torch.Tensor] | torch.Tensor, **how: Any) -> torch.Tensor | None:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        # The optimizers holding them, worked out again only for other parameters (a loop passes
        # the same ones every step; a precision fallback keeps the optimizers).
        key = (tuple(map(id, params)), tuple(map(id, self.prepared.optimizers)))
        if self._clip_owners is None or self._clip_owners[0] != key:
            self._clip_owners = (key, self._optimizers_for(params))
        try:
            norm = self.precision.clip_gradients(params, self._clip_owners[1], **how)
        except LossScaleCollapse as error:
            self.steps.on_collapse(error)
            return None
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

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """:meth:`gather`, and at the last batch of a prepared dataloader, only its real samples.

        As Accelerate: on the dataloader's last batch, what is gathered is cut to the first
        ``gradient_state.remainder`` rows (``len(dataset) % total_batch_size``), which drops the
        samples that padded the last round over the processes, and also the rows of a value
        repeated to the full batch size (a loss repeated per sample, as transformers' evaluation
        loop does), on one process too. Nothing is cut elsewhere, or where the remainder is 0 or
        not known (``-1``: ``drop_last``, a dataset without a length).

        ``use_gather_object`` (or data that is not all tensors): gather Python objects instead, as
        :func:`~mixprec.accelerator.utils.gather_object` does (lists joined in rank order)."""
        objects = use_gather_object or not all(isinstance(t, torch.Tensor) for t in tree_leaves(input_data))
        data = gather_object(input_data) if objects else D.gather(input_data)
        state = self.gradient_state
        if state.end_of_dataloader and (keep := state.remainder) > 0:
            data = data[:keep] if objects else tree_map(lambda t: t[:keep], data)
        return data

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Sum (``"sum"``) or average (``"mean"``) ``tensor`` (each tensor of a nested structure)
        over all processes, multiplied by ``scale`` first (Accelerate's argument)."""
        if scale != 1.0:
            tensor = tree_map(lambda t: t * scale if isinstance(t, torch.Tensor) else t, tensor)
        return D.reduce(tensor, reduction)

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
        elif mode == "ddp":
            reduce_dtype = self.preparer.ddp_wire_dtype
        return self.audit.report(p.name, mode, [unwrap(m) for m in self.prepared.models],
                                 [o.optimizer for o in self.prepared.optimizers], self.scaler,
                                 reduce_dtype=reduce_dtype, moments=self.precision.optimizer_state_dtype,
                                 details=self.precision.report(), precision_violations=self.precision.violations())

    def free_memory(self, *objects: Any) -> Any:
        """Forget every prepared object, collect garbage and empty the device cache (between two
        trainings in one process). Returns a list holding ``None`` for each object passed, to assign back."""
        self.preparer.forget()
        self.precision.forget_optimizers()
        self.audit.reset()  # the next run's objects are observed afresh
        self.gradient_state.dataloader_references.clear()
        self._clip_owners = None
        self.step = 0
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return [None] * len(objects)

    def clear(self, *objects: Any) -> Any:
        """Alias of :meth:`free_memory`."""
        return self.free_memory(*objects)

    # -- experiment tracking (Accelerate's log_with) -------------------------------------------
    @property
    def log_with(self) -> list[Any]:
        """The trackers asked for (names and ``GeneralTracker`` instances)."""
        return self.tracking.log_with

    @property
    def trackers(self) -> list[Any]:
        """The running trackers (none before :meth:`init_trackers`, and none on the other processes)."""
        return self.tracking.trackers

    def init_trackers(self, project_name: str, config: dict[str, Any] | None = None,
                      init_kwargs: dict[str, dict[str, Any]] | None = None) -> None:
        """Start the trackers of ``log_with`` on the main process, store ``config`` (the run's
        hyperparameters) in each; ``init_kwargs[name]`` goes to that tracker's constructor."""
        self.tracking.logging_dir = self.project_configuration.logging_dir
        self.tracking.init(project_name, config, init_kwargs, is_main_process=self.is_main_process)

    def log(self, values: dict[str, Any], step: int | None = None,
            log_kwargs: dict[str, dict[str, Any]] | None = None) -> None:
        """Log ``values`` to every running tracker (a no-op on the other processes)."""
        self.tracking.log(values, step, log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The running tracker ``name`` (its library's own object with ``unwrap``); a placeholder
        that does nothing where none runs (the other processes), as in Accelerate."""
        return self.tracking.get(name, unwrap)

    def end_training(self) -> None:
        """Finish the trackers and a checkpoint still being written, then release the process group,
        if several processes ran."""
        self.tracking.finish()
        self.wait_for_checkpoint()
        if self.use_distributed and torch.distributed.is_initialized():
            self.wait_for_everyone()
            torch.distributed.destroy_process_group()

    # -- Accelerate's remaining surface ------------------------------------------------------
    # What Accelerate's Accelerator offers for set-ups mixprec does not run (DeepSpeed, Megatron,
    # tensor/context/pipeline parallelism, fp8, LOMO) reads as "not in use"; using one is an error.
    deepspeed_plugin = None
    parallelism_config = None
    torch_device_mesh = None
    te_recipe_handler = None
    delayed_fp8_autocast = False

    @property
    def fp8_enabled(self) -> bool:
        """Whether Linear layers train in float8 (``mixed_precision="fp8"``)."""
        return self.policy.float8_linears

    @property
    def fp8_backend(self) -> str:
        """``"AO"`` (torchao) under fp8, else ``"NO"`` (Accelerate's ``FP8BackendType`` values)."""
        return "AO" if self.fp8_enabled else "NO"

    @property
    def has_fp8_handler(self) -> bool:
        """Whether an fp8 recipe handler (``AORecipeKwargs``) was given."""
        return "AORecipeKwargs" in self._handlers

    @property
    def ao_recipe_handler(self) -> Any:
        """The ``AORecipeKwargs`` given, ``None`` without one."""
        return self._handlers.get("AORecipeKwargs")
    has_lomo_optimizer = False
    is_composable_parallelism_enabled = False
    flag_tensor = None
    rng_types = ["generator"]

    @property
    def kwargs_handlers(self) -> dict[str, dict[str, Any]]:
        """What each ``kwargs_handlers`` object given sets (its non-default fields), by class name."""
        return {name: handler.to_kwargs() for name, handler in self._handlers.items()}

    @property
    def ddp_handler(self) -> Any:
        """The ``DistributedDataParallelKwargs`` given in ``kwargs_handlers`` (``None`` if none)."""
        return self._handlers.get("DistributedDataParallelKwargs")

    @property
    def scaler_handler(self) -> Any:
        """The ``GradScalerKwargs`` given in ``kwargs_handlers`` (``None`` if none)."""
        return self._handlers.get("GradScalerKwargs")

    @property
    def init_handler(self) -> Any:
        """The ``InitProcessGroupKwargs`` given in ``kwargs_handlers`` (``None`` if none)."""
        return self._handlers.get("InitProcessGroupKwargs")

    @property
    def is_fsdp2(self) -> bool:
        """Whether models are sharded with FSDP2 (``fsdp_plugin``): mixprec's only FSDP."""
        return self.fsdp_plugin is not None

    @property
    def multi_device(self) -> bool:
        """Several processes on accelerators (not the CPU), as Accelerate defines it."""
        return self.use_distributed and self.distributed_type == DistributedType.MULTI_GPU

    @property
    def native_amp(self) -> bool:
        """Whether torch's autocast is in force (fp16 or bf16 mixed precision). Assigning the value
        it has is allowed (Accelerate's is an attribute); another one raises: the precision decides it."""
        return self.policy.autocast_enabled

    @native_amp.setter
    def native_amp(self, value: bool) -> None:
        if bool(value) != self.native_amp:
            raise ValueError(f"native_amp follows the precision ({self.policy.name}: {self.native_amp}); choose "
                             "the precision instead (mixed_precision='fp16' or 'bf16' runs under autocast)")

    @property
    def should_save_model(self) -> bool:
        """Whether this process writes the model (the local main process, as in Accelerate without parallelism)."""
        return self.is_local_main_process

    @property
    def dispatch_batches(self) -> bool | None:
        return self.dataloader_config.dispatch_batches

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value

    @property
    def use_seedable_sampler(self) -> bool:
        return self.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        return self.dataloader_config.non_blocking

    @property
    def use_stateful_dataloader(self) -> bool:
        return self.dataloader_config.use_stateful_dataloader

    @property
    def data_parallel_rank(self) -> int:
        raise RuntimeError("Data parallelism is not configured. Set `parallelism_config` first. (mixprec has no "
                           "parallelism_config: data parallel rank = accelerator.process_index)")

    @property
    def data_parallel_shard_rank(self) -> int:
        raise RuntimeError("Shard-based data parallelism is not configured. Set `parallelism_config` first. (mixprec "
                           "shards with fsdp_plugin: the shard rank is accelerator.process_index)")

    @property
    def tensor_parallel_rank(self) -> int:
        raise RuntimeError("Tensor parallelism is not configured: mixprec does not run tensor parallelism")

    @property
    def pipeline_parallel_rank(self) -> int:
        raise RuntimeError("Pipeline parallelism is not configured: mixprec does not run pipeline parallelism")

    @property
    def context_parallel_rank(self) -> int:
        raise NotImplementedError("Context parallelism is not supported (in Accelerate either)")

    @contextlib.contextmanager
    def maybe_context_parallel(self, buffers: list[torch.Tensor] | None = None,
                               buffer_seq_dims: list[int] | None = None,
                               no_restore_buffers: set[torch.Tensor] | None = None) -> Iterator[None]:
        """A no-op: context parallelism is not configured (as Accelerate's without ``parallelism_config``)."""
        yield

    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: Any) -> Any:
        """``dl`` unchanged: no sequence parallelism here (Accelerate's with ``sp_size`` 1)."""
        return dl

    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        """LOMO's fused backward: not supported (LOMO optimizers update inside backward, around the scaler)."""
        raise ValueError("LOMO optimizers are not supported by mixprec: use a torch optimizer and "
                         "accelerator.backward(loss)")

    def verify_device_map(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` was dispatched over several devices by big-model inference (``hf_device_map``)."""
        return any(len(getattr(m, "hf_device_map", ())) > 1 for m in model.modules())

    @staticmethod
    @contextlib.contextmanager
    def trigger_sync_in_backward(model: torch.nn.Module) -> Iterator[None]:
        """Make the next ``backward`` all-reduce the gradients even inside :meth:`no_sync` (DDP's
        ``_inside_ddp_forward`` trick, as Accelerate does); a no-op in one process."""
        if not isinstance(model, DistributedDataParallel):
            yield
            return
        old = (model.require_backward_grad_sync, model.require_forward_param_sync)
        model.require_backward_grad_sync = True
        model.require_forward_param_sync = True
        model.reducer.prepare_for_backward([])  # the next backward syncs
        try:
            yield
        finally:
            model.require_backward_grad_sync, model.require_forward_param_sync = old

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list[Any], even_batches: bool | None = None) -> Iterator[None]:
        """torch's ``Join`` over the prepared DDP models (``joinables``), for processes that see
        different numbers of batches; ``even_batches`` overrides the loaders' setting inside the block.
        A no-op, with a warning, in one process."""
        from torch.distributed.algorithms.join import Join

        old = self.dataloader_config.even_batches
        loaders = [dl for dl in self.prepared.dataloaders if dl.even_batches is not None]
        before = [dl.even_batches for dl in loaders]
        if even_batches is not None:
            self.dataloader_config.even_batches = even_batches
            for dl in loaders:
                dl.even_batches = even_batches
        try:
            if self.use_distributed:
                with Join(joinables):
                    yield
            else:
                import warnings

                warnings.warn("join_uneven_inputs does nothing in one process", stacklevel=3)
                yield
        finally:
            self.dataloader_config.even_batches = old
            for dl, value in zip(loaders, before):
                dl.even_batches = value

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad each tensor (in any nesting) along ``dim`` to the largest size any process has, so they gather."""
        def pad(t: Any) -> Any:
            if not torch.is_tensor(t) or dim >= t.dim() or not self.use_distributed:
                return t
            size = torch.tensor([t.shape[dim]], device=self.device)
            longest = int(D.gather(size).max())
            if t.shape[dim] == longest:
                return t
            shape = list(t.shape)
            shape[dim] = longest
            out = t.new_full(shape, pad_index)
            index = [slice(None)] * t.dim()
            index[dim] = slice(longest - t.shape[dim], longest) if pad_first else slice(0, t.shape[dim])
            out[tuple(index)] = t
            return out
        return tree_map(pad, tensor)

    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> contextlib.AbstractContextManager:
        """This process's share of ``inputs`` (a list, tuple, tensor or a dict of them): contiguous
        slices, the first processes taking one more when it does not divide; ``apply_padding``
        repeats the last element so every share has the same length."""
        return self.state.split_between_processes(inputs, apply_padding)

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """Write ``obj`` once (the main process; each machine's with ``ProjectConfiguration(
        save_on_each_node=True)``), with ``torch.save`` or, with ``safe_serialization``,
        safetensors (a dict of tensors), as Accelerate's ``save`` does."""
        writer = self.is_local_main_process if self.project_configuration.save_on_each_node else self.is_main_process
        if not writer:
            return
        if safe_serialization:
            import safetensors.torch

            safetensors.torch.save_file(obj, str(f), metadata={"format": "pt"})
        else:
            torch.save(obj, f)

    def __repr__(self) -> str:
        return (f"Accelerator(precision={self.policy.name!r}, device={str(self.device)!r}, "
                f"num_processes={self.num_processes}, gradient_accumulation_steps={self.gradient_accumulation_steps})")


def _share_with_accelerate(cpu: bool, mixed_precision: str) -> None:
    """Where the script (or a library it uses: transformers' Trainer, trl) also uses Accelerate's
    utilities (``accelerate.logging.get_logger``, ``accelerate.utils.set_seed(device_specific=True)``,
    ``gather_object``...), set up the process state they read: Accelerate's ``PartialState`` (who
    this process is; the process group mixprec made) and ``AcceleratorState`` (the same, and the
    precision in Accelerate's words). Accelerate keeps one of each per process: with several
    mixprec Accelerators, its ``mixed_precision`` is the newest one's. Its gradient state stays
    Accelerate's own, unused: mixprec's Accelerators hold their own."""
    import sys

    if "accelerate" not in sys.modules:  # the script does not use Accelerate: nothing to set up
        return
    try:
        from accelerate.state import AcceleratorState, PartialState
        from accelerate.utils import TorchDynamoPlugin

        if not PartialState._shared_state:
            PartialState(cpu=cpu)
        if not AcceleratorState._shared_state or AcceleratorState._shared_state == PartialState._shared_state:
            AcceleratorState(mixed_precision=mixed_precision, cpu=cpu, dynamo_plugin=TorchDynamoPlugin(),
                             _from_accelerator=True)
        else:  # made already (by an earlier Accelerator): the precision is this one's now
            AcceleratorState._shared_state["_mixed_precision"] = mixed_precision
    except Exception as e:  # noqa: BLE001 - Accelerate's utilities then say what they need themselves
        import logging

        logging.getLogger("mixprec").debug("mixprec: Accelerate's process state was not set up: %s", e)


def _env_flag(name: str) -> bool:
    """A flag `accelerate launch` sets (Accelerate's truth values: y/yes/t/true/on/1)."""
    return os.environ.get(name, "").strip().lower() in ("y", "yes", "t", "true", "on", "1")


def _fp8_fields(ao: Any) -> dict[str, Any]:
    """The ``PrecisionConfig`` fields an ``AORecipeKwargs`` sets: torchao's config (with its
    ``pad_inner_dim`` / ``enable_fsdp_float8_all_gather`` if given) and the layer filter."""
    fields: dict[str, Any] = {}
    config = ao.config
    tweaks = {k: v for k in ("pad_inner_dim", "enable_fsdp_float8_all_gather") if (v := getattr(ao, k)) is not None}
    if config is None and tweaks:
        from mixprec.precision.fp8 import torchao_float8

        config = torchao_float8().Float8LinearConfig()
    if config is not None:
        fields["fp8_recipe"] = dataclasses.replace(config, **tweaks) if tweaks else config
    if ao.module_filter_func is not None:
        fields["fp8_filter"] = ao.module_filter_func
    return fields


class _Accumulate:
    """:meth:`Accelerator.accumulate`'s block: the micro-batch counted when it is entered, and DDP's
    ``no_sync`` entered for the models only on the micro-batches that do not sync (a class, not a
    generator: it is entered on every micro-batch of every training)."""

    __slots__ = ("acc", "models", "stack")

    def __init__(self, acc: Accelerator, models: tuple[torch.nn.Module, ...]) -> None:
        self.acc, self.models, self.stack = acc, models, None

    def __enter__(self) -> None:
        acc = self.acc
        gs = acc.gradient_state  # (read directly, not through the Accelerator's properties: every micro-batch)
        if gs.sync_with_dataloader and gs.end_of_dataloader:
            acc.step, gs.sync_gradients = 0, True
        else:
            acc.step += 1
            gs.sync_gradients = acc.step % gs.num_steps == 0
        if not (gs.sync_gradients or gs.sync_each_batch) and self.models:
            self.stack = contextlib.ExitStack()
            for m in self.models:
                self.stack.enter_context(acc.no_sync(m))

    def __exit__(self, *exc: Any) -> None:
        if self.stack is not None:
            stack, self.stack = self.stack, None
            stack.__exit__(*exc)
