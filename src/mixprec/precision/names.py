"""Precision names: the one table of them, what a precision is (:class:`PrecisionPolicy`), and the
one function that resolves a name.

``resolve_precision`` turns a name into a :class:`PrecisionPolicy`; ``make_plugin``
(:mod:`mixprec.precision.registry`) turns it into the plugin that carries the precision out.
Adding a precision is one row here, one plugin file and one entry in the registry.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from dataclasses import dataclass

import torch

from mixprec.hardware import choose_auto, detect_capability

__all__ = [
    "PrecisionPerformanceWarning",
    "PrecisionPolicy",
    "resolve_precision",
    "policy_for",
    "precision_names",
    "canonical_precision",
    "accelerate_name",
    "lightning_name",
    "trainer_flags",
    "CANONICAL_PRECISIONS",
]


class PrecisionPerformanceWarning(UserWarning):
    """A precision that works here but is emulated, so it will be slow."""


@dataclass(frozen=True)
class _Row:
    aliases: tuple[str, ...]
    compute_dtype: torch.dtype
    param_dtype: torch.dtype
    autocast_enabled: bool
    needs_loss_scaler: bool
    float8_linears: bool = False
    accelerate: str | None = None  # Hugging Face Accelerate's mixed_precision for it (None: it has none)
    lightning: str | None = None  # Lightning's precision name for it (None: it has none)


_f32, _f16, _b16 = torch.float32, torch.float16, torch.bfloat16
# canonical name: aliases, compute dtype, parameter dtype, autocast, loss scaler, Linear layers in float8,
# Hugging Face Accelerate's name for it (its Trainer's flag for fp16 and bf16), and Lightning's.
_TABLE: dict[str, _Row] = {
    "fp32": _Row(("no", "32", "32-true", "fp32-true"), _f32, _f32, False, False, accelerate="no", lightning="32-true"),
    "fp16-mixed": _Row(("fp16", "16", "16-mixed"), _f16, _f32, True, True, accelerate="fp16", lightning="16-mixed"),
    "bf16-mixed": _Row(("bf16",), _b16, _f32, True, False, accelerate="bf16", lightning="bf16-mixed"),
    "bf16-true": _Row((), _b16, _b16, False, False, lightning="bf16-true"),
    "fp8": _Row(("fp8-mixed", "float8"), _b16, _f32, True, False, float8_linears=True, accelerate="fp8"),
}
CANONICAL_PRECISIONS = (*_TABLE, "auto")
_ALIASES = {alias: canon for canon, row in _TABLE.items() for alias in (canon, *row.aliases)} | {"auto": "auto"}


def accelerate_name(name: str) -> str | None:
    """Hugging Face Accelerate's ``mixed_precision`` for precision ``name`` (``"no"``, ``"fp16"``,
    ``"bf16"``, ``"fp8"``; its Trainer's flags are ``fp16=True`` and ``bf16=True``), or ``None`` where
    Accelerate has none (bf16-true).

    Example:
        >>> accelerate_name("bf16-mixed"), accelerate_name("fp32"), accelerate_name("bf16-true")
        ('bf16', 'no', None)
    """
    return _TABLE[canonical_precision(name)].accelerate


def lightning_name(name: str) -> str | None:
    """Lightning's precision name for precision ``name`` (``"32-true"``, ``"16-mixed"``,
    ``"bf16-mixed"``, ``"bf16-true"``: what ``trainer.precision`` reads), or ``None`` where Lightning
    has none (fp8: its only float8 is Transformer Engine's).

    Example:
        >>> lightning_name("fp16"), lightning_name("fp8")
        ('16-mixed', None)
    """
    return _TABLE[canonical_precision(name)].lightning


def trainer_flags(name: str) -> dict[str, bool]:
    """transformers' ``TrainingArguments`` flags for precision ``name``: ``{"bf16": ..., "fp16": ...}``
    (both ``False`` for fp32; its Trainer has no flag for bf16-true or fp8, which get both ``False``).

    Example:
        >>> trainer_flags("bf16-mixed")
        {'bf16': True, 'fp16': False}
    """
    accelerate = accelerate_name(name)
    return {"bf16": accelerate == "bf16", "fp16": accelerate == "fp16"}


def precision_names() -> dict[str, list[str]]:
    """Canonical precision name -> the aliases accepted for it (the canonical name included)."""
    out: dict[str, list[str]] = {c: [] for c in CANONICAL_PRECISIONS}
    for alias, canon in _ALIASES.items():
        out[canon].append(alias)
    return out


def _valid_names_text() -> str:
    return "; ".join(
        f"{canon}" + (f" (aliases: {', '.join(a for a in al if a != canon)})" if len(al) > 1 else "")
        for canon, al in precision_names().items()
    )


def check_concrete(name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is a concrete canonical name (what a policy holds)."""
    if name not in _TABLE:
        raise ValueError(
            f"PrecisionPolicy.name must be a concrete canonical name, got {name!r}; "
            f"build policies with resolve_precision(name). Valid names: {_valid_names_text()}"
        )


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """What a precision means for compute, storage and loss scaling.

    Build one with :func:`~mixprec.resolve_precision`; the fields are the row of the names table.

    Args:
        name: the canonical name (``"fp32"``, ``"fp16-mixed"``, ``"bf16-mixed"``, ``"bf16-true"``, ``"fp8"``).
        compute_dtype: the dtype matrix products run in.
        param_dtype: the dtype the parameters are stored in.
        optimizer_state_dtype: the dtype of the optimizer's moment buffers.
        autocast_enabled: whether the forward runs under ``torch.autocast``.
        needs_loss_scaler: whether a dynamic loss scaler is required (fp16's narrow range).
        float8_linears: whether Linear layers multiply in float8 (fp8: torchao's float8 training,
            each tensor scaled; the rest of the forward in ``compute_dtype`` under autocast).
        requested: the name as the user wrote it (``"auto"``, ``"fp16"``, ...).
        reason: why this policy was chosen (filled in for ``auto``).

    Example:
        >>> from mixprec import resolve_precision
        >>> with resolve_precision("bf16").autocast("cpu"):
        ...     y = torch.ones(2, 2) @ torch.ones(2, 2)
        >>> y.dtype
        torch.bfloat16
    """

    name: str
    compute_dtype: torch.dtype
    param_dtype: torch.dtype
    optimizer_state_dtype: torch.dtype
    autocast_enabled: bool
    needs_loss_scaler: bool
    float8_linears: bool = False
    requested: str = ""
    reason: str = ""

    def __post_init__(self) -> None:
        check_concrete(self.name)

    @property
    def is_low_precision(self) -> bool:
        """Whether any compute runs in a 16-bit dtype."""
        return self.compute_dtype != torch.float32

    def autocast(self, device: str | torch.device = "cpu") -> contextlib.AbstractContextManager:
        """A context manager that runs its body in this policy's compute precision on ``device``.

        For policies without autocast (``fp32``, ``bf16-true``) this is a no-op context, so it
        never disables an autocast region the caller opened outside it.
        """
        if not self.autocast_enabled:
            return contextlib.nullcontext()
        device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
        return torch.autocast(device_type, dtype=self.compute_dtype)


def canonical_precision(name: object) -> str:
    """The canonical name for a precision name or alias (``"auto"`` stays ``"auto"``).

    Raises:
        ValueError: for an unknown name, listing every valid name and alias.
    """
    if isinstance(name, bool) or not isinstance(name, (str, int)):
        raise ValueError(
            f"precision must be a name (str), got {type(name).__name__} {name!r}. Valid names: {_valid_names_text()}"
        )
    key = str(name).strip().lower()
    if key not in _ALIASES:
        raise ValueError(f"unknown precision {name!r}. Valid names: {_valid_names_text()}")
    return _ALIASES[key]


def resolve_precision(name: str | PrecisionPolicy, device: str | torch.device | None = None) -> PrecisionPolicy:
    """Turn a precision name (or alias) into a :class:`PrecisionPolicy` for ``device``.

    ``"auto"`` picks the fastest safe precision the device offers and records why in
    ``policy.reason``. A precision that works but is emulated on ``device`` (bf16 without native
    support, fp16 on a CPU without AMX-FP16) warns once per process with a
    :class:`PrecisionPerformanceWarning` that names the missing instruction set or capability and
    the fastest choice on ``device`` (what ``"auto"`` picks there).

    Args:
        name: a canonical name or alias (see the table in the README), or a policy (returned as is).
        device: the device the run will use; ``None`` means the default device. Only needed to
            resolve ``"auto"`` and to warn about emulation.

    Raises:
        ValueError: for an unknown name, listing every valid name and alias; for a precision the
            device cannot run at all.

    Example:
        >>> resolve_precision("fp16").name
        'fp16-mixed'
    """
    if isinstance(name, PrecisionPolicy):
        return name
    canon = canonical_precision(name)
    requested = str(name)
    reason = ""
    cap = detect_capability(device)
    if canon == "auto":
        canon, reason = choose_auto(cap)
    support = cap.support.get(canon, "native")
    if support == "unsupported":
        raise ValueError(
            f"precision {canon!r} is not supported on {cap.device}: {cap.reasons.get(canon, '')}. "
            "Use 'fp32', or 'auto' to pick the fastest precision this device offers."
        )
    if support == "emulated":
        best, why = choose_auto(cap)  # the advice is the fastest choice on this device, never a fixed name
        _warn_once(f"{canon} on {cap.device} works but will be slow: {cap.reasons.get(canon, 'it is emulated here')}. "
                   f"Use {best}, the fastest choice on {cap.device} (what precision='auto' picks): {why}.",
                   PrecisionPerformanceWarning, sys._getframe(1).f_globals.get("__name__", ""))
    return policy_for(canon, requested=requested, reason=reason)


#: The texts of the performance warnings already said in this process. The warnings module's own
#: "once" is per call site and per module registry, and forgets whenever the filters change
#: (transformers and pytest change them); one run resolves its precision in several places
#: (``mixprec run``, the switch, each Accelerator built), and would say the same thing each time.
_SAID: set[str] = set()


def _warn_once(message: str, category: type[Warning], module: str) -> None:
    """Warn ``message`` the first time this process resolves to it, as shown to the caller of
    :func:`resolve_precision` (``module``). Filters still have their say: where they ``ignore`` it,
    it is not counted as said; where they say ``always`` (``pytest.warns`` does) or ``error``, it is
    warned every time."""
    action = _filter_action(message, category, module)
    if action == "ignore":
        return
    if action not in ("always", "error"):
        if message in _SAID:
            return
        _SAID.add(message)
    warnings.warn(message, category, stacklevel=3)


def _filter_action(message: str, category: type[Warning], module: str) -> str:
    """The action the warning filters in force (``warnings.filters``, first match wins) give a
    warning, as ``warnings.warn`` finds it; filters for one line number are left to it."""
    for action, text, cat, mod, lineno in warnings.filters:
        if (lineno == 0 and issubclass(category, cat) and (text is None or text.match(message))
                and (mod is None or mod.match(module))):
            return action
    return warnings.defaultaction


def policy_for(name: str, *, requested: str = "", reason: str = "") -> PrecisionPolicy:
    """The policy of a name or alias as the table gives it, whatever the device (no warning;
    ``"auto"`` is refused: it depends on the device, see :func:`resolve_precision`).

    Example:
        >>> policy_for("fp16").compute_dtype
        torch.float16
    """
    canon = canonical_precision(name)
    check_concrete(canon)
    row = _TABLE[canon]
    return PrecisionPolicy(name=canon, requested=requested or str(name), reason=reason,
                           compute_dtype=row.compute_dtype, param_dtype=row.param_dtype, optimizer_state_dtype=_f32,
                           autocast_enabled=row.autocast_enabled, needs_loss_scaler=row.needs_loss_scaler,
                           float8_linears=row.float8_linears)
