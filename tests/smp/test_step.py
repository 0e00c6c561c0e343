"""The framework-free step core: StepSpec validation, the five splitting rules, output aggregation.

A small pure-Python n-d array (`Arr`) and StepOutput stand in for a framework (STYLE.md habit 1:
a fake implements the protocol in core tests); smp.torch's tests run the same core on torch.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, UserDict, defaultdict, namedtuple
from types import MappingProxyType
from typing import Any, NamedTuple

import pytest

from smp.errors import SMPError, StepOutputError, TensorSplitError
from smp.step import StepSpec, aggregate_outputs, split_arguments


class Arr:
    """An n-d array of nested Python lists; just enough of a tensor for the StepOps protocol."""

    def __init__(self, data: Any) -> None:
        self.data = data
        shape = []
        d = data
        while isinstance(d, list):
            shape.append(len(d))
            d = d[0] if d else None
        self.shape = tuple(shape)

    @staticmethod
    def arange(*shape: int) -> Arr:
        def build(dims: tuple[int, ...], offset: int) -> Any:
            if not dims:
                return offset
            step = 1
            for s in dims[1:]:
                step *= s
            return [build(dims[1:], offset + i * step) for i in range(dims[0])]

        return Arr(build(shape, 0))

    def _dim(self, dim: int) -> int:
        if not -len(self.shape) <= dim < len(self.shape):
            raise IndexError(f"dimension {dim} out of range for a {len(self.shape)}-d array")
        return dim % len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> Arr:
        dim = self._dim(dim)

        def cut(d: Any, depth: int) -> Any:
            if depth == dim:
                return d[start:start + length]
            return [cut(x, depth + 1) for x in d]

        return Arr(cut(self.data, 0))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Arr) and self.data == other.data

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"Arr({self.data})"


class FakeStepOutput:
    def __init__(self, outputs: list[Any]) -> None:
        self.outputs = list(outputs)


class QuietThing:
    """Stands for a model/optimizer: passed whole without a warning."""


class Loader:
    """Stands for a DataLoader: passed whole, with a "probably a bug" hint."""


class Opaque:
    """An arbitrary non-primitive, non-callable object: passed whole, with a one-time warning."""


class FakeOps:
    def is_tensor(self, x: object) -> bool:
        return isinstance(x, Arr)

    def narrow(self, tensor: Any, dim: int, start: int, length: int) -> Any:
        return tensor.narrow(dim, start, length)

    def dim_size(self, tensor: Any, dim: int) -> int:
        return int(tensor.shape[tensor._dim(dim)])

    def is_step_output(self, x: object) -> bool:
        return isinstance(x, FakeStepOutput)

    def quiet(self, x: object) -> bool:
        return isinstance(x, QuietThing)

    def probable_bug(self, x: object) -> str | None:
        return "loaders are not split; pass the batch" if isinstance(x, Loader) else None


OPS = FakeOps()


def split(func: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, n: int = 2,
          **options: Any) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    return split_arguments(StepSpec.from_function(func, **options), args, kwargs or {}, n, OPS)


# ----------------------------------------------------------------------------------------------
# StepSpec


def f_plain(model, data, target):  # type: ignore[no-untyped-def]
    return None


def f_var(model, data, *extra, scale=1.0, **options):  # type: ignore[no-untyped-def]
    return None


def test_spec_maps_positions_and_keywords_to_names() -> None:
    spec = StepSpec.from_function(f_var)
    assert spec.positional_names == ("model", "data")
    assert (spec.var_positional, spec.var_keyword) == ("extra", "options")
    assert spec.parameter_names == {"model", "data", "extra", "scale", "options"}
    assert spec.names_of(0, None) == ("model",)
    assert spec.names_of(1, None) == ("data",)
    assert spec.names_of(2, None) == ("extra",)
    assert spec.names_of(7, None) == ("extra",)
    assert spec.names_of(None, "scale") == ("scale",)
    assert spec.names_of(None, "data") == ("data",)
    assert spec.names_of(None, "mask") == ("mask", "options")


def test_keyword_matching_a_positional_only_name_lands_in_var_keyword() -> None:
    def f(a, /, b, **rest):  # type: ignore[no-untyped-def]
        return None

    spec = StepSpec.from_function(f)
    assert spec.names_of(None, "a") == ("a", "rest")
    assert spec.names_of(None, "b") == ("b",)
    assert spec.names_of(0, None) == ("a",)


def test_spec_defaults_split_everything_along_axis_0() -> None:
    spec = StepSpec.from_function(f_plain)
    assert spec.non_split_inputs == frozenset() and dict(spec.input_split_axes) == {}
    assert spec.is_split(("data",)) and spec.axis_of(("data",)) == 0


def test_spec_records_options() -> None:
    spec = StepSpec.from_function(f_plain, ["model"], {"target": 1})
    assert spec.non_split_inputs == {"model"}
    assert not spec.is_split(("model",)) and spec.is_split(("target",))
    assert spec.axis_of(("target",)) == 1 and spec.axis_of(("data",)) == 0
    assert StepSpec.from_function(f_plain, ("model",)).non_split_inputs == {"model"}


def test_non_split_inputs_must_be_a_list() -> None:
    with pytest.raises(TensorSplitError) as e:
        StepSpec.from_function(f_plain, non_split_inputs="model")
    msg = str(e.value)
    assert "non_split_inputs='model'" in msg and "must be a list" in msg
    assert "non_split_inputs=['model']" in msg  # the fix
    assert isinstance(e.value, SMPError) and isinstance(e.value, ValueError)
    with pytest.raises(TensorSplitError, match="must be a list"):
        StepSpec.from_function(f_plain, non_split_inputs={"model"})


def test_unknown_names_and_bad_axes_are_collected_into_one_error() -> None:
    with pytest.raises(TensorSplitError) as e:
        StepSpec.from_function(f_plain, ["modle", 3], {"dtaa": 0, "data": "1", "target": True})
    msg = str(e.value)
    assert "(5 problem(s))" in msg
    assert "'modle' is not an argument of f_plain" in msg
    assert "['data', 'model', 'target']" in msg  # the valid names
    assert "entry 3 is a int" in msg
    assert "'dtaa' is not an argument" in msg
    assert "input_split_axes['data']='1': the axis must be an int" in msg
    assert "input_split_axes['target']=True" in msg


def test_input_split_axes_must_be_a_dict() -> None:
    with pytest.raises(TensorSplitError, match=r"input_split_axes=\[1\]: must be a dict"):
        StepSpec.from_function(f_plain, input_split_axes=[1])


def test_var_keyword_function_accepts_any_name_and_var_names() -> None:
    spec = StepSpec.from_function(f_var, ["mask", "extra"], {"labels": 1, "options": 2})
    assert spec.non_split_inputs == {"mask", "extra"}
    assert spec.axis_of(("labels", "options")) == 1
    assert spec.axis_of(("other", "options")) == 2
    # without **kwargs a name that is not a parameter is an error, but *args's name is valid
    def g(model, *rest):  # type: ignore[no-untyped-def]
        return None

    assert StepSpec.from_function(g, ["rest"]).non_split_inputs == {"rest"}
    with pytest.raises(TensorSplitError, match="'mask' is not an argument of"):
        StepSpec.from_function(g, ["mask"])


def test_name_in_both_options_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="smp.step"):
        spec = StepSpec.from_function(f_plain, ["data"], {"data": 1})
    assert not spec.is_split(("data",))
    assert "'data' is in both non_split_inputs and input_split_axes" in caplog.text


def test_function_without_signature_takes_anything() -> None:
    spec = StepSpec.from_function(max)  # builtins have no introspectable signature
    assert (spec.var_positional, spec.var_keyword) == ("args", "kwargs")
    parts = split_arguments(spec, (Arr.arange(4),), {}, 2, OPS)
    assert parts[1][0][0] == Arr([2, 3])


def test_call_is_checked_against_the_signature() -> None:
    spec = StepSpec.from_function(f_plain)
    with pytest.raises(TypeError, match=r"f_plain\(\): missing a required argument: 'target'"):
        split_arguments(spec, (1, Arr.arange(2)), {}, 2, OPS)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        split_arguments(spec, (1, 2, 3), {"bogus": 1}, 2, OPS)


@pytest.mark.parametrize("n", [0, -1, 1.5, True, "2"])
def test_num_microbatches_must_be_a_positive_int(n: Any) -> None:
    with pytest.raises(TensorSplitError, match="num_microbatches"):
        split(f_plain, (1, 2, 3), n=n)


# ----------------------------------------------------------------------------------------------
# Rule 4: tensors


@pytest.mark.parametrize("n", [1, 2, 3, 6])
def test_tensor_is_cut_into_equal_parts_along_axis_0(n: int) -> None:
    x = Arr.arange(6, 2)
    parts = split(f_plain, (None, x, None), n=n)
    assert len(parts) == n
    k = 6 // n
    for mb, (args, kwargs) in enumerate(parts):
        assert kwargs == {}
        assert args[1] == Arr(x.data[mb * k:(mb + 1) * k])


def test_input_split_axes_chooses_the_axis() -> None:
    x = Arr.arange(2, 4)
    parts = split(f_plain, (None, x, x), input_split_axes={"data": 1, "target": -1})
    assert parts[0][0][1] == Arr([[0, 1], [4, 5]])
    assert parts[1][0][1] == Arr([[2, 3], [6, 7]])
    assert parts[1][0][2] == parts[1][0][1]


def test_indivisible_tensor_raises_with_name_size_count_and_fix() -> None:
    with pytest.raises(TensorSplitError) as e:
        split(f_plain, (None, {"ids": Arr.arange(10)}, None), n=4)
    msg = str(e.value)
    assert "argument data['ids']" in msg and "f_plain" in msg
    assert "its size along axis 0 is 10" in msg and "not divisible by 4" in msg
    assert "drop_last=True" in msg and "non_split_inputs" in msg


def test_tensor_without_the_axis_raises() -> None:
    with pytest.raises(TensorSplitError, match=r"cannot split argument target along axis 1") as e:
        split(f_plain, (None, None, Arr.arange(4)), input_split_axes={"target": 1})
    assert "input_split_axes" in str(e.value)
    with pytest.raises(TensorSplitError, match="along axis 0"):
        split(f_plain, (None, None, Arr(7)))  # a 0-d "tensor"


def test_keyword_arguments_split_too() -> None:
    parts = split(f_var, (None, None), {"scale": Arr.arange(4), "mask": Arr.arange(2, 2)},
                  non_split_inputs=["mask"])
    assert parts[0][1]["scale"] == Arr([0, 1]) and parts[1][1]["scale"] == Arr([2, 3])
    assert parts[0][1]["mask"] == Arr.arange(2, 2)


def test_var_positional_arguments_follow_the_star_name() -> None:
    whole = Arr.arange(2)
    parts = split(f_var, (None, Arr.arange(4), whole, Arr.arange(4)), non_split_inputs=["extra"])
    assert parts[1][0] == (None, Arr([2, 3]), whole, Arr.arange(4))
    with pytest.raises(TensorSplitError, match=r"argument extra\[1\] into 4"):
        split(f_var, (None, Arr.arange(4), Arr.arange(4), Arr.arange(6)), n=4)


# ----------------------------------------------------------------------------------------------
# Rule 3: non_split_inputs; rule 5: everything else


def test_non_split_argument_is_the_same_object_in_every_microbatch() -> None:
    x = Arr.arange(4)
    batch = {"x": x, "n": [1, 2]}
    parts = split(f_plain, (None, batch, x), non_split_inputs=["data", "target"])
    for args, _ in parts:
        assert args[1] is batch and args[2] is x


def test_other_values_pass_unchanged_and_unchanged_containers_keep_identity() -> None:
    cfg = {"lr": 0.1, "names": ["a", "b"], "fn": len}
    model = QuietThing()
    parts = split(f_plain, (model, cfg, (3, "s", None)))
    for args, _ in parts:
        assert args[0] is model and args[1] is cfg and args[2] == (3, "s", None)


def test_opaque_object_warns_once_with_the_argument_name(caplog: pytest.LogCaptureFixture) -> None:
    spec = StepSpec.from_function(f_plain)
    thing = Opaque()
    with caplog.at_level(logging.WARNING, logger="smp.step"):
        for _ in range(3):
            parts = split_arguments(spec, (None, [thing, thing], None), {}, 2, OPS)
    assert parts[1][0][1][0] is thing
    records = [r for r in caplog.records if "passed unchanged" in r.getMessage()]
    assert len(records) == 1
    msg = records[0].getMessage()
    assert "argument 'data' is a Opaque" in msg and "smp_slice" in msg and "non_split_inputs" in msg
    assert "probably a bug" not in msg


def test_no_warning_for_primitives_callables_quiet_objects_and_non_split(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="smp.step"):
        split(f_plain, (QuietThing(), [1, 2.0, "s", b"b", None, True, 1j, print, Opaque], Opaque()),
              non_split_inputs=["target"])
    assert caplog.text == ""


def test_no_warning_for_self_of_a_step_method(caplog: pytest.LogCaptureFixture) -> None:
    class Trainer:
        def train_step(self, x):  # type: ignore[no-untyped-def]
            return x

    trainer = Trainer()
    with caplog.at_level(logging.WARNING, logger="smp.step"):
        parts = split(Trainer.train_step, (trainer, Arr.arange(2)))
    assert parts[1][0] == (trainer, Arr([1])) and caplog.text == ""


def test_probable_bug_hint_is_appended(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="smp.step"):
        split(f_plain, (None, Loader(), None))
    assert "This is probably a bug: loaders are not split; pass the batch" in caplog.text


# ----------------------------------------------------------------------------------------------
# Rules 1 and 2: smp_slice and StepOutputs


class Sliceable:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def smp_slice(self, num_mb: int, mb: int, axis: int) -> str:
        self.calls.append((num_mb, mb, axis))
        return f"part {mb}/{num_mb} axis {axis}"


def test_smp_slice_is_called_per_microbatch_with_the_axis() -> None:
    s = Sliceable()
    parts = split(f_plain, (None, None, [s]), n=3, input_split_axes={"target": 2})
    assert s.calls == [(3, 0, 2), (3, 1, 2), (3, 2, 2)]
    assert [a[2][0] for a, _ in parts] == [f"part {m}/3 axis 2" for m in range(3)]


def test_smp_slice_wins_even_for_non_split_arguments() -> None:
    # SMP v1's rule order: smp_slice (1) and StepOutput unpacking (2) come before non_split_inputs (3).
    s = Sliceable()
    parts = split(f_plain, (None, s, None), non_split_inputs=["data"])
    assert [a[1] for a, _ in parts] == ["part 0/2 axis 0", "part 1/2 axis 0"]


def test_a_class_with_smp_slice_is_not_called() -> None:
    parts = split(f_plain, (None, Sliceable, None))
    assert parts[0][0][1] is Sliceable and parts[1][0][1] is Sliceable


def test_step_output_gives_each_microbatch_its_own_output_even_when_not_split() -> None:
    prev = FakeStepOutput([Arr([1]), Arr([2]), Arr([3])])
    parts = split(f_plain, (None, {"h": prev}, prev), n=3, non_split_inputs=["target"])
    assert [a[1]["h"] for a, _ in parts] == prev.outputs
    assert [a[2] for a, _ in parts] == prev.outputs


def test_step_output_with_another_microbatch_count_raises() -> None:
    prev = FakeStepOutput([Arr([1]), Arr([2])])
    with pytest.raises(TensorSplitError, match=r"argument data is a StepOutput with 2 output\(s\), but this step "
                                               r"runs 4 microbatch\(es\)"):
        split(f_plain, (None, prev, None), n=4)


# ----------------------------------------------------------------------------------------------
# Nested structures keep their types


Pair = namedtuple("Pair", ["a", "b"])


class Batch(NamedTuple):
    x: Any
    y: Any


class Encoding(UserDict[str, Any]):
    """Like HF's BatchEncoding: a UserDict with attributes of its own."""

    def __init__(self, data: dict[str, Any], tag: str) -> None:
        super().__init__(data)
        self.tag = tag


