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
# _DATACLASS: rebuilt by its constructor from its init fields (dataclasses.replace's result without
# its checks); _DATACLASS_INITVAR: one with InitVar pseudo-fields, rebuilt by dataclasses.replace.
_LEAF, _DATACLASS, _DATACLASS_INITVAR, _MODEL_OUTPUT, _GENERAL = range(5)
_HOW: dict[type, int] = {}  # how _map_one walks each type, decided once (again when the pytree registers types)
_HOW_FOR = [0]  # the pytree's registry size _HOW was decided for


def _how(kind: type) -> int:
    if len(pytree.SUPPORTED_NODES) != _HOW_FOR[0]:
        _HOW.clear()
        _HOW_FOR[0] = len(pytree.SUPPORTED_NODES)
    how = _HOW.get(kind)
    if how is None:
        how = _HOW[kind] = _classify(kind)
    return how


def _classify(kind: type) -> int:
    if issubclass(kind, _LEAVES):
        return _LEAF
    node = pytree.SUPPORTED_NODES.get(kind)
    if node is not None:
        # transformers registers each ModelOutput as (values, keys) -> type(**dict(zip(keys, values))):
        # rebuilt here the same way, without the pytree's flatten and unflatten of the whole output.
        flatten = node.flatten_fn
        from_transformers = getattr(flatten, "__module__", "").startswith("transformers.")
        return _MODEL_OUTPUT if from_transformers and flatten.__name__ == "_model_output_flatten" else _GENERAL
    if not issubclass(kind, Mapping) and dataclasses.is_dataclass(kind) and not issubclass(kind, type):
        # A model's output dataclass: walked here too, on every step.
        plain = len(dataclasses.fields(kind)) == len(kind.__dataclass_fields__)  # no InitVar, no ClassVar
        return _DATACLASS if plain else _DATACLASS_INITVAR
    return _GENERAL


def _map_one(fn: Callable[..., Any], tree: Any) -> Any:
    """:func:`tree_map` of one tree, the shapes of a batch and of a model's output (plain dicts,
    lists and tuples of tensors, output dataclasses, transformers' ``ModelOutput``) walked directly:
    the same leaves in the same order, without the pytree's flatten and unflatten (a tenth of the
    time: it runs on every batch and every forward; leaves of the common types are mapped in place,
    without a call of this function each). Anything else takes the general path."""
    kind = type(tree)
    if kind is dict:
        return {k: fn(v) if type(v) in _PLAIN_LEAVES else _map_one(fn, v) for k, v in tree.items()}
    if kind is list:
        return [fn(v) if type(v) in _PLAIN_LEAVES else _map_one(fn, v) for v in tree]
    if kind is tuple:
        return tuple([fn(v) if type(v) in _PLAIN_LEAVES else _map_one(fn, v) for v in tree])
    how = _how(kind)
    if how == _LEAF:
        return fn(tree)
    if how == _DATACLASS or how == _DATACLASS_INITVAR:
        values = {}
        for n in _init_fields(kind):
            v = getattr(tree, n)
            values[n] = fn(v) if type(v) in _PLAIN_LEAVES else _map_one(fn, v)
        return kind(**values) if how == _DATACLASS else dataclasses.replace(tree, **values)
    if how == _MODEL_OUTPUT:
        return kind(**{k: fn(v) if type(v) in _PLAIN_LEAVES else _map_one(fn, v) for k, v in tree.items()})
    return _map_general(fn, tree)


_PLAIN_LEAVES = frozenset({torch.Tensor, torch.nn.Parameter, type(None), bool, int, float, str})


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
