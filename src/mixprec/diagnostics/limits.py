"""The number-format facts the diagnostics classify against, computed from ``torch.finfo``.

``torch.finfo`` gives the largest value, the smallest normal and the machine epsilon of a
format; the smallest subnormal is ``smallest_normal * eps`` (one unit in the last place at the
bottom of the normal range), and under round-to-nearest-even a value rounds to zero when its
magnitude is at most half of that. Nothing here is a hard-coded constant, so the same code
describes any floating dtype torch knows.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["FormatLimits", "FORMAT_LIMITS", "format_limits"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FormatLimits:
    """The range facts of one floating-point format.

    Args:
        name: short name (``"fp16"``, ``"bf16"``).
        dtype: the torch dtype.
        max: the largest finite value (fp16: 65504).
        smallest_normal: the smallest positive normal value (fp16: 2**-14).
        smallest_subnormal: the smallest positive subnormal value (fp16: 2**-24).
        flush_threshold: half the smallest subnormal (fp16: 2**-25). A value with a magnitude
            below it rounds to zero when cast to the format (exactly at it, it rounds to zero
            too: the tie goes to the even neighbour, which is zero).

    Example:
        >>> FORMAT_LIMITS["fp16"].max
        65504.0
        >>> FORMAT_LIMITS["fp16"].flush_threshold == 2.0**-25
        True
    """

    name: str
    dtype: torch.dtype
    max: float
    smallest_normal: float
    smallest_subnormal: float
    flush_threshold: float

    def __post_init__(self) -> None:
        if not self.dtype.is_floating_point:
            raise ValueError(f"FormatLimits needs a floating dtype, got {self.dtype}; use format_limits(torch.float16)")
        ordered = 0.0 < self.flush_threshold < self.smallest_subnormal <= self.smallest_normal < self.max
        if not ordered:
            raise ValueError(
                "FormatLimits must satisfy 0 < flush_threshold < smallest_subnormal <= smallest_normal < max, "
                f"got {self}; build it with format_limits(dtype) instead of by hand"
            )

    @classmethod
    def from_dtype(cls, dtype: torch.dtype, name: str | None = None) -> FormatLimits:
        """Compute the limits of ``dtype`` from ``torch.finfo``.

        Example:
            >>> FormatLimits.from_dtype(torch.bfloat16).smallest_normal == torch.finfo(torch.bfloat16).tiny
            True
        """
        fi = torch.finfo(dtype)
        smallest_subnormal = fi.smallest_normal * fi.eps  # eps = 2**-mantissa_bits: one ulp at the bottom
        return cls(
            name=name or str(dtype).removeprefix("torch."),
            dtype=dtype,
            max=float(fi.max),
            smallest_normal=float(fi.smallest_normal),
            smallest_subnormal=float(smallest_subnormal),
            flush_threshold=float(smallest_subnormal / 2),
        )


def format_limits(dtype: torch.dtype) -> FormatLimits:
    """The :class:`FormatLimits` of any floating dtype (``FORMAT_LIMITS`` holds fp16 and bf16).

    Example:
        >>> format_limits(torch.float32).max == torch.finfo(torch.float32).max
        True
    """
    return FormatLimits.from_dtype(dtype)


FORMAT_LIMITS: dict[str, FormatLimits] = {
    "fp16": FormatLimits.from_dtype(torch.float16, "fp16"),
    "bf16": FormatLimits.from_dtype(torch.bfloat16, "bf16"),
}
