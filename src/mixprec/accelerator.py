"""The Accelerator tier: the user keeps their loop; precision, devices and processes are ours.

Code written for Hugging Face Accelerate's core API runs with ``from mixprec import
Accelerator``. Unlike Accelerate there is no shared global state (several Accelerators with
different precisions may live in one process), and fp16 on the CPU is real.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from . import distributed as D
from .data import PreparedDataLoader
from .diagnostics.monitor import DiagnosticsConfig, Monitor
from .fallback import fallback_target, log_fallback
from .hardware import default_device
from .precision import BF16TrueConfig, PrecisionPlugin, PrecisionPolicy, make_plugin, resolve_precision
from .scaler import LossScaleCollapse, LossScaler
from .state import PreparedObjects, load_accelerator_state, save_accelerator_state
from .wrappers import (
    AcceleratedOptimizer,
    AcceleratedScheduler,
    OptimizerHooks,
    patch_forward,
    unpatch_forward,
    unwrap,
)

__all__ = ["Accelerator"]

_ACCELERATE_NAMES = {"fp32": "no", "fp16-mixed": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16-true"}
_SUPPORTED = "torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, torch.utils.data.DataLoader"


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


class Accelerator:
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
                 bf16_true_state_dtype: torch.dtype | str = torch.float32) -> None:
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
        device = torch.device("cpu") if cpu else default_device()
        self._process = D.init_from_env(device.type)
        if device.type == "cuda":
            device = torch.device("cuda", self._process.local_rank)
            torch.cuda.set_device(device)
        self.device = device
        policy = resolve_precision(mixed_precision if mixed_precision is not None else "fp32", device)
        #: What the run's precision does (read at call time by the prepared models and optimizers).
        self.precision: PrecisionPlugin = make_plugin(policy, device, loss_scaler=loss_scaler, bf16_true=self.bf16_true)
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.device_placement = device_placement
        self.ddp_comm_hook = ddp_comm_hook
        self.step = 0  # micro-batches seen by accumulate(), as Accelerate counts them
        self.sync_gradients = True
        #: Everything prepared (and registered for checkpointing), in order; what save_state writes.
        self.prepared = PreparedObjects()
        self._active_dataloaders: list[PreparedDataLoader] = []
        self._optimizer_hooks = OptimizerHooks(step=self._step_optimizer, zero_grad=self._zero_grad,
                                               precision=self._current_precision)
        self.monitor: Monitor | None = None
        self.optimizer_steps = 0  # applied or skipped, counted by the first prepared optimizer
        self.precision_fallbacks: list[dict[str, Any]] = []

    def _current_precision(self) -> PrecisionPlugin:
        return self.precision

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

    # -- who am I -----------------------------------------------------------------------
    @property
    def num_processes(self) -> int:
        return self._process.world_size

    @property
    def process_index(self) -> int:
        return self._process.rank

    @property
    def local_process_index(self) -> int:
        return self._process.local_rank

    @property
    def is_main_process(self) -> bool:
        return self._process.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self._process.local_rank == 0

    @property
    def mixed_precision(self) -> str:
        """The precision in Accelerate's words: ``"no"``, ``"fp16"``, ``"bf16"`` (or ``"bf16-true"``)."""
        return _ACCELERATE_NAMES[self.policy.name]

    @property
    def use_distributed(self) -> bool:
        return self._process.is_distributed

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        """A barrier across processes (a no-op in one process)."""
        D.barrier()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the body on the main process first, then on the others (e.g. to build a cache once)."""
        if not self.is_main_process:
            self.wait_for_everyone()
        yield
        if self.is_main_process:
            self.wait_for_everyone()

    # -- prepare --------------------------------------------------------------------------
    def prepare(self, *objects: Any) -> Any:
        """Wrap models, optimizers, schedulers and dataloaders; returns them in the order given.

        Raises:
            TypeError: for an object of any other type, naming the supported ones.
        """
        kinds = [_kind(obj) for obj in objects]
        for obj, kind in zip(objects, kinds):
            if kind is None:
                raise TypeError(f"Accelerator.prepare() cannot prepare a {type(obj).__module__}.{type(obj).__name__}; "
                                f"it prepares {_SUPPORTED}")
        prepare = {"model": self.prepare_model, "optimizer": self.prepare_optimizer,
                   "dataloader": self.prepare_data_loader, "scheduler": self.prepare_scheduler}
        out: list[Any] = list(objects)
        # Models before optimizers (bf16-true casts the parameters the optimizer holds), and
        # schedulers last, since they must find their prepared optimizer.
        for wanted in ("model", "optimizer", "dataloader", "scheduler"):
            for i, (obj, kind) in enumerate(zip(objects, kinds)):
                if kind == wanted:
                    out[i] = prepare[kind](obj)
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None) -> torch.nn.Module:
        """Move ``model`` to the device, convert it for the precision (bf16 parameters for
        bf16-true), run its forward in the current precision, and wrap it in
        ``DistributedDataParallel`` when several processes run."""
        if device_placement if device_placement is not None else self.device_placement:
            model.to(self.device)
        self.precision.convert_module(model)
        patch_forward(model, self._current_precision)
        if self.diagnostics.enabled:
            if self.monitor is None:
                self.monitor = Monitor(self.diagnostics, scaler=self.scaler)
            self.monitor.watch(model)
        if self.use_distributed:
            ids = [self.device.index] if self.device.type == "cuda" else None
            model = DistributedDataParallel(model, device_ids=ids)
            if self.ddp_comm_hook is not None:
                model.register_comm_hook(state=None, hook=D.compress_hook(self.ddp_comm_hook))
        if self.compile:
            # Compiled around the precision's forward, so autocast is traced into the graph.
            model = torch.compile(model, **(self.compile if isinstance(self.compile, dict) else {}))
        self.prepared.models.append(model)
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> AcceleratedOptimizer:
        """Wrap ``optimizer`` so that ``step()`` goes through the precision plugin (bf16-true
        first swaps a fresh AdamW/SGD for its compensated twin)."""
        if isinstance(optimizer, AcceleratedOptimizer):
            optimizer = optimizer.optimizer
        converted = self.precision.convert_optimizer(optimizer)
        self.precision.track_optimizer(converted)
        wrapped = AcceleratedOptimizer(converted, self._optimizer_hooks, original=optimizer)
        self.prepared.optimizers.append(wrapped)
        return wrapped

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Wrap ``scheduler`` so that it steps only when its optimizer's step was applied."""
        optimizers = self.prepared.optimizers
        mine = [o for o in optimizers if scheduler.optimizer in (o.optimizer, o.original_optimizer)]
        wrapped = AcceleratedScheduler(scheduler, mine or optimizers, lambda: self.sync_gradients)
        self.prepared.schedulers.append(wrapped)
        return wrapped

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
        seed = D.broadcast_object(int(torch.randint(0, 2**62, (1,)).item())) if needs_seed else 0
        device = self.device if self.device_placement else None
        prepared = PreparedDataLoader(dataloader, device=device, world_size=self.num_processes, rank=self.process_index,
                                      seed=seed, float_dtype=self.precision.input_dtype, on_iter=self._track_dataloader,
                                      on_end=self._untrack_dataloader)
        if checkpoint:
            self.prepared.dataloaders.append(prepared)
        return prepared

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
        """Save and restore these objects (anything with ``state_dict``/``load_state_dict``) in ``save_state``."""
        for obj in objects:
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"{type(obj).__name__} has no state_dict()/load_state_dict(); it cannot be checkpointed")
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

    def _track_dataloader(self, dl: PreparedDataLoader) -> None:
        if dl in self._active_dataloaders:
            self._active_dataloaders.remove(dl)
        self._active_dataloaders.append(dl)

    def _untrack_dataloader(self, dl: PreparedDataLoader) -> None:
        if dl in self._active_dataloaders:
            self._active_dataloaders.remove(dl)

    @property
    def _end_of_dataloader(self) -> bool:
        return bool(self._active_dataloaders) and self._active_dataloaders[-1].end_of_dataloader

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
            if not self.sync_gradients:
                for m in models:
                    if isinstance(m, DistributedDataParallel):
                        stack.enter_context(m.no_sync())
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
            return self.precision.clip_gradients(params, self._optimizers_for(params), **how)

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
        self.precision = make_plugin(name, self.device, bf16_true=self.bf16_true)
        for o in self.prepared.optimizers:
            self.precision.track_optimizer(o.optimizer)

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
        remainder = self._active_dataloaders[-1].remainder if self._end_of_dataloader else 0
        if remainder:
            data = _truncate(data, remainder)
        return data

    def reduce(self, tensor: Any, reduction: str = "sum") -> Any:
        """Sum (``"sum"``) or average (``"mean"``) ``tensor`` over all processes."""
        return D.reduce(tensor, reduction)

    # -- models out ---------------------------------------------------------------------
    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True) -> torch.nn.Module:
        """The user's own module: without DDP or ``torch.compile`` wrappers (and, with
        ``keep_fp32_wrapper=False``, without the precision's forward)."""
        model = unwrap(model)
        return model if keep_fp32_wrapper else unpatch_forward(model)

    def get_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The unwrapped model's ``state_dict``."""
        return self.unwrap_model(model).state_dict()

    def save_model(self, model: torch.nn.Module, save_directory: str | os.PathLike) -> Path:
        """Write ``model.safetensors`` into ``save_directory`` (main process only), atomically."""
        path = Path(save_directory)
        if self.is_main_process:
            path.mkdir(parents=True, exist_ok=True)
            tmp = path / ".model.safetensors.tmp"
            safetensors.torch.save_model(self.unwrap_model(model), str(tmp))
            os.replace(tmp, path / "model.safetensors")
        self.wait_for_everyone()
        return path

    # -- checkpoints -------------------------------------------------------------------
    def save_state(self, output_dir: str | os.PathLike, *, extra_files: dict[str, str | bytes] | None = None) -> Path:
        """Write everything needed to continue bit for bit into ``output_dir``, atomically.

        Model weights as safetensors; optimizer, scheduler, scaler, dataloader positions and
        RNG states (one file per process) with ``torch.save``; a manifest with sizes and sha256.
        The folder appears only when complete. ``extra_files`` (name -> text or bytes) join the
        same atomic write (the Trainer puts ``trainer_state.json`` there). An iteration left open
        (an optimizer stepped, another not yet) is closed first: gradients are not saved.
        """
        self.precision.finish_iteration()
        meta = {"step": self.step, "precision": self.policy.name, "optimizer_steps": self.optimizer_steps,
                "precision_fallback": bool(self.precision_fallbacks)}
        return save_accelerator_state(Path(output_dir), self.prepared, self._process, self.precision.state_dict(),
                                      meta, extra_files or {})

    def load_state(self, input_dir: str | os.PathLike) -> None:
        """Restore what :meth:`save_state` wrote, after verifying every file against the manifest.

        Raises:
            CheckpointError: naming the file that is missing, truncated, altered, or that holds
                anything but tensors (nothing in it is run).
        """
        meta, precision_state = load_accelerator_state(Path(input_dir), self.prepared, self._process, self.device)
        if meta.get("precision_fallback") and meta["precision"] != self.policy.name:
            self._switch_precision(meta["precision"])  # the run had fallen back: keep it so
            self.precision_fallbacks.append({"step": meta.get("optimizer_steps", 0), "to": meta["precision"]})
        self.precision.load_state_dict(precision_state)
        self.step = int(meta["step"])
        self.optimizer_steps = int(meta.get("optimizer_steps", 0))

    def end_training(self) -> None:
        """Release the process group, if several processes ran."""
        if self.use_distributed and torch.distributed.is_initialized():
            self.wait_for_everyone()
            torch.distributed.destroy_process_group()

    def __repr__(self) -> str:
        return (f"Accelerator(precision={self.policy.name!r}, device={str(self.device)!r}, "
                f"num_processes={self.num_processes}, gradient_accumulation_steps={self.gradient_accumulation_steps})")


def _truncate(data: Any, n: int) -> Any:
    if isinstance(data, dict):
        return type(data)({k: _truncate(v, n) for k, v in data.items()})
    if isinstance(data, (list, tuple)) and not isinstance(data, torch.Tensor):
        return type(data)(_truncate(v, n) for v in data)
    return data[: len(data) - n]
