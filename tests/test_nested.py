"""``mixprec.nested``: one walker for batches, outputs and arguments, keeping every container's type."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from mixprec.nested import tree_leaves, tree_map
from mixprec.tasks import CausalLMOutput


def double(x):
    return x * 2 if isinstance(x, torch.Tensor) else x


Point = collections.namedtuple("Point", "x y")


class Encoding(collections.UserDict):
    """Like transformers' BatchEncoding: a UserDict, which torch's pytree leaves opaque."""


class Record(dict):
    """A dict subclass the pytree does not know."""


class Strict(collections.abc.Mapping):
    """A mapping whose constructor takes no dict: rebuilt as a plain dict."""

    def __init__(self, **kw):
        self._d = kw

    def __getitem__(self, k):
        return self._d[k]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)


class Shape(tuple):
    """A tuple subclass that is not a named tuple."""


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: torch.Tensor
    rest: list
    derived: int = dataclasses.field(init=False, default=7)


@dataclasses.dataclass
class HFStyleOutput(collections.OrderedDict):
    """Shaped like Hugging Face's ModelOutput without transformers installed: a dataclass and an OrderedDict."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def __post_init__(self):
        if isinstance(self.loss, dict):  # built from one dict, as Hugging Face's ModelOutput can be
            given, self.loss = self.loss, None
            for k, v in given.items():
                setattr(self, k, v)
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                self[f.name] = getattr(self, f.name)


def test_plain_containers_and_named_tuples_keep_their_types_and_non_tensor_leaves():
    t = torch.ones(2)
    out = tree_map(double, {"a": [t, (t, Point(t, "s"))], "b": None, "c": 3, "d": "text"})
    assert out["a"][0].tolist() == [2.0, 2.0] and isinstance(out["a"][1], tuple)
    assert type(out["a"][1][1]) is Point and out["a"][1][1].y == "s" and out["a"][1][1].x.tolist() == [2.0, 2.0]
    assert out["b"] is None and out["c"] == 3 and out["d"] == "text"


def test_mappings_the_pytree_leaves_opaque_are_walked_and_rebuilt_as_their_type():
    t = torch.ones(1)
    enc, rec, strict = tree_map(double, (Encoding({"ids": t}), Record(x=t), Strict(y=t)))
    assert type(enc) is Encoding and enc["ids"].item() == 2.0
    assert type(rec) is Record and rec["x"].item() == 2.0
    assert type(strict) is dict and strict["y"].item() == 2.0  # its constructor takes no dict


def test_ordered_and_default_dicts_keep_their_type_and_key_order():
    t = torch.ones(1)
    od = tree_map(double, collections.OrderedDict([("z", t), ("a", t)]))
    dd = tree_map(double, collections.defaultdict(list, {"k": t}))
    assert type(od) is collections.OrderedDict and list(od) == ["z", "a"]
    assert type(dd) is collections.defaultdict and dd.default_factory is list and dd["k"].item() == 2.0


def test_dataclasses_are_rebuilt_from_their_init_fields():
    t = torch.ones(1)
    out = tree_map(double, Frozen(t, [t, {"k": t}]))
    assert type(out) is Frozen and out.a.item() == 2.0 and out.rest[1]["k"].item() == 2.0 and out.derived == 7


def test_model_outputs_of_the_built_in_tasks_and_of_hugging_face_shape_keep_their_type():
    t = torch.ones(1)
    ours = tree_map(double, CausalLMOutput(loss=None, logits=t))
    assert type(ours) is CausalLMOutput and ours.loss is None and ours.logits.item() == 2.0
    hf = tree_map(double, HFStyleOutput(loss=t, logits=t))
    assert type(hf) is HFStyleOutput and hf["loss"].item() == 2.0 and hf.logits.item() == 2.0


def test_tuple_subclasses_and_torch_return_types_are_walked():
    t = torch.ones(1)
    shape = tree_map(double, Shape((t, t)))
    assert type(shape) is Shape and shape[1].item() == 2.0
    maxed = tree_map(double, torch.max(torch.ones(2, 2), 0))
    assert type(maxed).__name__ == "max" and maxed.values.tolist() == [2.0, 2.0]


def test_leaves_come_in_the_order_tree_map_visits_them():
    a, b, c, d = (torch.tensor(float(i)) for i in range(4))
    tree = {"x": Encoding({"p": a, "q": [b]}), "y": Point(c, Frozen(d, []))}
    assert [t.item() for t in tree_leaves(tree)] == [0.0, 1.0, 2.0, 3.0]
    seen = []
    tree_map(lambda t: seen.append(t.item()) if isinstance(t, torch.Tensor) else t, tree)
    assert seen == [0.0, 1.0, 2.0, 3.0]