class Tagged(list[Any]):
    def __init__(self, items: list[Any], tag: str) -> None:
        super().__init__(items)
        self.tag = tag


class Shape(tuple[Any, ...]):
    pass


def test_nested_containers_are_rebuilt_with_their_types() -> None:
    x = Arr.arange(4)
    dd: defaultdict[str, Any] = defaultdict(list, {"x": x})
    data = {
        "pair": Pair(x, 5),
        "batch": Batch(x=[x, (x, "k")], y=OrderedDict([("z", x), ("w", 1)])),
        "dd": dd,
        "enc": Encoding({"ids": x}, tag="t"),
        "tagged": Tagged([x, 1], tag="u"),
        "shape": Shape((x, 2)),
        "proxy": MappingProxyType({"x": x}),
        "set": frozenset([x]),
    }
    parts = split(f_plain, (None, data, None))
    for mb, (args, _) in enumerate(parts):
        d = args[1]
        half = Arr([2 * mb, 2 * mb + 1])
        assert type(d["pair"]) is Pair and d["pair"] == Pair(half, 5)
        assert type(d["batch"]) is Batch and d["batch"].x == [half, (half, "k")]
        assert type(d["batch"].y) is OrderedDict and list(d["batch"].y.items()) == [("z", half), ("w", 1)]
        assert type(d["dd"]) is defaultdict and d["dd"].default_factory is list and d["dd"]["x"] == half
        assert type(d["enc"]) is Encoding and d["enc"].tag == "t" and d["enc"]["ids"] == half
        assert type(d["tagged"]) is Tagged and d["tagged"].tag == "u" and list(d["tagged"]) == [half, 1]
        assert type(d["shape"]) is Shape and tuple(d["shape"]) == (half, 2)
        assert type(d["proxy"]) is MappingProxyType and d["proxy"]["x"] == half
        assert type(d["set"]) is frozenset and list(d["set"]) == [half]
    assert dd["x"] is x and data["enc"]["ids"] is x  # the caller's containers are untouched


