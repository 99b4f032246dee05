"""Per-parameter and per-module gradient statistics against the fp16 and bf16 formats.

:class:`GradientStats` answers "how much of this gradient would fp16 lose, and does the loss
scale save it?". At each sampled step it classifies every gradient element twice, as the true
(unscaled) value and as that value times the current loss scale: exactly zero, would flush to
zero, subnormal, normal or overflow, in fp16 and in bf16, plus NaNs and a log2 histogram.

The classes are a *prediction* of what a cast to the format would do, made from the gradient
as it is stored (usually fp32: autocast keeps fp32 parameters, so their gradients are fp32).
Values that already underflowed inside an fp16 backward arrive as exact zeros and are counted
as zeros, not as flushes: that is why a loss scale has to be applied *before* backward, and why
``observe(..., grads_are_scaled_by=scale)`` on a scaled backward shows the flush it prevented.

Cost, per observation: one ``torch.cat`` of all gradients into a float32 buffer, then per pass
(unscaled, at scale) five elementwise integer kernels, one table lookup and one count, whatever
the number of parameters (see ``_binning.py``). Nothing is read back to the host until
:meth:`GradientStats.report`.
"""

from __future__ import annotations

import collections
import dataclasses
import numbers
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mixprec.diagnostics._binning import FORMAT_CLASSES, FORMATS, Binning, build_table, count, fine_classes

__all__ = ["GradientStats"]

ScaleLike = float | torch.Tensor | Callable[[], float | torch.Tensor] | torch.amp.GradScaler | None


@dataclasses.dataclass(eq=False)
class _Layout:
    """Where each gradient lies in the concatenated buffer (one per device)."""

    key: tuple[tuple[int, int], ...]  # (parameter index, numel) in buffer order
    total: int
    seg_base: torch.Tensor  # int32 per element: segment index * n_fine


@dataclasses.dataclass(eq=False)
class _Group:
    """One device's counts for one observation: device tensors until report() moves them."""

    key: tuple[tuple[int, int], ...]  # the layout's key only: a kept record must not pin seg_base
    unscaled: torch.Tensor  # int64 [n_segments * n_fine]
    at_scale: torch.Tensor


@dataclasses.dataclass(eq=False)
class _Record:
    step: int
    scale: float | torch.Tensor
    carried: float | torch.Tensor
    groups: list[_Group]
    host: dict[str, Any] | None = None  # filled by report(): counts decoded per parameter