def test_several_trees_of_one_structure_are_mapped_leaf_by_leaf():
    one = {"a": Encoding({"t": torch.ones(1)}), "b": (torch.ones(2),)}
    two = {"a": Encoding({"t": torch.zeros(1)}), "b": (torch.zeros(2),)}
    out = tree_map(lambda x, y: torch.cat([x, y]), one, two)
    assert type(out["a"]) is Encoding and out["a"]["t"].tolist() == [1.0, 0.0] and out["b"][0].shape == (4,)


def test_trees_of_different_structures_are_refused():
    with pytest.raises(ValueError, match="one structure"):
        tree_map(lambda x, y: x, Encoding({"t": 1}), Encoding({"t": 1, "u": 2}))


@pytest.mark.slow
def test_hugging_face_batch_encoding_and_model_output_keep_their_types():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_outputs import CausalLMOutput as HFCausalLMOutput

    t = torch.ones(1)
    enc = tree_map(double, transformers.BatchEncoding({"input_ids": t}))
    out = tree_map(double, HFCausalLMOutput(loss=t, logits=t))
    assert type(enc) is transformers.BatchEncoding and enc["input_ids"].item() == 2.0
    assert type(out) is HFCausalLMOutput and out.loss.item() == 2.0 and out["logits"].item() == 2.0


def test_the_fast_walk_of_plain_containers_visits_and_rebuilds_as_the_pytree_walk_does():
    from mixprec.nested import _map_general

    @dataclasses.dataclass
    class Out:
        loss: torch.Tensor
        extra: object = None

    Pair = collections.namedtuple("Pair", "x y")
    tree = {"b": [torch.ones(2), (3, None, "s")], "a": collections.OrderedDict(z=Pair(torch.zeros(1), 2.5)),
            "c": (Out(torch.ones(1), {"k": [True]}),), "d": torch.Size([2, 3])}
    seen_fast, seen_general = [], []
    fast = tree_map(lambda x: seen_fast.append(x) or (x * 2 if isinstance(x, torch.Tensor) else x), tree)
    general = _map_general(lambda x: seen_general.append(x) or (x * 2 if isinstance(x, torch.Tensor) else x), tree)
    assert repr(fast) == repr(general) and [repr(x) for x in seen_fast] == [repr(x) for x in seen_general]
    assert type(fast["a"]) is collections.OrderedDict and type(fast["a"]["z"]) is Pair and type(fast["c"][0]) is Out


def recorder(seen):
    """A map function that notes each leaf it is given and doubles the tensors."""
    return lambda leaf: seen.append(leaf) or (leaf * 2 if isinstance(leaf, torch.Tensor) else leaf)


@pytest.mark.slow
def test_hugging_face_model_outputs_walked_directly_match_the_pytree_walk():
    pytest.importorskip("transformers")
    from transformers.modeling_outputs import CausalLMOutputWithPast, SequenceClassifierOutput

    from mixprec.nested import _map_general

    t = torch.arange(3.0)
    for out in (SequenceClassifierOutput(loss=t.sum(), logits=t.bfloat16(), hidden_states=(t, t + 1)),
                CausalLMOutputWithPast(logits=t, past_key_values=None, hidden_states=({"a": [t]},))):
        seen_fast, seen_general = [], []
        fast, general = tree_map(recorder(seen_fast), out), _map_general(recorder(seen_general), out)
        assert type(fast) is type(out) and list(fast.keys()) == list(general.keys()) == list(out.keys())
        assert repr(fast) == repr(general) and [repr(x) for x in seen_fast] == [repr(x) for x in seen_general]


def test_a_type_registered_with_the_pytree_after_a_walk_is_walked_as_registered():
    from torch.utils import _pytree as pytree

    @dataclasses.dataclass
    class Late:
        a: torch.Tensor
        b: torch.Tensor

    first = tree_map(double, Late(torch.ones(1), torch.ones(1)))  # walked as a dataclass: both fields
    assert first.a.item() == first.b.item() == 2.0
    pytree.register_pytree_node(Late, lambda x: ([x.a], x.b), lambda values, b: Late(values[0], b))
    try:
        second = tree_map(double, Late(torch.ones(1), torch.ones(1)))  # now as the pytree says: b is context
        assert second.a.item() == 2.0 and second.b.item() == 1.0
    finally:
        pytree._deregister_pytree_node(Late)