def test_only_changed_branches_are_copied() -> None:
    x = Arr.arange(2)
    const = [1, 2, 3]
    parts = split(f_plain, (None, {"x": x, "const": const}, None))
    assert parts[0][0][1]["const"] is const and parts[1][0][1]["const"] is const


def test_error_path_names_the_nested_position() -> None:
    with pytest.raises(TensorSplitError, match=r"argument data\['b'\]\.y\[1\] into 2"):
        split(f_plain, (None, {"b": Batch(x=1, y=[Arr.arange(2), Arr.arange(3)])}, None))


# ----------------------------------------------------------------------------------------------
# Aggregation


def test_no_microbatches_give_none() -> None:
    assert aggregate_outputs([], OPS, FakeStepOutput) is None


def test_tensor_leaves_become_step_outputs_and_others_lists() -> None:
    a, b, c = Arr([1]), Arr([2]), Arr([3])
    out = aggregate_outputs([(a, 0.5, None, "s"), (b, 0.25, None, "t"), (c, 1.0, None, "u")], OPS, FakeStepOutput)
    assert type(out) is tuple and len(out) == 4
    assert isinstance(out[0], FakeStepOutput) and out[0].outputs == [a, b, c]
    assert out[1:] == ([0.5, 0.25, 1.0], [None, None, None], ["s", "t", "u"])


