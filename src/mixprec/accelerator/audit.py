"""What precision is really in force, read from the live objects, never from the configuration.

The most-reported mixed-precision failures are settings that silently do nothing: an fp32 upcast
that stopped happening under FSDP2 (Accelerate #3979), "16-mixed" running as "16-true"
(Lightning #17506), a ``reduce_dtype`` ignored on one all-reduce (PyTorch #190626), a loss
scaler whose state a resume did not restore (Accelerate #4289). Reading the configuration back
cannot catch any of them, so :class:`PrecisionAudit` watches what happens instead:

* inside the first forward after ``prepare``: the dtype of each ``Linear``'s parameters as its
  forward sees them (after FSDP2 has gathered them), of its output, and the autocast state;
* the gradients as reduced across processes: a DDP communication hook, or FSDP2's hook on the
  reduce-scatter output (``set_all_reduce_hook``), records the dtype of the tensor reduced;
* at the first optimizer step: the gradients' dtype; afterwards, each optimizer state tensor's;
* the sharded master weights, read from the parameters (their local shards);
* the loss scaler after ``load_state``: its state compared with the one in the checkpoint.

:meth:`PrecisionAudit.report` compares all of it with the precision's contract (:data:`CONTRACT`,
the table in the README) and lists every difference. Observing costs a few hooks during the
first step (removed after it) and a dtype record per reduced bucket: no host sync.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mixprec.precision.bf16_true import fp32_modules_rule

__all__ = ["CONTRACT", "PrecisionAudit", "PrecisionReport", "expected_dtypes", "recording_ddp_hook"]

_F32, _F16, _B16 = torch.float32, torch.float16, torch.bfloat16

#: The contract per precision: (master weights, parameters in forward, autocast dtype or None,
#: matmul outputs, gradients as reduced, gradients as stored, optimizer moments, loss scaler).
#: ``"compute"`` for forward parameters means: the compute dtype under FSDP2 (its
#: ``MixedPrecisionPolicy`` gathers them so), the stored dtype otherwise.
CONTRACT: dict[str, dict[str, Any]] = {
    "fp32": dict(master=_F32, forward=_F32, autocast=None, activations=_F32, reduced=_F32, grads=_F32,
                 moments=_F32, scaler=False),
    "bf16-mixed": dict(master=_F32, forward="compute", autocast=_B16, activations=_B16, reduced=_F32, grads=_F32,
                       moments=_F32, scaler=False),
    "fp16-mixed": dict(master=_F32, forward="compute", autocast=_F16, activations=_F16, reduced=_F32, grads=_F32,
                       moments=_F32, scaler=True),
    "bf16-true": dict(master=_B16, forward=_B16, autocast=None, activations=_B16, reduced=_B16, grads=_B16,
                      moments=_F32, scaler=False),
}
# fp8: bf16-mixed's, and the chosen Linear layers multiply in float8 (checked by the plugin's report()).
CONTRACT["fp8"] = CONTRACT["bf16-mixed"]


def expected_dtypes(precision: str, mode: str, *, reduce_dtype: torch.dtype | None = None,
                    moments: torch.dtype | None = None) -> dict[str, Any]:
    """The contract of ``precision`` when run as ``mode`` (``"single"``, ``"ddp"`` or ``"fsdp"``).

    ``reduce_dtype``: the dtype gradients are reduced in when the user set one (FSDP2's
    ``reduce_dtype``, DDP's ``ddp_comm_hook``); ``moments``: bf16-true's ``state_dtype``.
    Under FSDP2 a 16-bit precision reduces in fp32 by default, bf16-true included.
    """
    if precision not in CONTRACT:
        raise ValueError(f"no precision contract for {precision!r}; known: {', '.join(CONTRACT)}")
    if mode not in ("single", "ddp", "fsdp"):
        raise ValueError(f"mode must be 'single', 'ddp' or 'fsdp', got {mode!r}")
    c = dict(CONTRACT[precision])
    compute = c["activations"]
    if c["forward"] == "compute":
        c["forward"] = compute if mode == "fsdp" else c["master"]
    if mode == "fsdp" and compute != _F32:
        c["reduced"] = _F32
    if reduce_dtype is not None:
        c["reduced"] = reduce_dtype
    if mode == "single":
        c["reduced"] = None  # nothing is reduced
    if moments is not None:
        c["moments"] = moments
    return c


def _name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.") if dtype is not None else "none"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@dataclasses.dataclass
class PrecisionReport:
    """What :meth:`PrecisionAudit.report` observed, the contract, and where they differ.

    Attributes:
        precision: the precision's canonical name; ``mode``: ``"single"``, ``"ddp"`` or ``"fsdp"``.
        observed: field -> what was seen (dtype names, ``"not observed yet"`` before the first step).
        expected: field -> what the contract says.
        violations: one sentence per field that differs (empty when the contract holds).
        details: what the precision adds of its own (fp8: each Linear layer and what it runs in,
            the recipe, the kernels, the float8 dtypes seen in forward); empty for the others.
    """

    precision: str
    mode: str
    observed: dict[str, Any]
    expected: dict[str, Any]
    violations: list[str]
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Whether everything observed so far matches the contract."""
        return not self.violations

    def line(self) -> str:
        """One line for a log: each observed field, and the verdict."""
        o = self.observed
        parts = [f"master weights {o['master_weights']}", f"params in forward {o['forward_params']}",
                 f"autocast {o['autocast']}", f"matmul outputs {o['activations']}",
                 f"gradients reduced in {o['reduced_gradients']}", f"gradients {o['gradients']}",
                 f"optimizer state {o['optimizer_state']}", f"scaler {o['scaler']}"]
        if self.details.get("summary"):
            parts.append(self.details["summary"])
        verdict = "as the contract says" if self.ok else "DIFFERS: " + "; ".join(self.violations)
        return f"precision in force ({self.precision}, {self.mode}): " + ", ".join(parts) + f" -- {verdict}"

    def __str__(self) -> str:
        return self.line()


class PrecisionAudit:
    """Observe the dtypes a prepared model really trains in (see the module docstring).

    The Accelerator makes one and calls :meth:`watch_model`, :meth:`observe_gradients` and
    :meth:`scaler_loaded`; :meth:`report` (``accelerator.precision_report()``) reads it.
    """

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self.reset()

    def reset(self) -> None:
        """Remove every hook and forget every observation (the next run's objects are observed afresh)."""
        self.close()
        self.forward: list[dict[str, Any]] = []   # one record per Linear in the first forward
        self.reduced: set[torch.dtype] = set()
        self.grads: set[torch.dtype] = set()
        self.scaler_restored: bool | None = None
        self.scaler_note = ""
        self._kept_fp32: set[int] = set()  # normalisation layers' parameters (fp32 in bf16-true)

    # -- observers -------------------------------------------------------------------------
    def watch_model(self, model: torch.nn.Module) -> None:
        """Hook the first forward of ``model`` (its ``Linear`` layers, else every module with parameters)."""
        chosen = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        if not chosen:
            chosen = [(n, m) for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
        self._kept_fp32.update(id(p) for m in model.modules() if fp32_modules_rule(m) for p in m.parameters(recurse=False))
        probes = [_FirstForward(path, self.forward) for path, _ in chosen]
        for (_, module), probe in zip(chosen, probes):
            probe.handles = [module.register_forward_pre_hook(probe.pre), module.register_forward_hook(probe.post)]
        # Each probe goes when its module's first call ends; the root's hook removes those of modules
        # the first forward did not call (a model called through .forward() never runs the root's hooks).
        done = _RemoveAfterForward([h for probe in probes for h in probe.handles])
        done.handles.append(model.register_forward_hook(done))
        self._handles += done.handles
        if hasattr(model, "set_all_reduce_hook"):  # FSDP2: the reduce-scatter output of every group
            for m in model.modules():
                if hasattr(m, "set_all_reduce_hook"):
                    m.set_all_reduce_hook(self.record_reduced)

    def record_reduced(self, tensor: torch.Tensor) -> None:
        """Record the dtype of a tensor reduced across processes (a hook calls it)."""
        self.reduced.add(tensor.dtype)

    def observe_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Record the gradients' dtypes as ``optimizer`` is about to step, the first time it has
        any (normalisation layers' excluded: bf16-true keeps them fp32). No sync."""
        if self.grads:
            return
        for g in optimizer.param_groups:
            self.grads.update(_local(p.grad).dtype for p in g["params"]
                              if p.grad is not None and id(p) not in self._kept_fp32)

    def scaler_loaded(self, live: dict[str, Any], saved: dict[str, Any], enabled: bool) -> None:
        """Compare the loss scaler's live state after ``load_state`` with the checkpoint's."""
        if not enabled:
            self.scaler_restored, self.scaler_note = None, ""
            return
        if not saved:
            self.scaler_restored, self.scaler_note = False, "the checkpoint held no scaler state"
            return
        differ = sorted(k for k in saved if k in live and _differs(live[k], saved[k]))
        differ += sorted(k for k in saved if k not in live)
        self.scaler_restored = not differ
        self.scaler_note = f"differs from the checkpoint in {', '.join(differ)}" if differ else ""

    # -- the report ------------------------------------------------------------------------
    def report(self, precision: str, mode: str, models: list[torch.nn.Module],
               optimizers: list[torch.optim.Optimizer], scaler: Any, *, reduce_dtype: torch.dtype | None = None,
               moments: torch.dtype | None = None, details: dict[str, Any] | None = None,
               precision_violations: list[str] | None = None) -> PrecisionReport:
        """Compare what was observed with the contract of ``precision`` run as ``mode``;
        ``details`` and ``precision_violations`` are what the precision plugin observed itself."""
        exp = expected_dtypes(precision, mode, reduce_dtype=reduce_dtype, moments=moments)
        # (normalisation layers stay fp32 in bf16-true: not master weights in the contract's sense)
        master = {_local(p).dtype for model in models for m in model.modules() if not fp32_modules_rule(m)
                  for p in m.parameters(recurse=False) if p.requires_grad}
        state: dict[str, set[torch.dtype]] = {}
        for opt in optimizers:
            for s in opt.state.values():
                for k, v in s.items():
                    if torch.is_tensor(v) and v.dim() > 0:
                        state.setdefault(k, set()).add(_local(v).dtype)
        fwd = {d for r in self.forward for d in r["params"]}
        auto = {r["autocast"] for r in self.forward}
        acts = {r["output"] for r in self.forward}
        on = scaler is not None and getattr(scaler, "is_enabled", lambda: True)()
        scale = float(scaler.get_scale()) if on else None
        observed = {
            "master_weights": _names(master) + (" (sharded)" if any(hasattr(p, "to_local") for m in models
                                                                  for p in m.parameters()) else ""),
            "forward_params": _names(fwd) if self.forward else "not observed yet",
            "autocast": (_names(auto) if auto != {None} else "off") if self.forward else "not observed yet",
            "activations": _names(acts) if self.forward else "not observed yet",
            "reduced_gradients": ("not reduced (one process)" if mode == "single" else
                                  _names(self.reduced) if self.reduced else "not observed yet"),
            "gradients": _names(self.grads) if self.grads else "not observed yet",
            "optimizer_state": ({k: _names(v) for k, v in sorted(state.items())} if state else "not created yet"),
            "scaler": ("none" if not on else f"scale {scale:g}" + {None: "", True: ", restored from the checkpoint",
                                                                     False: f", NOT restored ({self.scaler_note})"}
                       [self.scaler_restored]),
        }
        expected = {"master_weights": _name(exp["master"]), "forward_params": _name(exp["forward"]),
                    "autocast": _name(exp["autocast"]) if exp["autocast"] else "off",
                    "activations": _name(exp["activations"]), "reduced_gradients": _name(exp["reduced"]),
                    "gradients": _name(exp["grads"]), "optimizer_state": _name(exp["moments"]),
                    "scaler": "a loss scaler, restored on load" if exp["scaler"] else "none (or the inf/NaN guard at scale 1)"}
        bad: list[str] = []

        def check(field: str, seen: set[Any], want: Any, what: str) -> None:
            if seen and seen != {want}:
                bad.append(f"{what} are {_names(seen)}, the contract says {_name(want)}")

        check("master", master, exp["master"], "the master weights")
        check("forward", fwd, exp["forward"], "the parameters in forward")
        if self.forward and auto != {exp["autocast"]}:
            bad.append(f"autocast inside forward is {observed['autocast']}, the contract says {expected['autocast']}")
        check("activations", acts, exp["activations"], "the matmul outputs")
        if mode != "single":
            check("reduced", self.reduced, exp["reduced"], "the gradients as reduced")
        check("grads", self.grads, exp["grads"], "the gradients")
        for key, dtypes in state.items():
            want = exp["master"] if key == "kahan_comp" else exp["moments"]
            check(key, dtypes, want, f"the optimizer's {key!r} tensors")
        if exp["scaler"] and not on:
            bad.append("there is no loss scaler, the contract says fp16 needs one")
        if not exp["scaler"] and on and scale != 1.0:
            bad.append(f"a loss scaler is scaling by {scale:g}, the contract says none")
        if on and self.scaler_restored is False:
            bad.append(f"the loss scaler was not restored by load_state ({self.scaler_note})")
        bad += precision_violations or []
        return PrecisionReport(precision, mode, observed, expected, bad, dict(details or {}))

    def close(self) -> None:
        """Remove every hook still installed."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


class _FirstForward:
    """One module's forward hooks (picklable, as the module may be): its parameters' dtypes and
    the autocast state as its forward starts, its output's dtype as it ends, recorded once; then
    both hooks are removed (a module with hooks takes torch's slower call path)."""

    def __init__(self, path: str, records: list[dict[str, Any]]) -> None:
        self.path, self.records, self.seen = path, records, {}
        self.handles: list[Any] = []

    def pre(self, module: torch.nn.Module, args: Any) -> None:
        params = [p for p in module.parameters(recurse=False) if p.is_floating_point()]
        if not params or self.seen:
            return
        kind = params[0].device.type
        self.seen = dict(path=self.path, params={_local(p).dtype for p in params},
                         autocast=torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None)

    def post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.seen and "output" not in self.seen and torch.is_tensor(output) and output.is_floating_point():
            self.seen["output"] = output.dtype
            self.records.append(self.seen)
        for h in self.handles:
            h.remove()


class _RemoveAfterForward:
    """The root module's forward hook that removes every probe (itself included) once the first forward ends."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        for h in self.handles:
            h.remove()


def _names(dtypes: set[Any]) -> str:
    return "/".join(sorted(_name(d) for d in dtypes))


def _differs(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return not torch.equal(torch.as_tensor(a).cpu(), torch.as_tensor(b).cpu())
    return a != b


def recording_ddp_hook(record: Callable[[torch.Tensor], None], dtype: torch.dtype | None = None) -> Callable[..., Any]:
    """A DDP communication hook that all-reduces each bucket's mean (in ``dtype`` when given,
    the compression of torch's ``fp16_compress_hook`` / ``bf16_compress_hook``) and calls
    ``record`` with the tensor it reduces, so the audit sees the dtype actually on the wire."""

    def hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        wire = buffer.to(dtype) if dtype is not None and buffer.dtype != dtype else buffer
        wire.div_(dist.get_world_size(group))
        record(wire)
        fut = dist.all_reduce(wire, group=group, async_op=True).get_future()

        def back(f: torch.futures.Future[Any]) -> torch.Tensor:
            out = f.value()[0]
            if out is not buffer:
                buffer.copy_(out)
            return buffer

        return fut.then(back)

    # DDP checks the hook's annotations as objects; this module's are strings (postponed evaluation).
    hook.__annotations__ = {"process_group": Any, "bucket": dist.GradBucket,
                            "return": torch.futures.Future[torch.Tensor]}
    return hook
