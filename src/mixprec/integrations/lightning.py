"""mixprec's precision under Lightning: :class:`MixprecPrecision`, a precision plugin for
``lightning.pytorch.Trainer(plugins=[...])`` and ``lightning.fabric.Fabric(plugins=[...])``.

One plugin class serves both, as Lightning's own ``Precision`` does: the Trainer calls it with its
``LightningModule`` (its hooks run, its ``backward`` is called), Fabric with plain modules. What a
precision does is mixprec's plugin for it (:func:`~mixprec.precision.make_plugin`), held and asked
at call time as the Accelerator asks it: the forward's context, the inputs and outputs, the module
and optimizer conversions, the loss scaler's whole step (:class:`~mixprec.precision.ScaledSteps`:
scale, unscale once, step or skip, update once per iteration). This module only maps Lightning's
calls onto it, and adds what Lightning has no place for: the optimizers adopted where Lightning
shows them (the Trainer's ``connect``, Fabric's ``setup``), each scheduler held back on a skipped
step, the scale and skips in Lightning's log, the precision really in force
(:class:`~mixprec.accelerator.audit.PrecisionAudit`), the scaler's state in Lightning's checkpoint.
Sharded training (``FSDPStrategy``, ``ModelParallelStrategy``) is
:mod:`mixprec.integrations.lightning_sharded`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mixprec.accelerator.audit import PrecisionAudit, PrecisionReport
from mixprec.integrations import lightning_steps as steps
from mixprec.precision import PrecisionConfig, PrecisionPlugin, lightning_name, make_plugin
from mixprec.precision.fallback import fallback_target, log_fallback
from mixprec.precision.fp8 import load_fp8_filter
from mixprec.precision.scaler import LossScaleCollapse, LossScaler

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.precision import Precision as FabricPrecision
    from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
    from lightning_utilities.core.apply_func import apply_to_collection
except ImportError as e:  # pragma: no cover - lightning is in the dev install
    raise ImportError("mixprec.lightning is a precision plugin for Lightning, which is not installed: "
                      "pip install lightning") from e

__all__ = ["MixprecPrecision"]

#: mixprec's own precision options, as the Accelerator takes them (PrecisionConfig's fields).
OPTIONS = ("loss_scaler", "skip_nonfinite_steps", "bf16_true_compensation", "bf16_true_state_dtype",
           "on_loss_scale_collapse", "fp8_recipe", "fp8_filter")


class MixprecPrecision(Precision):
    """mixprec's precision as a Lightning precision plugin, for the Trainer and for Fabric.

    ``Trainer(plugins=[MixprecPrecision("fp16-mixed")])`` (or ``Fabric(plugins=[...])``) in place
    of ``precision="16-mixed"``; nothing else changes. What each precision does:

    - **fp16-mixed**: fp16 autocast on every device, the CPU included (Lightning trains bf16 there);
      steps with inf/NaN gradients skipped, and the Trainer's schedulers not stepped for them; the
      scale updated once per iteration however many optimizers step (torch's recipe for several
      optimizers), with the loss scaler's hysteresis, bounds and collapse guard.
    - **bf16-mixed** and **fp32**: Lightning's own numbers, step for step.
    - **bf16-true**: bf16 weights (normalisation layers kept fp32) and the user's ``AdamW`` or
      ``SGD`` made, in place, its compensated twin (Kahan or stochastic rounding), so updates below
      bf16's resolution still move the weights. The Trainer's optimizers are adopted in
      ``connect``; Fabric's when ``fabric.setup(model, optimizer)`` sets them up with their model
      (one set up on its own is adopted at its first step, if it holds no state yet).
    - **fp8**: torchao's float8 Linear layers (mixprec's default filter, or ``fp8_filter``: layer
      names, a callable, or the file ``mixprec doctor --precision fp8 --write-filter`` wrote);
      emulated on the CPU.

    The loss scale and the skipped steps reach Lightning's log (``loss_scale``, ``skipped_steps``;
    ``fabric.log_dict`` every ``log_every_n_steps`` under Fabric), the precision observed in force
    is logged once (``precision_in_force``) and a skipped step is warned about. The scaler's state
    goes into Lightning's checkpoints under this class's name.

    Args:
        precision: any name :func:`~mixprec.resolve_precision` takes (``"fp16-mixed"``,
            ``"bf16-mixed"``, ``"bf16-true"``, ``"fp8"``, ``"fp32"``, ``"auto"``, and aliases such
            as Lightning's ``"16-mixed"`` and ``"32-true"``).
        device: the device autocast and the loss scaler run on; ``None``: the one Lightning trains
            on, read when it sets the model up (until then CUDA where there is one, else the CPU).
        precision_config: a :class:`~mixprec.precision.PrecisionConfig` (then leave the options out).
        log_every_n_steps: under Fabric, how often the scale and skips go to ``fabric.log_dict``
            and skips are warned about (the Trainer's own ``log_every_n_steps`` under the Trainer).
        **options: mixprec's precision options, as :class:`~mixprec.Accelerator` takes them:
            ``loss_scaler`` (a :class:`~mixprec.LossScaler` or a dict of its arguments:
            ``init_scale``, ``hysteresis``, ``min_scale``, ``max_consecutive_skips``...),
            ``on_loss_scale_collapse`` (``"raise"`` or ``"fallback"``), ``skip_nonfinite_steps``,
            ``bf16_true_compensation``, ``bf16_true_state_dtype``, ``fp8_recipe``, ``fp8_filter``.

    Raises:
        ValueError: an unknown precision name (the error lists the valid ones), or a bad option value.
        TypeError: an option that is not one of mixprec's (listing them).

    Example:
        >>> from mixprec.lightning import MixprecPrecision
        >>> plugin = MixprecPrecision("fp16-mixed", loss_scaler={"init_scale": 1024.0}, device="cpu")
        >>> plugin.precision, plugin.scaler.get_scale()
        ('16-mixed', 1024.0)
        >>> trainer = lightning.pytorch.Trainer(plugins=[plugin])            # doctest: +SKIP
    """

    def __init__(self, precision: str = "fp16-mixed", *, device: str | torch.device | None = None,
                 precision_config: PrecisionConfig | None = None, log_every_n_steps: int = 50,
                 **options: Any) -> None:
        # (Lightning's Precision has no __init__; the sharded subclass's other bases are not called.)
        if unknown := sorted(set(options) - set(OPTIONS)):
            raise TypeError(f"MixprecPrecision() got {', '.join(unknown)}: it takes mixprec's precision options, "
                            f"{', '.join(OPTIONS)} (or precision_config=)")
        if precision_config is not None and options:
            raise ValueError(f"give precision_config= or its fields ({', '.join(options)}), not both")
        if isinstance(options.get("fp8_filter"), (str, os.PathLike)):  # the doctor's file
            options = {**load_fp8_filter(options["fp8_filter"]), **{k: v for k, v in options.items() if k != "fp8_filter"}}
        self._requested = precision
        self._device_given = device is not None
        self._config = precision_config if precision_config is not None else PrecisionConfig(**options)
        self.log_every_n_steps = log_every_n_steps
        #: mixprec's plugin for the precision in force (the step; switched on a precision fallback).
        self.plugin: PrecisionPlugin = self._make(precision, device if device is not None else _default_device())
        #: What the models and optimizers really train in (see :meth:`precision_report`).
        self.audit = PrecisionAudit()
        self.fallbacks: list[dict[str, Any]] = []
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._fabric: Any = None
        self._steps = 0  # steps of the first optimizer, applied or skipped
        self._skipped_said = 0
        self._reported = False
        steps.explain_conflicts()  # Lightning's error for plugins= beside precision= says to pick one

    def _make(self, precision: str, device: str | torch.device, config: PrecisionConfig | None = None) -> PrecisionPlugin:
        plugin = make_plugin(precision, device, config if config is not None else self._config)
        self.precision = lightning_name(plugin.policy.name) or plugin.policy.name  # what trainer.precision reads
        return plugin

    # -- what Lightning reads -------------------------------------------------------------
    @property
    def scaler(self) -> LossScaler | None:
        """The loss scaler (a ``torch.amp.GradScaler`` with ``get_scale()``), as on Lightning's
        ``MixedPrecision``; ``None`` where the precision has none (and after a fallback)."""
        return self.plugin.scaler

    @scaler.setter
    def scaler(self, scaler: LossScaler) -> None:
        # Lightning's MixedPrecision.scaler is an attribute: assigning one is the same as loss_scaler=scaler.
        if not isinstance(scaler, LossScaler):
            raise TypeError(f"MixprecPrecision.scaler takes a mixprec.LossScaler (torch.amp.GradScaler's API, "
                            f"hysteresis, bounds), got {type(scaler).__name__}; or pass loss_scaler={{...}} to the "
                            "plugin")
        self._config = self._config.replace(loss_scaler=scaler)
        self._switch(self.plugin.policy.name, self._config)

    @property
    def device(self) -> str:
        """The type of the device the precision runs on (``"cpu"``, ``"cuda"``), as Lightning's
        ``MixedPrecision.device`` (what ``torch.autocast`` takes)."""
        return self.plugin.device.type

    def sharding_policy(self, reduce_dtype: torch.dtype | None = torch.float32) -> Any:
        """FSDP2's ``MixedPrecisionPolicy`` for the precision, for ``fully_shard(..., mp_policy=)`` in a
        ``configure_model`` under ``ModelParallelStrategy``: parameters gathered in the compute dtype
        over fp32 shards, gradients reduced in ``reduce_dtype`` wherever compute is 16-bit.

        Example:
            >>> MixprecPrecision("bf16-mixed", device="cpu").sharding_policy().param_dtype
            torch.bfloat16
        """
        return self.plugin.sharding_policy(reduce_dtype)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Convert ``module`` for the precision, in place (bf16 weights for bf16-true, float8 Linear
        layers for fp8); under Fabric, also adopt the optimizers set up with it."""
        setup = steps.fabric_setup_call()
        self._settle_device(_trainer_of(module), setup)
        if not any(m is module for m in self._models):
            self.plugin.convert_module(module)
            self.audit.watch_model(module)
            self._models.append(module)
        if setup is not None:
            self._fabric = setup.fabric
            self._settle_backward()
            for optimizer in setup.optimizers:
                self._adopt(optimizer)
        return module

    def _settle_backward(self) -> None:
        """Fabric refuses a plain ``loss.backward()`` where the plugin overrides its backward hooks
        (it reads the methods, as Lightning's ``is_overridden``). Where neither a loss scale nor
        autocast is involved (fp32, bf16-true: where Lightning's own plugins allow it) the plugin
        shows Fabric's own hooks, which are what it would run there anyway."""
        plain = self._fabric is not None and self.plugin.steps is None and not self.plugin.policy.autocast_enabled
        for name in ("pre_backward", "backward", "post_backward"):
            if plain:
                self.__dict__[name] = types.MethodType(getattr(FabricPrecision, name), self)
            else:
                self.__dict__.pop(name, None)

    def tensor_init_context(self) -> Any:
        """Floating tensors made inside (``fabric.init_module()``, the Trainer's ``configure_model``)
        are made in the precision's parameter dtype (bf16 for bf16-true, as Lightning's
        ``HalfPrecision`` makes them; ``convert_module`` then keeps the normalisation layers fp32)."""
        return _default_dtype(self.plugin.policy.param_dtype)

    def module_init_context(self) -> Any:
        """As :meth:`tensor_init_context`."""
        return self.tensor_init_context()

    def forward_context(self) -> Any:
        """The precision's forward context (autocast for the mixed precisions and fp8)."""
        return self.plugin.forward_context()

    def convert_input(self, data: Any) -> Any:
        """The batch as the precision's forward takes it (bf16 floats for bf16-true); under Fabric
        with autocast, floats in the compute dtype too, as Lightning's Fabric ``MixedPrecision``
        casts them (the Trainer's leaves them to autocast, as Lightning's Trainer does)."""
        data = self.plugin.convert_input(data)
        policy = self.plugin.policy
        if self._fabric is None or not policy.autocast_enabled:
            return data
        dtype = policy.compute_dtype
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype) if torch.is_floating_point(t) else t)

    def convert_output(self, data: Any) -> Any:
        """What the forward returned, 16-bit floats cast to fp32 under autocast."""
        return self.plugin.convert_output(data)

    def connect(self, model: Any, optimizers: list[Any], lr_schedulers: list[Any]) -> tuple[Any, list[Any], list[Any]]:
        """The Trainer's optimizers adopted (bf16-true's made compensated in place, every one
        tracked for the once-per-iteration update) and, where steps can be skipped, each scheduler
        held back on a skipped step."""
        self._settle_device(_trainer_of(getattr(model, "module", model)) or _trainer_of(model), None)
        self.plugin.forget_optimizers()
        self._optimizers = []
        for optimizer in optimizers:
            self._adopt(optimizer)
        for config in lr_schedulers:  # (a schedule stepped per epoch steps whatever the last batch did)
            if config.interval == "step":
                config.scheduler = self.wrap_scheduler(config.scheduler)
        return model, optimizers, lr_schedulers

    # -- the step ---------------------------------------------------------------------------
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        """The Trainer's loss, scaled where the precision needs it, then its hooks (Lightning's order)."""
        if _trainer_of(module) is None:
            return None  # Fabric: its backward below scales
        return super().pre_backward(self.plugin.scale_loss(tensor), module)

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        """The backward: the Trainer's through its module's own ``backward`` (the loss scaled
        already), Fabric's of the loss scaled here."""
        if _trainer_of(model) is not None:
            return super().backward(tensor, model, *args, **kwargs)
        self.plugin.scale_loss(tensor).backward(*args, **kwargs)

    def post_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        """The Trainer's hooks after the backward (none under Fabric)."""
        return super().post_backward(tensor, module) if _trainer_of(module) is not None else None

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring ``optimizer``'s gradients to their true values, once per iteration (before clipping)."""
        self.plugin.unscale_gradients(optimizer)

    def optimizer_step(self, optimizer: Any, model: Any = None, closure: Callable[[], Any] | None = None,
                       **kwargs: Any) -> Any:
        """Step ``optimizer``, or skip the step where its gradients hold inf/NaN.

        The Trainer passes its module and the closure (forward and backward): without a loss
        scaler the closure runs inside ``optimizer.step`` as in Lightning; with one it runs first,
        the gradients are unscaled, Lightning's ``on_before_optimizer_step`` and clipping run on
        the true gradients, then the step or skip. Fabric passes the optimizer alone.
        """
        if not isinstance(model, pl.LightningModule):  # Fabric
            self._adopt(optimizer)  # one set up apart from its model, at its first step
            return self._step(optimizer, kwargs.pop("closure", None), kwargs)
        if self.plugin.steps is None:  # nothing to check or skip: Lightning's own step
            out = self._step(optimizer, functools.partial(self._closure, model, optimizer, closure), kwargs)
            self._log(model)
            return out
        if isinstance(optimizer, torch.optim.LBFGS):
            raise MisconfigurationException("AMP and the LBFGS optimizer are not compatible.")
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:  # training_step returned None: no backward
            self._after_closure(model, optimizer)
            return None
        self.plugin.unscale_gradients(optimizer)
        self._after_closure(model, optimizer)
        self._step(optimizer, None, kwargs)
        self._log(model)
        return closure_result

    def _closure(self, model: Any, optimizer: torch.optim.Optimizer, closure: Callable[[], Any]) -> Any:
        """Lightning's closure inside the step (forward, backward, its hooks and clipping), then the
        gradients observed for the audit."""
        out = self._wrap_closure(model, optimizer, closure)
        self.audit.observe_gradients(optimizer)
        return out

    def _step(self, optimizer: torch.optim.Optimizer, closure: Any, kwargs: dict[str, Any]) -> Any:
        self.audit.observe_gradients(optimizer)
        self.before_step(optimizer)
        out = None
        try:
            out = self.plugin.optimizer_step(optimizer, closure, **kwargs)
        except LossScaleCollapse as error:
            self._on_collapse(error)
        first = bool(self._optimizers) and optimizer is self._optimizers[0]
        self._steps += first
        if self._fabric is not None and first:
            self._fabric_log()
        return out

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Called before each optimizer step (the sharded subclass agrees on skips across ranks here)."""

    def _adopt(self, optimizer: torch.optim.Optimizer) -> None:
        if any(o is optimizer for o in self._optimizers):
            return
        steps.become(optimizer, self.plugin.convert_optimizer(optimizer))  # bf16-true's compensated twin
        self.plugin.track_optimizer(optimizer)
        self._optimizers.append(optimizer)

    def _on_collapse(self, error: LossScaleCollapse) -> None:
        if self._config.on_loss_scale_collapse == "raise":
            raise error
        # The skipped steps changed nothing: the weights are the last applied ones. Drop the
        # overflowing gradients and train on in the fallback precision (the scaler stays behind).
        target, why = fallback_target(self.plugin, self.plugin.device)
        before = self.plugin.policy.name
        for optimizer in self._optimizers:
            optimizer.zero_grad(set_to_none=True)
        self._switch(target)
        self.fallbacks.append({"step": self._steps, "from": before, "to": target})
        log_fallback(self._steps, before, target, why, "see precision_report() for what ran in fp16")

    def _switch(self, name: str, config: PrecisionConfig | None = None) -> None:
        """Train on in ``name`` (the loss scaler stays behind unless ``config`` gives one)."""
        self.plugin.release()
        self.plugin = self._make(name, self.plugin.device, config or self._config.replace(loss_scaler=None))
        self._settle_backward()
        for optimizer in self._optimizers:
            self.plugin.track_optimizer(optimizer)

    def step_was_skipped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s last step was skipped for inf/NaN gradients (may sync)."""
        return self.plugin.step_was_skipped(getattr(optimizer, "optimizer", optimizer))

    def wrap_scheduler(self, scheduler: Any) -> Any:
        """``scheduler``, stepped only when its optimizer's last step was applied (the Trainer's
        schedulers are wrapped so in ``connect``; under Fabric, wrap yours:
        ``scheduler = plugin.wrap_scheduler(scheduler)``). Disabled (no loss scaler): ``scheduler``."""
        return steps.follow_steps(scheduler, self.step_was_skipped) if self.plugin.steps is not None else scheduler

    # -- the log ----------------------------------------------------------------------------
    def log_values(self) -> dict[str, Any]:
        """The loss scale and the skipped steps, where there is a scaler (syncs)."""
        return self.plugin.log_values()

    def _log(self, model: Any) -> None:
        """The Trainer's log: the scale and skips every step (device tensors, no sync), the precision
        in force after the first step, a warning for skipped steps every ``log_every_n_steps``."""
        scaler = self.plugin.scaler
        if scaler is not None and scaler.is_enabled():
            try:
                model.log("loss_scale", scaler.get_scale_tensor(), on_step=True, on_epoch=False, batch_size=1)
                model.log("skipped_steps", scaler.skipped_steps_tensor().float(), on_step=True, on_epoch=False,
                          batch_size=1)
            except MisconfigurationException:  # stepped from a hook where Lightning takes no log
                pass
        trainer = model.trainer
        if not self._reported:
            self._report_in_force(trainer.loggers)
        if scaler is not None and self._steps % max(1, trainer.log_every_n_steps) == 0:
            self._warn_skips()

    def _fabric_log(self) -> None:
        """Fabric's log: the precision in force after the first step; every ``log_every_n_steps``,
        the scale and skips to ``fabric.log_dict`` and a warning for skipped steps."""
        if not self._reported:
            self._report_in_force(self._fabric.loggers)
        if self._steps == 0 or self._steps % max(1, self.log_every_n_steps):
            return
        if values := self.log_values():
            self._fabric.log_dict(values, step=self._steps)
            self._warn_skips()

    def _report_in_force(self, loggers: list[Any]) -> None:
        self._reported = True
        report = self.precision_report()
        for logger in loggers:
            logger.log_hyperparams({"precision_in_force": report.line()})
        rank_zero_info(f"mixprec: {report.line()}")
        if not report.ok:
            rank_zero_warn(f"mixprec: {report.line()}")

    def _warn_skips(self) -> None:
        skipped = self.log_values().get("skipped_steps", 0)
        if skipped > self._skipped_said:
            rank_zero_warn(f"mixprec: {skipped - self._skipped_said} optimizer step(s) skipped for inf/NaN gradients "
                           f"since the last check; the loss scale is now {self.scaler.get_scale():g}")
        self._skipped_said = skipped

    def precision_report(self) -> PrecisionReport:
        """What precision is really in force, read from the live models, optimizers and scaler,
        and where it differs from the precision's contract (see
        :meth:`mixprec.Accelerator.precision_report`). Syncs (the scale).

        Example:
            >>> print(trainer.precision_plugin.precision_report().line())   # doctest: +SKIP
        """
        world = torch.distributed.get_world_size() if torch.distributed.is_available() and \
            torch.distributed.is_initialized() else 1
        sharded = any(hasattr(m, "reshard") or type(m).__name__ == "FullyShardedDataParallel"
                      for model in self._models for m in model.modules())
        mode = "single" if world == 1 else "fsdp" if sharded else "ddp"
        return self.audit.report(self.plugin.policy.name, mode, self._models, self._optimizers, self.scaler,
                                 moments=self.plugin.optimizer_state_dtype, details=self.plugin.report(),
                                 precision_violations=self.plugin.violations())

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The loss scaler's state (empty without one, so Lightning writes no entry: its own
        layout), and the precision a collapsed scale fell back to."""
        self.plugin.finish_iteration()
        state = dict(self.plugin.state_dict())
        if self.fallbacks:
            state["precision_fallback"] = self.plugin.policy.name
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state (a GradScaler's state from Lightning's own
        ``MixedPrecision`` too: see :meth:`on_load_checkpoint`)."""
        state = dict(state_dict)
        if (target := state.pop("precision_fallback", None)) and target != self.plugin.policy.name:
            self._switch(target)  # the run had fallen back: go on so
            self.fallbacks.append({"step": None, "to": target})
        self.plugin.load_state_dict(state)
        self.audit.scaler_loaded(self.plugin.state_dict(), state, enabled=self.scaler is not None)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint Lightning's own ``MixedPrecision`` wrote: its GradScaler's state restored here."""
        if type(self).__qualname__ not in checkpoint and "MixedPrecision" in checkpoint and self.scaler is not None:
            self.load_state_dict(checkpoint["MixedPrecision"])

    def teardown(self) -> None:
        """Remove the audit's hooks still installed (the end of a fit)."""
        self.audit.close()

    def _settle_device(self, trainer: Any, setup: Any) -> None:
        """Where no device was given, run on the one Lightning trains on (known when it sets the
        model up): rebuild the plugin for it before anything was tracked."""
        device = trainer.strategy.root_device if trainer is not None else setup.fabric.device if setup else None
        if self._device_given or device is None or torch.device(device).type == self.plugin.device.type \
                or self._optimizers or self._models:
            return
        self.plugin = self._make(self._requested, device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.plugin.policy.name!r}, device={str(self.plugin.device)!r})"


def _trainer_of(module: Any) -> Any:
    """The Trainer driving ``module`` (a LightningModule attached to one), else ``None`` (Fabric)."""
    return module._trainer if isinstance(module, pl.LightningModule) else None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"

