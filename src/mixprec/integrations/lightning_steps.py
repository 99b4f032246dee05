"""What :class:`~mixprec.integrations.lightning.MixprecPrecision` needs of Lightning beyond its
precision-plugin hooks, each the smallest reach that gives it:

- :func:`fabric_setup_call`: the optimizers ``fabric.setup(model, *optimizers)`` sets up with the
  model whose ``convert_module`` is being called (Fabric shows a precision plugin no optimizer;
  read from the caller's frame, as :mod:`mixprec.integrations.transformers_engine` finds its Trainer).
- :func:`become`: an optimizer turned, in place, into its precision's twin (bf16-true's
  compensated update), so every reference to it (the user's, a scheduler's, Fabric's wrapper)
  steps the twin.
- :func:`follow_steps`: a scheduler held back when its optimizer's step was skipped (the
  Accelerator's :class:`~mixprec.accelerator.wrappers.AcceleratedScheduler`).
- :func:`explain_conflicts`: Lightning's error for ``plugins=[MixprecPrecision(...)]`` beside
  ``precision=`` gets one more line, saying to keep one of them.
"""

from __future__ import annotations

import functools
import sys
import types
import weakref
from typing import Any, NamedTuple

import torch

from mixprec.accelerator.wrappers import AcceleratedScheduler

__all__ = ["FabricSetup", "become", "explain_conflicts", "fabric_setup_call", "follow_steps"]


class FabricSetup(NamedTuple):
    """A ``Fabric.setup`` call in progress: the Fabric and the optimizers set up with the model."""

    fabric: Any
    optimizers: tuple[torch.optim.Optimizer, ...]


def fabric_setup_call(depth: int = 4) -> FabricSetup | None:
    """The ``Fabric.setup`` (or ``setup_module``) call up the stack within ``depth`` frames of the
    caller, or ``None`` (the Trainer, or a plugin called directly)."""
    fabric_module = sys.modules.get("lightning.fabric")
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None or fabric_module is None:
            return None
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name in ("setup", "setup_module") and isinstance(owner, fabric_module.Fabric):
            optimizers = frame.f_locals.get("optimizers", ()) if frame.f_code.co_name == "setup" else ()
            return FabricSetup(owner, tuple(o for o in optimizers if isinstance(o, torch.optim.Optimizer)))
        frame = frame.f_back
    return None


#: torch's optimizer hooks, kept when an optimizer becomes its twin (registered on the original).
_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
          "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
          "_optimizer_load_state_dict_post_hooks")


def become(optimizer: torch.optim.Optimizer, twin: torch.optim.Optimizer) -> None:
    """Make ``optimizer`` the same optimizer as ``twin`` (its class, and the very ``__dict__`` of
    it: state, parameter groups, defaults), keeping the hooks registered on ``optimizer`` and an
    LR scheduler's note that it stepped. A no-op where ``twin`` is ``optimizer``.

    The twin took over ``optimizer``'s parameter-group dicts
    (:func:`~mixprec.precision.optim.compensated.compensated_for_bf16`), so a scheduler built on
    it sets the rate the twin steps with.
    """
    if twin is optimizer:
        return
    before = vars(optimizer)
    after = vars(twin)
    for name in _HOOKS:
        if before.get(name) and name in after:
            after[name].update(before[name])
    noted = getattr(before.get("step"), "_wrapped_by_lr_sched", False)
    optimizer.__class__ = type(twin)
    optimizer.__dict__ = after
    if noted:  # an LR scheduler wrapped the instance's step to note that it was called: again, on the twin's
        optimizer.step = _noting_step(weakref.ref(optimizer))


def _noting_step(ref: weakref.ref) -> Any:
    def step(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        opt._opt_called = True
        return type(opt).step(opt, *args, **kwargs)

    step._wrapped_by_lr_sched = True
    return step


class _StepOf:
    """What :class:`AcceleratedScheduler` reads of an optimizer it follows."""

    def __init__(self, optimizer: Any, skipped: Any) -> None:
        self.optimizer, self._skipped = optimizer, skipped

    @property
    def step_was_skipped(self) -> bool:
        return self._skipped(self.optimizer)


def follow_steps(scheduler: Any, skipped: Any) -> Any:
    """``scheduler`` stepped only where ``skipped(its optimizer)`` is false (the optimizer's last
    step was applied); it still answers ``isinstance`` for its class and every attribute is its own."""
    if isinstance(scheduler, AcceleratedScheduler) or not hasattr(scheduler, "optimizer"):
        return scheduler
    every_step = types.SimpleNamespace(sync_gradients=True, adjust_scheduler=False)  # Lightning accumulates
    return AcceleratedScheduler(scheduler, [_StepOf(scheduler.optimizer, skipped)], every_step)


_CONFLICT = ("mixprec: MixprecPrecision sets the precision itself: keep plugins=[MixprecPrecision(...)] and drop "
             "precision=, or drop the plugin to train in Lightning's own precision")


def explain_conflicts() -> None:
    """Once per process: Lightning's ``Received both `precision=...` and `plugins=...``` error,
    where the plugin is a MixprecPrecision, gets :data:`_CONFLICT` as its last line (Lightning's
    message and type unchanged above it). Lightning's two connectors are wrapped, nothing else."""
    for module_name, class_name in (("lightning.pytorch.trainer.connectors.accelerator_connector", "_AcceleratorConnector"),
                                    ("lightning.fabric.connector", "_Connector")):
        module = sys.modules.get(module_name)
        cls = getattr(module, class_name, None)
        if cls is None or getattr(cls.__init__, "_mixprec_explains", False):
            continue
        cls.__init__ = _explaining(cls.__init__)


def _explaining(init: Any) -> Any:
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except ValueError as error:
            text = str(error)
            if text.startswith("Received both `precision=") and "Mixprec" in text and _CONFLICT not in text:
                error.args = (f"{text}\n{_CONFLICT}", *error.args[1:])
            raise

    __init__._mixprec_explains = True
    return __init__
