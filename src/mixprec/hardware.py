"""What the device offers for low-precision arithmetic.

The CPU flags come from torch's own capability report (``torch.cpu.get_capabilities()``, torch
>= 2.6) where it exists, else from ``/proc/cpuinfo``. CUDA support is read from the compute
capability: bf16 tensor cores need >= 8.0 (Ampere), fp8 >= 8.9 (Ada/Hopper).
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from functools import cache

import torch

__all__ = ["DeviceCapability", "detect_capability", "choose_auto", "environment_report"]

NATIVE, EMULATED, UNSUPPORTED = "native", "emulated", "unsupported"
_CPU_FLAGS = ("avx2", "avx512_f", "avx512_bf16", "amx_tile", "amx_bf16", "avx512_fp16", "amx_fp16")


@dataclass(frozen=True, kw_only=True)
class DeviceCapability:
    """The low-precision capability of one device.

    Args:
        device: the device string, e.g. ``"cpu"`` or ``"cuda:0"``.
        name: a human-readable name of the processor.
        flags: instruction sets (CPU) or features (CUDA) that matter for precision, name -> present.
        compute_capability: ``(major, minor)`` on CUDA, else ``None``.
        support: precision name -> ``"native"`` | ``"emulated"`` | ``"unsupported"``.
        reasons: precision name -> why it is not native here (empty where it is).
        impractical: the emulated precisions that run so slowly here (a generic fallback kernel,
            orders of magnitude below fp32) that training in them is impractical, with why: fp16
            without AMX-FP16 and AVX512-FP16, bf16 without AMX-BF16, AVX512-BF16 and AVX512. The
            bench leaves them out of its defaults, saying so.

    Example:
        >>> cap = detect_capability("cpu")
        >>> cap.support["fp32"]
        'native'
    """

    device: str
    name: str
    flags: dict[str, bool] = field(default_factory=dict)
    compute_capability: tuple[int, int] | None = None
    support: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    impractical: dict[str, str] = field(default_factory=dict)

    @property
    def type(self) -> str:
        """The device type: ``"cpu"``, ``"cuda"`` or ``"mps"``."""
        return torch.device(self.device).type

    def is_native(self, precision: str) -> bool:
        """Whether ``precision`` (a canonical name) runs at full speed here."""
        return self.support.get(precision) == NATIVE


def _cpu_flags() -> dict[str, bool]:
    """The CPU's flags, as far as the kernels torch runs use them: where torch dispatches to no
    AVX512 kernels (``torch.backends.cpu.get_cpu_capability()``: an older CPU, or torch held to
    AVX2 with ``ATEN_CPU_CAPABILITY=avx2``), the AVX512 and AMX flags count as absent."""
    flags = _cpu_flags_reported()
    level = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")()
    if not str(level).upper().startswith("AVX512"):
        flags = {f: v and not f.startswith(("avx512", "amx")) for f, v in flags.items()}
    return flags


def _cpu_flags_reported() -> dict[str, bool]:
    get = getattr(torch.cpu, "get_capabilities", None)
    if get is not None:
        try:
            caps = get()
            return {f: bool(caps.get(f, False)) for f in _CPU_FLAGS}
        except Exception:  # pragma: no cover - torch builds without the report
            pass
    try:  # pragma: no cover - exercised only on torch < 2.6
        with open("/proc/cpuinfo") as fh:
            words = set(fh.read().split())
    except OSError:  # pragma: no cover
        words = set()
    aliases = {"avx512_f": "avx512f"}
    return {f: (f in words or aliases.get(f, "") in words) for f in _CPU_FLAGS}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_capability() -> DeviceCapability:
    flags = _cpu_flags()
    bf16 = flags["amx_bf16"] or flags["avx512_bf16"]
    fp16 = flags["amx_fp16"]
    support = {"fp32": NATIVE}
    reasons: dict[str, str] = {}
    support["bf16-mixed"] = support["bf16-true"] = NATIVE if bf16 else EMULATED
    impractical = {}
    if not bf16 and flags["avx512_f"]:
        reasons["bf16-mixed"] = reasons["bf16-true"] = (
            "this CPU has neither AMX-BF16 nor AVX512-BF16, so bf16 matrix products are emulated with AVX512 "
            "(about 0.4x fp32's speed)")
    elif not bf16:
        # As fp16's generic kernel below: oneDNN has no bf16 kernel below AVX512 (measured rates in
        # benchmarks/RESULTS.md, "mixprec bench on a 2-core AMD EPYC held to AVX2").
        reasons["bf16-mixed"] = reasons["bf16-true"] = impractical["bf16-mixed"] = impractical["bf16-true"] = (
            "this CPU has neither AMX-BF16, AVX512-BF16 nor AVX512, so bf16 matrix products fall back to a "
            "generic kernel that runs 20-110x slower than fp32")
    support["fp16-mixed"] = NATIVE if fp16 else EMULATED
    if flags["avx512_fp16"] and not fp16:
        reasons["fp16-mixed"] = ("this CPU has no AMX-FP16, so fp16 matrix products run no faster than fp32 "
                                 "(AVX512-FP16 speeds up element-wise work only)")
    elif not fp16:
        # torch falls back to a generic fp16 matmul kernel here: the measured rates behind "40-200x"
        # are in benchmarks/RESULTS.md ("Figures moved out of docstrings").
        reasons["fp16-mixed"] = impractical["fp16-mixed"] = (
            "this CPU has neither AMX-FP16 nor AVX512-FP16, so fp16 matrix products fall back to a generic "
            "kernel that runs 40-200x slower than fp32")  # what to use instead is choose_auto's to say
    _float8_support(support, reasons, impractical, None)
    return DeviceCapability(device="cpu", name=_cpu_name(), flags=flags, support=support, reasons=reasons,
                            impractical=impractical)


def _float8_support(support: dict[str, str], reasons: dict[str, str], impractical: dict[str, str],
                    cc: tuple[int, int] | None) -> None:
    """fp8's row: torchao's float8 kernels on CUDA 8.9+, its emulation elsewhere, nothing without torchao."""
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        support["fp8"] = UNSUPPORTED
        reasons["fp8"] = "torchao is not installed (pip install torchao, or mixprec[fp8])"
    elif cc is not None and cc >= (8, 9):
        support["fp8"] = NATIVE
    else:
        where = f"compute capability {cc[0]}.{cc[1]} < 8.9 has" if cc else "a CPU has"
        support["fp8"] = EMULATED
        reasons["fp8"] = impractical["fp8"] = (
            f"{where} no float8 matrix kernels, so torchao emulates them: the same quantisation (a GPU's "
            "numerics), slower than bf16; fine for checking whether a model trains in fp8, not for speed")


def _cuda_capability(device: torch.device) -> DeviceCapability:
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    cc = (major, minor)
    flags = {
        "bf16_tensor_cores": cc >= (8, 0),
        "fp16_tensor_cores": cc >= (7, 0),
        "fp8": cc >= (8, 9),
    }
    support = {"fp32": NATIVE}
    reasons: dict[str, str] = {}
    support["fp16-mixed"] = NATIVE if flags["fp16_tensor_cores"] else EMULATED
    if not flags["fp16_tensor_cores"]:
        reasons["fp16-mixed"] = f"compute capability {major}.{minor} < 7.0 has no fp16 tensor cores"
    if flags["bf16_tensor_cores"]:
        bf16 = NATIVE
    else:
        bf16 = EMULATED if torch.cuda.is_bf16_supported(including_emulation=True) else UNSUPPORTED
        reasons["bf16-mixed"] = reasons["bf16-true"] = (
            f"compute capability {major}.{minor} < 8.0 has no native bf16"
        )
    support["bf16-mixed"] = support["bf16-true"] = bf16
    impractical: dict[str, str] = {}
    _float8_support(support, reasons, impractical, cc)
    return DeviceCapability(
        device=f"cuda:{index}",
        name=torch.cuda.get_device_name(index),
        flags=flags,
        compute_capability=cc,
        support=support,
        reasons=reasons,
        impractical=impractical,
    )


def _mps_capability() -> DeviceCapability:  # pragma: no cover - no Apple hardware in CI
    support = {"fp32": NATIVE, "fp16-mixed": NATIVE, "bf16-mixed": NATIVE, "bf16-true": NATIVE, "fp8": UNSUPPORTED}
    reasons = {"fp8": "torchao's float8 training does not run on Apple GPUs; use bf16-mixed"}
    return DeviceCapability(device="mps", name="Apple GPU (MPS)", flags={"mps": True}, support=support,
                            reasons=reasons)


def default_device() -> torch.device:
    """The device mixprec trains on when none is given: CUDA, then MPS, then the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