class GradientStats:
    """Gradient statistics per parameter and per module, kept on the device.

    Args:
        model: the module whose ``named_parameters()`` (at construction) are observed.
        every_n_steps: observe when ``step % every_n_steps == 0``; ``None`` or ``0`` disables the
            object (``observe`` is a no-op, ``report`` returns ``[]``).
        bins: ``(lo, hi)`` log2 edges of the histogram: bins ``(2**e, 2**(e+1)]`` for ``e`` in
            ``lo..hi-1``, plus an underflow bin ``(0, 2**lo]`` and an overflow bin ``> 2**hi``
            (inf included); zeros and NaNs are counted apart.
        scale_source: the current loss scale, for the "at scale" pass: a number, a 0-d tensor, a
            callable returning either, or a ``LossScaler``/``GradScaler`` (its scale tensor is read
            without a sync). ``None``: 1.0, and the at-scale numbers equal the unscaled ones.
        history: how many observed steps are kept (older ones are dropped).

    Memory: while a step is observed, two float32 copies of all gradients and one int32 per
    element; between observations, one cached int32 per element (segment ids) and a 2 MiB
    lookup table per device. Sparse gradients are skipped.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> stats = GradientStats(model, scale_source=2.0**16)
        >>> (model(torch.randn(8, 4)).sum() * 1e-9).backward()
        >>> stats.observe(0)
        >>> rec = stats.report()[0]
        >>> sorted(rec["modules"]), rec["scale"]
        (['0', '1'], 65536.0)
        >>> rec["modules"]["0"]["at_scale"]["fp16"]["flush"] <= rec["modules"]["0"]["unscaled"]["fp16"]["flush"]
        True
    """

    def __init__(
        self,
        model: torch.nn.Module,
        every_n_steps: int | None = 1,
        bins: tuple[int, int] = (-40, 20),
        scale_source: ScaleLike = None,
        *,
        history: int = 100,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"GradientStats needs a torch.nn.Module, got {type(model).__name__}")
        if every_n_steps is not None and (
            not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 0
        ):
            raise ValueError(
                f"every_n_steps must be an int >= 1 (or None/0 to disable), got {every_n_steps!r}"
            )
        if (
            not isinstance(bins, (tuple, list)) or len(bins) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) for b in bins)
            or not -149 <= bins[0] < bins[1] <= 127
        ):
            raise ValueError(
                f"bins must be (lo, hi) ints with -149 <= lo < hi <= 127 (log2 edges inside fp32's range), "
                f"got {bins!r}; the default is (-40, 20)"
            )
        if not (scale_source is None or _is_scale_like(scale_source) or callable(scale_source)):
            raise TypeError(
                "scale_source must be None, a number, a 0-d tensor, a callable returning one, or a "
                f"LossScaler/GradScaler; got {type(scale_source).__name__}"
            )
        if not isinstance(history, int) or isinstance(history, bool) or history < 1:
            raise ValueError(f"history must be an int >= 1 (observed steps kept), got {history!r}")
        self._every = every_n_steps or 0
        self._lo, self._hi = int(bins[0]), int(bins[1])
        self._scale_source = scale_source
        named = list(model.named_parameters())
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        # The parent module of "encoder.3.ffn.weight" is "encoder.3.ffn"; a root parameter's is "".
        self._module_of = [n.rpartition(".")[0] for n in self._names]
        self._modules = list(dict.fromkeys(self._module_of))
        self._records: collections.deque[_Record] = collections.deque(maxlen=history)
        self._tables: dict[torch.device, torch.Tensor] = {}
        self._layouts: dict[torch.device, _Layout] = {}
        self._binning: Binning | None = None

    @property
    def scale_source(self) -> ScaleLike:
        """Where the "at scale" pass reads the loss scale (set it when the run's scaler is replaced)."""
        return self._scale_source

    @scale_source.setter
    def scale_source(self, source: ScaleLike) -> None:
        if not (source is None or _is_scale_like(source) or callable(source)):
            raise TypeError(f"scale_source must be None, a number, a 0-d tensor, a callable returning one, or a "
                            f"LossScaler/GradScaler; got {type(source).__name__}")
        self._scale_source = source

    @property
    def enabled(self) -> bool:
        """Whether :meth:`observe` does anything."""
        return self._every > 0

    @property
    def hist_edges(self) -> list[int]:
        """The log2 edges ``lo..hi``: ``log2_hist[0]`` is ``(0, 2**lo]``, ``[i]`` is
        ``(2**edges[i-1], 2**edges[i]]``, the last is ``> 2**hi``."""
        return list(range(self._lo, self._hi + 1))

    # -- observing (no host sync) ---------------------------------------------------------
    def observe(self, step: int, grads_are_scaled_by: ScaleLike = None) -> None:
        """Classify the current gradients, if ``step`` is sampled. No host-device sync.

        Never modifies the gradients: they are copied into a float32 buffer first (so an fp16
        gradient times a large scale cannot overflow the measurement itself).

        Args:
            step: the training step; observed when ``step % every_n_steps == 0``.
            grads_are_scaled_by: the scale the gradients carry now: pass the loss scale when
                observing right after ``scaler.scale(loss).backward()``, leave ``None`` (1.0)
                after ``unscale_`` or without scaling. A number, a tensor, or the scaler itself.
                True values are ``grad / grads_are_scaled_by``; at-scale values are the true
                values times ``scale_source``'s scale.
        """
        if not self._every or step % self._every:
            return
        by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        replicated: set[int] = set()  # plain gradients beside sharded ones: the same on every rank
        group = None
        for i, p in enumerate(self._params):
            g = p.grad
            if g is not None and hasattr(g, "to_local") and all(pl.is_shard() for pl in g.placements):
                # An FSDP2 (DTensor) gradient: count this rank's shard, even an empty one (every
                # rank keeps the same layout), and sum the counts over the shards' ranks below.
                group = g.device_mesh.get_group()
                by_device.setdefault(g.device, []).append((i, g.to_local()))
                continue
            if g is None or g.is_sparse or g.numel() == 0:
                continue
            replicated.add(i)
            by_device.setdefault(g.device, []).append((i, g.to_local() if hasattr(g, "to_local") else g))
        if not by_device:
            return
        carried = _read_scale(grads_are_scaled_by)
        scale = _read_scale(self._scale_source)
        groups = [self._observe_device(dev, items, carried, scale) for dev, items in by_device.items()]
        if group is not None:
            for g in groups:
                _sum_over_shards(g, replicated, group, self._binning.n_fine)
        self._records.append(_Record(step=step, scale=scale, carried=carried, groups=groups))

    def _observe_device(self, device, items, carried, scale) -> _Group:
        table, layout = self._table(device), self._layout(device, items)
        n = len(layout.key) * self._binning.n_fine
        true = torch.empty(layout.total, dtype=torch.float32, device=device)
        torch.cat([g.detach().reshape(-1) for _, g in items], out=true)  # the copy: grads stay untouched
        if not _is_one(carried):
            true.div_(_on(carried, device))
        scaled = None if _is_one(scale) else true * _on(scale, device)  # fp32: the product cannot overflow fp16
        unscaled = count(fine_classes(true, table).add_(layout.seg_base), n)
        at_scale = unscaled if scaled is None else count(fine_classes(scaled, table).add_(layout.seg_base), n)
        return _Group(key=layout.key, unscaled=unscaled, at_scale=at_scale)

    def _table(self, device: torch.device) -> torch.Tensor:
        if device not in self._tables:
            table, self._binning = build_table(self._lo, self._hi)
            self._tables[device] = table.to(device, non_blocking=True)  # the source is cached: it stays alive
        return self._tables[device]

    def _layout(self, device: torch.device, items: list[tuple[int, torch.Tensor]]) -> _Layout:
        key = tuple((i, g.numel()) for i, g in items)
        layout = self._layouts.get(device)
        if layout is None or layout.key != key:
            numels = torch.tensor([n for _, n in key]).to(device, non_blocking=True)
            base = torch.arange(len(key), dtype=torch.int32, device=device) * self._binning.n_fine
            # Built once per set of gradients and kept: rebuilding it costs more than a whole pass.
            # output_size spares repeat_interleave a device-to-host read of numels.sum().
            total = sum(n for _, n in key)
            layout = _Layout(key=key, total=total,
                             seg_base=torch.repeat_interleave(base, numels, output_size=total))
            self._layouts[device] = layout
        return layout

    # -- reading (syncs) ------------------------------------------------------------------
    def report(self) -> list[dict[str, Any]]:
        """The observed steps, oldest first, as plain Python. The one host sync of this class.

        Each record is ``{"step", "scale", "grads_scaled_by", "parameters", "modules"}``;
        ``parameters`` maps a parameter name and ``modules`` a module path (the parent of its
        parameters, ``""`` for the root) to ``{"numel", "unscaled", "at_scale"}``, each of those
        ``{"zero": fraction, "nan": count, "fp16": {"flush", "subnormal", "overflow"},
        "bf16": {...}, "log2_hist": [counts]}`` (format entries are fractions of ``numel``;
        see :attr:`hist_edges` for the bins). Only steps with at least one gradient appear.
        """
        self._to_host()
        return [self._record_dict(r) for r in self._records]

    def summary(self) -> dict[str, dict[str, float]]:
        """Per module, the worst fraction over the kept steps. Syncs (as :meth:`report`).

        Returns ``{module: {"fp16_flush_unscaled", "fp16_flush_at_scale",
        "fp16_overflow_at_scale", "steps"}}``: the maximum of each fraction over the observed
        steps, and how many steps observed the module.
        """
        self._to_host()
        out: dict[str, dict[str, float]] = {}
        b = self._binning
        cols = {"fp16_flush_unscaled": ("unscaled", "fp16.flush"), "fp16_flush_at_scale": ("at_scale", "fp16.flush"),
                "fp16_overflow_at_scale": ("at_scale", "fp16.overflow")}
        for r in self._records:
            mod = r.host["modules"]
            for j, name in enumerate(r.host["module_names"]):
                numel = float(mod["numel"][j])
                entry = out.setdefault(name, {k: 0.0 for k in cols} | {"steps": 0})
                entry["steps"] += 1
                for key, (which, col) in cols.items():
                    entry[key] = max(entry[key], float(mod[which][j, b.column(col)]) / numel)
        return out

    def clear(self) -> None:
        """Forget the observed steps. No sync."""
        self._records.clear()

    def _to_host(self) -> None:
        """Move every pending record's counts and scales to the host: one transfer per device."""
        pending = [r for r in self._records if r.host is None]
        if not pending:
            return
        counts = _fetch([t for r in pending for g in r.groups for t in (g.unscaled, g.at_scale)])
        scales = _fetch([s for r in pending for s in (r.scale, r.carried) if isinstance(s, torch.Tensor)])
        decode = self._binning.decode
        for r in pending:
            per_param = torch.zeros(len(self._params), decode.shape[1] * 2 + 1, dtype=torch.float64)
            seen = torch.zeros(len(self._params), dtype=torch.bool)
            for g in r.groups:
                idx = torch.tensor([i for i, _ in g.key])
                unscaled = next(counts).view(len(idx), -1).double()
                at_scale = next(counts).view(len(idx), -1).double()
                per_param[idx] = torch.cat([unscaled.sum(1, keepdim=True), unscaled @ decode, at_scale @ decode], 1)
                seen[idx] = True
            r.scale = float(next(scales)) if isinstance(r.scale, torch.Tensor) else float(r.scale)
            r.carried = float(next(scales)) if isinstance(r.carried, torch.Tensor) else float(r.carried)
            r.groups = []  # the device tensors are no longer needed
            r.host = self._decode_record(per_param, seen)

    def _decode_record(self, per_param: torch.Tensor, seen: torch.Tensor) -> dict[str, Any]:
        ncol = self._binning.decode.shape[1]
        mod_index = {m: j for j, m in enumerate(self._modules)}
        owner = torch.tensor([mod_index[m] for m in self._module_of], dtype=torch.int64)
        per_mod = torch.zeros(len(self._modules), per_param.shape[1], dtype=torch.float64)
        per_mod.index_add_(0, owner[seen], per_param[seen])
        mod_seen = torch.zeros(len(self._modules), dtype=torch.bool)
        mod_seen[owner[seen]] = True
        param_idx = seen.nonzero().flatten().tolist()
        mod_idx = mod_seen.nonzero().flatten().tolist()
        return {
            "param_names": [self._names[i] for i in param_idx],
            "module_names": [self._modules[j] for j in mod_idx],
            "params": _split(per_param[param_idx], ncol),
            "modules": _split(per_mod[mod_idx], ncol),
        }

    def _record_dict(self, r: _Record) -> dict[str, Any]:
        h = r.host
        return {
            "step": r.step,
            "scale": r.scale,
            "grads_scaled_by": r.carried,
            "parameters": self._entries(h["param_names"], h["params"]),
            "modules": self._entries(h["module_names"], h["modules"]),
        }

    def _entries(self, names: list[str], m: dict[str, torch.Tensor]) -> dict[str, Any]:
        b = self._binning
        hist0 = b.column("hist.0")
        out = {}
        numel, rows_u, rows_a = m["numel"].tolist(), m["unscaled"].tolist(), m["at_scale"].tolist()
        for name, n, u, a in zip(names, numel, rows_u, rows_a):
            out[name] = {"numel": int(n), "unscaled": _stats(u, n, b, hist0), "at_scale": _stats(a, n, b, hist0)}
        return out

    def __repr__(self) -> str:
        if not self.enabled:
            return "GradientStats(enabled=False)"
        return (f"GradientStats(parameters={len(self._params)}, every_n_steps={self._every}, "
                f"bins=({self._lo}, {self._hi}), observed={len(self._records)})")