def test_single_tensor_return() -> None:
    out = aggregate_outputs([Arr([1]), Arr([2])], OPS, FakeStepOutput)
    assert isinstance(out, FakeStepOutput) and out.outputs == [Arr([1]), Arr([2])]


def test_nested_outputs_keep_structure_and_types() -> None:
    def result(mb: int) -> Any:
        return {"loss": Arr([mb]), "stats": Batch(x=[Arr([mb]), mb], y=OrderedDict(acc=mb / 10)), "n": {mb}}

    out = aggregate_outputs([result(0), result(1)], OPS, FakeStepOutput)
    assert list(out) == ["loss", "stats", "n"]
    assert out["loss"].outputs == [Arr([0]), Arr([1])]
    assert type(out["stats"]) is Batch
    assert out["stats"].x[0].outputs == [Arr([0]), Arr([1])] and out["stats"].x[1] == [0, 1]
    assert type(out["stats"].y) is OrderedDict and out["stats"].y["acc"] == [0.0, 0.1]
    assert out["n"] == [{0}, {1}]  # a set is a leaf


def test_dict_key_order_follows_microbatch_0() -> None:
    out = aggregate_outputs([{"b": 1, "a": 2}, {"a": 3, "b": 4}], OPS, FakeStepOutput)
    assert list(out.items()) == [("b", [1, 4]), ("a", [2, 3])]


