"""One walker over the nested containers that batches, model outputs and arguments are made of.

Every place that touches "each tensor in this batch" (moving it to the device, casting it,
gathering it across processes, concatenating evaluation outputs, tracing module outputs) walks
the same containers the same way, through :func:`tree_map` and :func:`tree_leaves` here.

They are torch's own pytree (``torch.utils._pytree``, the one ``torch.compile`` and
``torch.export`` use: tuples, lists, dicts, ``OrderedDict``/``defaultdict``/``deque``, named
tuples, ``torch.return_types``, and the types libraries register, such as Hugging Face's
``ModelOutput``), widened to the containers user batches hold that the pytree treats as opaque
leaves:

* any other ``Mapping`` (Hugging Face's ``BatchEncoding`` is a ``UserDict``; a ``dict``
  subclass), rebuilt as its own type from a dict, or as a plain dict when its constructor
  does not take one;
* subclasses of ``list`` and ``tuple``, rebuilt as their own type from an iterable;
* dataclass instances, rebuilt with ``dataclasses.replace`` from their ``init`` fields.

Everything else (tensors, numbers, strings, ``None``, other objects) is a leaf.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["tree_map", "tree_leaves"]


def _node(obj: Any) -> tuple[list[Any], Callable[[list[Any]], Any]] | None:
    """``(children, rebuild)`` for a container the pytree leaves opaque, ``None`` for a true leaf."""
    if isinstance(obj, torch.Tensor):
        return None
    if isinstance(obj, Mapping):
        keys = list(obj.keys())

        def rebuild_mapping(values: list[Any]) -> Any:
            mapping = dict(zip(keys, values))
            try:
                return type(obj)(mapping)
            except TypeError:  # a mapping whose constructor takes something else
                return mapping

        return [obj[k] for k in keys], rebuild_mapping
    if isinstance(obj, (list, tuple)):
        return list(obj), type(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = _init_fields(type(obj))
        return ([getattr(obj, n) for n in names],
                lambda values: dataclasses.replace(obj, **dict(zip(names, values))))
    return None


def tree_map(fn: Callable[..., Any], tree: Any, *rests: Any) -> Any:
    """``tree`` with every leaf ``x`` replaced by ``fn(x)``, each container rebuilt as its own type.

    With ``rests`` (trees of the same structure), ``fn`` receives the leaves at the same place
    in each: ``fn(x, *others)``. Leaves are visited in a fixed order (a mapping's in its key
    order), so collectives called from ``fn`` line up across processes.

    Example:
        >>> from collections import namedtuple
        >>> Pair = namedtuple("Pair", "x y")
        >>> tree_map(lambda t: t * 2 if isinstance(t, torch.Tensor) else t, {"a": Pair(torch.ones(1), "s")})
        {'a': Pair(x=tensor([2.]), y='s')}
    """
    return _map_one(fn, tree) if not rests else _map_general(fn, tree, *rests)


def _map_general(fn: Callable[..., Any], tree: Any, *rests: Any) -> Any:
    def visit(leaf: Any, *others: Any) -> Any:
        node = _node(leaf)
        if node is None:
            return fn(leaf, *others)
        children, rebuild = node
        other_children = []
        for o in others:
            o_node = _node(o)
            if o_node is None or type(o) is not type(leaf) or len(o_node[0]) != len(children):
                raise ValueError(f"tree_map() needs trees of one structure; found {type(leaf).__name__} of "
                                 f"{len(children)} beside {type(o).__name__}")
            other_children.append(o_node[0])
        return rebuild([tree_map(fn, c, *oc) for c, *oc in zip(children, *other_children)])

    return pytree.tree_map(visit, tree, *rests)


_LEAVES = (torch.Tensor, type(None), bool, int, float, str)


def _map_one(fn: Callable[..., Any], tree: Any) -> Any:
    """:func:`tree_map` of one tree, the shapes of a batch (plain dicts, lists and tuples of tensors)
    walked directly: the same leaves in the same order, without the pytree's flatten and unflatten
    (a tenth of the time: it runs on every batch). Anything else takes the general path."""
    kind = type(tree)
    if kind is dict:
        return {k: _map_one(fn, v) for k, v in tree.items()}
    if kind is list:
        return [_map_one(fn, v) for v in tree]
    if kind is tuple:
        return tuple(_map_one(fn, v) for v in tree)
    if isinstance(tree, _LEAVES):
        return fn(tree)
    if kind not in pytree.SUPPORTED_NODES and not isinstance(tree, Mapping) and dataclasses.is_dataclass(tree) \
            and not isinstance(tree, type):  # a model's output dataclass: walked here too, on every step
        names = _init_fields(kind)
        return dataclasses.replace(tree, **{n: _map_one(fn, getattr(tree, n)) for n in names})
    return _map_general(fn, tree)


_INIT_FIELDS: dict[type, tuple[str, ...]] = {}


def _init_fields(kind: type) -> tuple[str, ...]:
    """The ``init`` fields of dataclass ``kind`` (what ``dataclasses.replace`` takes), found once."""
    names = _INIT_FIELDS.get(kind)
    if names is None:
        names = _INIT_FIELDS[kind] = tuple(f.name for f in dataclasses.fields(kind) if f.init)
    return names


def tree_leaves(tree: Any) -> list[Any]:
    """Every leaf of ``tree``, in the order :func:`tree_map` visits them.

    Example:
        >>> tree_leaves({"a": [torch.zeros(1), 3], "b": None})
        [tensor([0.]), 3, None]
    """
    out: list[Any] = []
    for leaf in pytree.tree_leaves(tree):
        node = _node(leaf)
        if node is None:
            out.append(leaf)
        else:
            for child in node[0]:
                out.extend(tree_leaves(child))
    return out