@cache
def _detect(device: str) -> DeviceCapability:
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} was asked for, but CUDA is not available; use 'cpu'")
        return _cuda_capability(dev)
    if dev.type == "mps":
        return _mps_capability()
    if dev.type == "cpu":
        return _cpu_capability()
    raise ValueError(f"unknown device type {dev.type!r}; mixprec supports 'cpu', 'cuda' and 'mps'")


def detect_capability(device: str | torch.device | None = None) -> DeviceCapability:
    """Detect what ``device`` (default: the one mixprec would pick) offers for each precision.

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"`` or a ``torch.device``; ``None`` picks
            CUDA, then MPS, then the CPU.

    Example:
        >>> detect_capability("cpu").type
        'cpu'
    """
    dev = torch.device(device) if device is not None else default_device()
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return _detect(str(dev))


def choose_auto(cap: DeviceCapability) -> tuple[str, str]:
    """The fastest safe precision for ``cap`` and the reason, in words.

    bf16-mixed where bf16 is native (fp32's range, so no loss scaling can fail), fp16-mixed on
    CUDA without native bf16 (tensor cores, with a loss scaler), else fp32.
    """
    if cap.is_native("bf16-mixed"):
        what = "AMX-BF16" if cap.flags.get("amx_bf16") else (
            "AVX512-BF16" if cap.flags.get("avx512_bf16") else "native bf16 support"
        )
        if cap.compute_capability:
            what = f"compute capability {cap.compute_capability[0]}.{cap.compute_capability[1]}"
        return "bf16-mixed", f"bf16 is native on {cap.device} ({what}) and has fp32's range: no loss scaling needed"
    if cap.type == "cuda" and cap.is_native("fp16-mixed"):
        return "fp16-mixed", f"{cap.device} has fp16 tensor cores but {cap.reasons.get('bf16-mixed', 'no native bf16')}"
    why = cap.reasons.get("bf16-mixed", "") or "no low precision is native here"
    return "fp32", f"no 16-bit format is native on {cap.device}: {why}"


def environment_report() -> dict:
    """Everything ``mixprec env`` prints: torch version, devices, flags, per-precision support."""
    import sys

    devices = [detect_capability("cpu")]
    if torch.cuda.is_available():
        devices += [detect_capability(f"cuda:{i}") for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():  # pragma: no cover
        devices.append(detect_capability("mps"))
    default = detect_capability(None)
    auto, reason = choose_auto(default)
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "default_device": default.device,
        "auto": {"precision": auto, "reason": reason},
        "devices": [
            {
                "device": c.device,
                "name": c.name,
                "compute_capability": list(c.compute_capability) if c.compute_capability else None,
                "flags": dict(c.flags),
                "support": dict(c.support),
                "reasons": dict(c.reasons),
            }
            for c in devices
        ],
    }
