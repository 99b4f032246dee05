"""Classify fp32 magnitudes into format classes and log2 bins with one table lookup.

The bit pattern of a non-negative float32 read as an int32 is monotone in its value, so a
range of values is a range of integers. Every boundary the diagnostics need lies on a multiple
of 2**12 in that integer space: fp16 keeps 10 mantissa bits and rounds at the 11th, bf16 keeps 7
and rounds at the 8th, and powers of two have an empty mantissa. So ``ceil(bits / 4096)``
(computed as ``((bits - 1) >> 12) + 1``, which also gives zero a bucket of its own) names a
bucket whose members all fall in the same class, and a 2**19-entry table maps the bucket to a
"fine class": one (fp16 class, bf16 class, log2 bin) combination. Per-element work is then
five integer kernels and one count, instead of a comparison per threshold.

The table is built by casting one member of each bucket to fp16 and bf16, so the classes are
exactly what the cast does (round to nearest even), with one exception: a bucket is
``(k - 1) * 4096 < bits <= k * 4096``, so a midpoint that rounds *up* (fp16's 2**-14 - 2**-25,
which rounds to the smallest normal, and 65520, which rounds to inf; bf16's two matching
midpoints) sits on top of the bucket below it and is counted as the lower class. That is one
fp32 value at each of four points.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from mixprec.diagnostics.limits import FORMAT_LIMITS

# The classes of one format, in the order of the columns of the decoding matrix.
ZERO, FLUSH, SUBNORMAL, NORMAL, OVERFLOW, NAN = range(6)
FORMAT_CLASSES = ("flush", "subnormal", "normal", "overflow")
FORMATS = ("fp16", "bf16")

_SHIFT = 12
_TABLE_SIZE = (0x7FFFFFFF >> _SHIFT) + 2  # buckets of every non-negative int32, plus zero's own


@dataclasses.dataclass(frozen=True, kw_only=True)
class Binning:
    """The lookup table's host-side description: what each fine class means.

    Args:
        lo: lowest log2 edge; the histogram's underflow bin is ``0 < |x| <= 2**lo``.
        hi: highest log2 edge; the overflow bin is ``|x| > 2**hi`` (inf included).
        decode: ``[n_fine, n_columns]`` float64 0/1 matrix; a row of fine-class counts times
            it gives the counts of :attr:`columns`.
        columns: names of the decoded columns: ``zero``, ``nan``, ``fp16.<class>``,
            ``bf16.<class>``, then ``hist.<i>`` for the ``hi - lo + 2`` histogram bins.
    """

    lo: int
    hi: int
    decode: torch.Tensor
    columns: tuple[str, ...]

    @property
    def n_fine(self) -> int:
        return self.decode.shape[0]

    @property
    def n_hist(self) -> int:
        return self.hi - self.lo + 2

    def column(self, name: str) -> int:
        return self.columns.index(name)


def _format_class(x: torch.Tensor, name: str) -> torch.Tensor:
    """The class (ZERO..NAN) of each value of ``x`` (fp32, >= 0 or NaN) after a cast to the format."""
    lim = FORMAT_LIMITS[name]
    c = x.to(lim.dtype).float()
    cls = torch.where(c.abs() < lim.smallest_normal, SUBNORMAL, NORMAL)
    cls = torch.where(c == 0, FLUSH, cls)
    cls = torch.where(x == 0, ZERO, cls)
    cls = torch.where(torch.isinf(c), OVERFLOW, cls)
    return torch.where(torch.isnan(x), NAN, cls)


@functools.lru_cache(maxsize=4)
def build_table(lo: int, hi: int) -> tuple[torch.Tensor, Binning]:
    """Build the bucket -> fine-class table (int32, on the CPU) and its :class:`Binning`.

    About 50 ms on one CPU core (casts of 2**19 values), so the result is memoized: callers
    only read it (a device copy is made per device).
    """
    k = torch.arange(_TABLE_SIZE, dtype=torch.int64)
    # The lowest member of each bucket: its class is the bucket's (see the module docstring).
    rep_bits = torch.where(k == 0, 0, (k - 1) * (1 << _SHIFT) + 1).clamp_(max=0x7FFFFFFF)
    x = rep_bits.to(torch.int32).view(torch.float32)
    c16, cbf = _format_class(x, "fp16"), _format_class(x, "bf16")
    # ceil(log2 x) through frexp (x = m * 2**e, m in [0.5, 1)): exact, no log rounding.
    m, e = torch.frexp(torch.where(torch.isfinite(x) & (x > 0), x, torch.ones_like(x)))
    ceil_log2 = torch.where(m == 0.5, e - 1, e).to(torch.int64)
    # Histogram bin h: 0 = underflow (<= 2**lo), 1 + i = (2**(lo+i), 2**(lo+i+1)], last = > 2**hi.
    h = (ceil_log2 - lo).clamp_(0, hi - lo + 1)
    h = torch.where(torch.isinf(x), hi - lo + 1, h)
    h = torch.where((x == 0) | torch.isnan(x), 0, h)
    n_hist = hi - lo + 2
    key = (c16 * 6 + cbf) * n_hist + h
    # Compact the keys to 0..n_fine-1 (torch.unique with return_inverse sorts: 30x slower here).
    present = torch.zeros(36 * n_hist, dtype=torch.bool)
    present[key] = True
    uniq = present.nonzero().flatten()
    inverse = (present.cumsum(0) - 1)[key]
    u16, ubf, uh = uniq // (6 * n_hist), (uniq // n_hist) % 6, uniq % n_hist

    columns = ["zero", "nan"]
    columns += [f"{fmt}.{c}" for fmt in FORMATS for c in FORMAT_CLASSES]
    columns += [f"hist.{i}" for i in range(n_hist)]
    decode = torch.zeros(len(uniq), len(columns), dtype=torch.float64)
    rows = torch.arange(len(uniq))
    decode[rows[u16 == ZERO], 0] = 1
    decode[rows[u16 == NAN], 1] = 1
    for f, cls in enumerate((u16, ubf)):
        for j, code in enumerate((FLUSH, SUBNORMAL, NORMAL, OVERFLOW)):
            decode[rows[cls == code], 2 + 4 * f + j] = 1
    counted = (u16 != ZERO) & (u16 != NAN)  # zeros and NaNs are not in the histogram
    decode[rows[counted], 10 + uh[counted]] = 1
    binning = Binning(lo=lo, hi=hi, decode=decode, columns=tuple(columns))
    return inverse.to(torch.int32), binning


def fine_classes(a: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Fine class (int32) of each element of ``a``, a float32 buffer this call may overwrite.

    Five kernels, all elementwise; ``a`` is destroyed (its bits become bucket numbers).
    """
    b = a.view(torch.int32)
    b.bitwise_and_(0x7FFFFFFF)  # |x|: clearing the sign bit keeps NaN a NaN, and bits stay monotone
    b.sub_(1).bitwise_right_shift_(_SHIFT).add_(1)  # ceil(bits / 4096); zero is -1 >> 12 = -1, +1 = 0
    return table.index_select(0, b)


def count(codes: torch.Tensor, n: int) -> torch.Tensor:
    """How many times each value in ``[0, n)`` occurs in ``codes`` (int64, on ``codes``' device).

    On the CPU ``bincount`` is the fastest way measured (1M codes on one core: ``bincount``
    0.7 ms, ``index_add_`` of ones 0.9 ms, ``histc`` 3.6 ms; ``segment_reduce`` would need one
    pass per class). On CUDA ``bincount`` copies its input's min and max to the host to size its
    output, a sync, so there an ``index_add_`` of ones into a zeroed buffer counts instead.
    """
    if codes.device.type == "cpu":
        return torch.bincount(codes, minlength=n)
    out = torch.zeros(n, dtype=torch.int64, device=codes.device)
    return out.index_add_(0, codes, torch.ones((), dtype=torch.int64, device=codes.device).expand(codes.numel()))