def _sum_over_shards(group: _Group, replicated: set[int], process_group: Any, n_fine: int) -> None:
    """Sum a step's counts over the ranks holding the shards (an all-reduce on the device, no
    host sync); a replicated gradient's rows count once, from rank 0."""
    import torch.distributed as dist

    counts = [group.unscaled] if group.at_scale is group.unscaled else [group.unscaled, group.at_scale]
    if dist.get_rank(process_group) != 0:
        rows = [j for j, (i, _) in enumerate(group.key) if i in replicated]
        for c in counts:
            if rows:
                c.view(len(group.key), n_fine)[rows] = 0
    for c in counts:
        dist.all_reduce(c, group=process_group)


def _fetch(tensors: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The tensors on the host, in order, with one transfer per (device, dtype): one sync in all."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    out: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    for idx in groups.values():
        parts = [tensors[i].reshape(-1) for i in idx]
        host = torch.cat(parts).cpu().split([p.numel() for p in parts])
        for i, h in zip(idx, host):
            out[i] = h.view(tensors[i].shape)
    return iter(out)


def _split(rows: torch.Tensor, ncol: int) -> dict[str, torch.Tensor]:
    return {"numel": rows[:, 0], "unscaled": rows[:, 1:1 + ncol], "at_scale": rows[:, 1 + ncol:]}


def _stats(row: list[float], numel: float, b: Binning, hist0: int) -> dict[str, Any]:
    stats: dict[str, Any] = {"zero": row[b.column("zero")] / numel, "nan": int(row[b.column("nan")])}
    for fmt in FORMATS:
        stats[fmt] = {c: row[b.column(f"{fmt}.{c}")] / numel for c in FORMAT_CLASSES if c != "normal"}
    stats["log2_hist"] = [int(c) for c in row[hist0:hist0 + b.n_hist]]
    return stats


def _is_scale_like(x: object) -> bool:
    return (
        isinstance(x, numbers.Real) and not isinstance(x, bool)
        or isinstance(x, torch.Tensor) and x.numel() == 1
        or isinstance(x, torch.amp.GradScaler)
    )


def _read_scale(source: ScaleLike) -> float | torch.Tensor:
    """The scale now, as a float or a detached 0-d tensor copy (a scaler updates its tensor in place)."""
    if source is None:
        return 1.0
    if isinstance(source, torch.amp.GradScaler):
        t = getattr(source, "_scale", None)
        # No scale tensor yet (before the first scale() call) or disabled: get_scale() is a float, no sync.
        return t.detach().reshape(()).clone() if t is not None and source.is_enabled() else float(source.get_scale())
    if callable(source) and not isinstance(source, torch.Tensor):
        source = source()
    if isinstance(source, torch.Tensor):
        if source.numel() != 1:
            raise ValueError(f"a loss scale must be a single number, got a tensor of shape {tuple(source.shape)}")
        return source.detach().reshape(()).clone()
    if isinstance(source, numbers.Real) and not isinstance(source, bool):
        return float(source)
    raise TypeError(f"a loss scale must be a number, a 0-d tensor or a GradScaler, got {type(source).__name__}")


def _is_one(s: float | torch.Tensor) -> bool:
    return not isinstance(s, torch.Tensor) and s == 1.0


def _on(s: float | torch.Tensor, device: torch.device) -> float | torch.Tensor:
    return s.to(device=device, dtype=torch.float32, non_blocking=True) if isinstance(s, torch.Tensor) else s
