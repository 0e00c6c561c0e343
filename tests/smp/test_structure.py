"""The one nested-structure walker: each container kind is rebuilt with its own type, the rest are leaves."""

from __future__ import annotations

import types
from collections import OrderedDict, UserDict, defaultdict, namedtuple
from dataclasses import dataclass, fields
from typing import Any

import pytest

from smp.structure import is_namedtuple, leaves, map_structure, rebuild_mapping, rebuild_sequence

Pair = namedtuple("Pair", "a b")


class Tagged(list[Any]):
    def __init__(self, items: list[Any], tag: str) -> None:
        super().__init__(items)
        self.tag = tag


class Shape(tuple[int, ...]):
    pass


@dataclass
class Point:
    x: Any
    y: Any


class FakeModelOutput(OrderedDict[str, Any]):
    """Hugging Face's ModelOutput in brief: an OrderedDict dataclass whose keys are its non-None fields."""

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is not None:
                self[f.name] = value

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __reduce__(self) -> Any:
        callable_, _args, *rest = super().__reduce__()
        return (callable_, tuple(getattr(self, f.name) for f in fields(self)), *rest)  # type: ignore[arg-type]


@dataclass
class CausalOutput(FakeModelOutput):
    loss: Any = None
    logits: Any = None
    hidden_states: Any = None


def times10(v: Any) -> Any:
    return v * 10


def test_plain_tuples_lists_and_dicts_come_back_plain() -> None:
    out = map_structure({"a": [1, (2, 3)], "b": ()}, times10)
    assert out == {"a": [10, (20, 30)], "b": ()}
    assert type(out) is dict and type(out["a"]) is list and type(out["a"][1]) is tuple


def test_namedtuples_are_rebuilt_by_field() -> None:
    out = map_structure(Pair(1, [2]), times10)
    assert out == Pair(10, [20]) and type(out) is Pair and is_namedtuple(out)
    assert not is_namedtuple((1, 2)) and not is_namedtuple(Pair)


def test_tuple_and_list_subclasses_keep_their_type_and_attributes() -> None:
    out = map_structure(Shape((1, 2)), times10)
    assert out == (10, 20) and type(out) is Shape
    tagged = map_structure(Tagged([1, 2], "t"), times10)
    assert tagged == [10, 20] and type(tagged) is Tagged and tagged.tag == "t"


def test_mutable_mappings_are_copied_with_new_values_in_the_templates_order() -> None:
    od = map_structure(OrderedDict([("b", 1), ("a", 2)]), times10)
    assert type(od) is OrderedDict and list(od.items()) == [("b", 10), ("a", 20)]
    dd: defaultdict[str, list[int]] = defaultdict(list, x=1)  # type: ignore[arg-type]
    out = map_structure(dd, times10)
    assert type(out) is defaultdict and out.default_factory is list and out == {"x": 10}
    user = UserDict({"k": 1})
    user.extra = "kept"  # type: ignore[attr-defined]
    got = map_structure(user, times10)
    assert type(got) is UserDict and got.data == {"k": 10} and got.extra == "kept"
    assert user.data == {"k": 1}


def test_a_model_output_keeps_its_type_fields_and_keys() -> None:
    template = CausalOutput(loss=1, logits=[2, 3])
    out = map_structure(template, times10)
    assert type(out) is CausalOutput
    assert list(out.keys()) == ["loss", "logits"] and out.hidden_states is None
    assert (out.loss, out.logits, out["logits"]) == (10, [20, 30], [20, 30])
    assert (template.loss, template.logits) == (1, [2, 3])


def test_read_only_mappings_are_built_from_a_dict() -> None:
    out = map_structure(types.MappingProxyType({"a": 1}), times10)
    assert type(out) is types.MappingProxyType and dict(out) == {"a": 10}


def test_dataclasses_are_walked_by_field_and_sets_strings_and_classes_are_leaves() -> None:
    assert map_structure(Point(1, [2]), times10) == Point(10, [20])
    seen: list[Any] = []
    map_structure([{1, 2}, "ab", Point, frozenset()], lambda v: seen.append(v))
    assert seen == [{1, 2}, "ab", Point, frozenset()]


def test_is_leaf_stops_the_walk_at_the_values_it_names() -> None:
    out = map_structure([Point(1, 2), (3,)], lambda v: ("leaf", v), is_leaf=lambda v: isinstance(v, Point))
    assert out == [("leaf", Point(1, 2)), (("leaf", 3),)]


class StrictShape(tuple[int, ...]):
    """Like torch.Size: a tuple subclass that refuses anything but ints."""

    def __new__(cls, items: Any) -> StrictShape:
        items = tuple(items)
        if not all(isinstance(i, int) for i in items):
            raise TypeError("ints only")
        return super().__new__(cls, items)


def test_leaves_lists_every_leaf_in_walk_order_without_rebuilding_containers() -> None:
    obj = {"a": [1, Pair(2, StrictShape((3, 4)))], "b": Point(5, {"c": (6,)}), "d": "s", "e": {7}}
    assert leaves(obj) == [1, 2, 3, 4, 5, 6, "s", {7}]
    assert leaves([Point(1, 2), (3,)], is_leaf=lambda v: isinstance(v, Point)) == [Point(1, 2), 3]
    seen: list[Any] = []
    map_structure(obj, lambda v: seen.append(v) or v)
    assert seen == leaves(obj), "the same order as map_structure"


@pytest.mark.parametrize(("template", "items", "expected"), [
    ([1], [2], [2]), ((1,), [2], (2,)), (Pair(1, 2), [3, 4], Pair(3, 4)), (Shape((1,)), [5], Shape((5,))),
])
def test_rebuild_sequence(template: Any, items: list[Any], expected: Any) -> None:
    out = rebuild_sequence(template, items)
    assert out == expected and type(out) is type(expected)


def test_rebuild_mapping_of_a_plain_dict_is_the_items_themselves() -> None:
    items = {"a": 1}
    assert rebuild_mapping({"a": 0}, items) is items


def test_docstring_example() -> None:
    import doctest

    import smp.structure

    assert doctest.testmod(smp.structure).failed == 0