@pytest.mark.parametrize(("results", "mb", "path", "expected", "got"), [
    ([{"a": 1}, {"a": 1}, {"b": 1}], 2, "output", "a dict with keys ['a']", "a dict with keys ['b']"),
    ([(Arr([1]), 2), (Arr([1]),)], 1, "output", "a tuple of length 2", "a tuple of length 1"),
    ([(Arr([1]), 2), [Arr([1]), 2]], 1, "output", "a tuple of length 2", "a list of length 2"),
    ([{"l": Arr([1])}, {"l": None}], 1, "output['l']", "a tensor", "a NoneType"),
    ([{"l": None}, {"l": Arr([1])}], 1, "output['l']", "a NoneType", "a Arr"),
    ([Batch(1, [2]), Batch(1, 2)], 1, "output.y", "a list of length 1", "a int"),
    ([0.5, [0.5]], 1, "output", "a float", "a list of length 1"),
])
def test_structure_mismatch_names_microbatch_and_path(results: list[Any], mb: int, path: str, expected: str,
                                                      got: str) -> None:
    with pytest.raises(StepOutputError) as e:
        aggregate_outputs(results, OPS, FakeStepOutput)
    msg = str(e.value)
    assert (f"microbatch {mb} differs from microbatch 0's at {path}: microbatch 0 returned {expected}, "
            f"microbatch {mb} returned {got}.") in msg
    assert "Fix:" in msg


def test_split_then_aggregate_round_trip() -> None:
    x = Arr.arange(4, 2)
    parts = split(f_plain, (None, {"x": x}, None), n=4)
    out = aggregate_outputs([a[1] for a, _ in parts], OPS, FakeStepOutput)
    assert [o.data for o in out["x"].outputs] == [[r] for r in x.data]
