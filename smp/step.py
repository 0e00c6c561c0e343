"""Microbatches of ``smp.step``: split the arguments, aggregate the return values (framework-free).

A step function runs once per microbatch. Before the first run its arguments are split; after the
last run the per-microbatch return values are gathered into one structure (reference section 3.2).
Framework operations reach this module through the `StepOps` protocol (``smp.torch`` implements it
with torch tensors), so the rules live in one place for every frontend.

Splitting, per leaf of each argument (lists, tuples, namedtuples, dicts and sets are walked and
rebuilt with their own types), first rule that applies wins:

1. the object has ``smp_slice(num_microbatches, microbatch_index, axis)``: call it;
2. it is a StepOutput of an earlier step: microbatch ``m`` gets ``outputs[m]``
   (rules 1 and 2 apply even when the argument is listed in ``non_split_inputs``, as in SMP v1);
3. the argument is listed in ``non_split_inputs``: passed unchanged;
4. it is a tensor: narrowed into equal parts along the argument's axis (``input_split_axes``,
   default 0); a size not divisible by the number of microbatches is a `TensorSplitError`;
5. anything else is passed unchanged to every microbatch (a warning, once, for objects that are
   neither primitive nor callable nor known to be harmless, nor the ``self``/``cls`` argument).

Worked example, 2 microbatches, ``def train_step(model, batch, scale)`` called as
``train_step(model, {"x": X[8, 3], "y": Y[8]}, 0.5)`` with ``non_split_inputs=["model"]``::

    microbatch 0: (model, {"x": X[0:4], "y": Y[0:4]}, 0.5)
    microbatch 1: (model, {"x": X[4:8], "y": Y[4:8]}, 0.5)

Aggregation: microbatch 0's return value is the template. If the step returns
``(loss_t, {"acc": 0.75})`` on each microbatch, the caller receives
``(StepOutput([loss_0, loss_1]), {"acc": [0.75, 0.5]})``: tensors become StepOutputs, every other
leaf a plain list of the per-microbatch values; zero microbatches give None.
"""

from __future__ import annotations

import enum
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from smp.errors import StepOutputError, TensorSplitError
from smp.structure import is_namedtuple, rebuild_mapping, rebuild_sequence

__all__ = ["StepOps", "StepSpec", "aggregate_outputs", "split_arguments"]

logger = logging.getLogger("smp.step")

_PRIMITIVES = (type(None), bool, int, float, complex, str, bytes, enum.Enum)
_SETS = (set, frozenset)


class StepOps(Protocol):
    """What the step core needs from a framework. ``smp.torch`` implements it as ``TorchStepOps``."""

    def is_tensor(self, x: object) -> bool:
        """True for the framework's tensor type (these are narrowed and become StepOutputs)."""
        ...

    def narrow(self, tensor: Any, dim: int, start: int, length: int) -> Any:
        """``tensor[start:start+length]`` along ``dim``, as a view where the framework can."""
        ...

    def dim_size(self, tensor: Any, dim: int) -> int:
        """The size of ``tensor`` along ``dim``; may raise IndexError for a dim it does not have."""
        ...

    def is_step_output(self, x: object) -> bool:
        """True for the frontend's StepOutput (an object with ``.outputs``, one per microbatch)."""
        ...

    def quiet(self, x: object) -> bool:
        """True for objects that are routinely passed whole into a step (models, optimizers, devices):
        no "passed unchanged" warning for them."""
        ...

    def probable_bug(self, x: object) -> str | None:
        """A sentence explaining why passing ``x`` into a step is probably a mistake (data loaders,
        datasets, samplers), appended to the warning; None when there is nothing to add."""
        ...


def _fallback_signature() -> inspect.Signature:
    return inspect.Signature([
        inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
        inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
    ])


@dataclass(frozen=True)
class StepSpec:
    """How one step function's arguments are split: its signature and the user's split options.

    Build it with `StepSpec.from_function`, once per decorated function.

    Attributes:
        function_name: the function's qualified name, for messages.
        signature: the function's signature (``(*args, **kwargs)`` when Python cannot tell).
        non_split_inputs: argument names passed whole to every microbatch.
        input_split_axes: argument name -> the axis its tensors are split along (default 0).

    Example:
        >>> def train_step(model, data, mask, *extra, **options): ...
        >>> spec = StepSpec.from_function(train_step, ["model"], {"mask": 1})
        >>> spec.names_of(0, None), spec.names_of(4, None), spec.names_of(None, "lr")
        (('model',), ('extra',), ('lr', 'options'))
        >>> spec.is_split(("model",)), spec.axis_of(("mask",)), spec.axis_of(("data",))
        (False, 1, 0)
    """

    function_name: str
    signature: inspect.Signature
    non_split_inputs: frozenset[str] = frozenset()
    input_split_axes: Mapping[str, int] = field(default_factory=dict)
    # (argument name, type name) pairs already warned about; mutable on purpose (warn once).
    _warned: set[tuple[str, str]] = field(default_factory=set, repr=False, compare=False)

    @classmethod
    def from_function(
        cls,
        func: Callable[..., Any],
        non_split_inputs: object = None,
        input_split_axes: object = None,
    ) -> StepSpec:
        """Validate the split options against ``func``'s signature and build the spec.

        Every problem is collected and raised together as one `TensorSplitError`.
        ``non_split_inputs`` must be a list (a tuple is accepted too) of argument names;
        ``input_split_axes`` a dict of argument name -> int axis. Valid names are the function's
        parameter names, including the names of ``*args`` and ``**kwargs``; when the function takes
        ``**kwargs``, any name is accepted, since a keyword argument of that name may arrive
        through it.

        Example:
            >>> StepSpec.from_function(lambda model, x: None, non_split_inputs="model")
            Traceback (most recent call last):
            ...
            smp.errors.TensorSplitError: invalid smp.step options for <lambda> (1 problem(s)):
              - non_split_inputs='model': must be a list of argument names of <lambda>. Fix: non_split_inputs=['model']
        """
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
        try:
            signature = inspect.signature(func)
        except (TypeError, ValueError):
            signature = _fallback_signature()
        spec = cls(function_name=name, signature=signature)
        valid = spec.parameter_names
        accepts_any = spec.var_keyword is not None
        problems: list[str] = []

        def check_name(option: str, key: object) -> bool:
            if not isinstance(key, str):
                problems.append(f"{option}: entry {key!r} is a {type(key).__name__}; names must be str. "
                                f"Fix: use the argument's name as a string, one of {sorted(valid)}")
                return False
            if key not in valid and not accepts_any:
                problems.append(f"{option}: {key!r} is not an argument of {name}; its arguments are "
                                f"{sorted(valid)}. Fix: use one of those names")
                return False
            return True

        non_split: set[str] = set()
        if non_split_inputs is not None:
            if not isinstance(non_split_inputs, (list, tuple)):
                example = [non_split_inputs] if isinstance(non_split_inputs, str) else ["model"]
                problems.append(f"non_split_inputs={non_split_inputs!r}: must be a list of argument names of "
                                f"{name}. Fix: non_split_inputs={example!r}")
            else:
                non_split = {k for k in non_split_inputs if check_name("non_split_inputs", k)}
        axes: dict[str, int] = {}
        if input_split_axes is not None:
            if not isinstance(input_split_axes, Mapping):
                problems.append(f"input_split_axes={input_split_axes!r}: must be a dict of argument name -> "
                                f"axis. Fix: e.g. input_split_axes={{'data': 1}}")
            else:
                for key, axis in input_split_axes.items():
                    if not check_name("input_split_axes", key):
                        continue
                    if isinstance(axis, bool) or not isinstance(axis, int):
                        problems.append(f"input_split_axes[{key!r}]={axis!r}: the axis must be an int. "
                                        f"Fix: e.g. input_split_axes={{{key!r}: 1}}")
                        continue
                    axes[key] = axis
        if problems:
            lines = [f"invalid smp.step options for {name} ({len(problems)} problem(s)):"]
            lines += [f"  - {p}" for p in problems]
            raise TensorSplitError("\n".join(lines))
        for key in sorted(non_split & axes.keys()):
            logger.warning("smp.step(%s): %r is in both non_split_inputs and input_split_axes; it is not "
                           "split, so its axis %d is ignored.", name, key, axes[key])
        return cls(function_name=name, signature=signature, non_split_inputs=frozenset(non_split),
                   input_split_axes=axes)

    @property
    def positional_names(self) -> tuple[str, ...]:
        """Names of the parameters that can be given positionally, in order (without ``*args``)."""
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        return tuple(p.name for p in self.signature.parameters.values() if p.kind in kinds)

    @property
    def var_positional(self) -> str | None:
        """The name of the ``*args`` parameter, if any."""
        return next((p.name for p in self.signature.parameters.values()
                     if p.kind is inspect.Parameter.VAR_POSITIONAL), None)

    @property
    def var_keyword(self) -> str | None:
        """The name of the ``**kwargs`` parameter, if any."""
        return next((p.name for p in self.signature.parameters.values()
                     if p.kind is inspect.Parameter.VAR_KEYWORD), None)

    @property
    def parameter_names(self) -> frozenset[str]:
        """Every parameter name, ``*args`` and ``**kwargs`` included."""
        return frozenset(self.signature.parameters)

    def names_of(self, position: int | None, keyword: str | None) -> tuple[str, ...]:
        """The names an argument answers to in ``non_split_inputs`` / ``input_split_axes``.

        A positional argument beyond the named ones answers to the ``*args`` name; a keyword
        argument that lands in ``**kwargs`` answers to its own name first, then to the ``**kwargs``
        name.
        """
        if keyword is not None:
            param = self.signature.parameters.get(keyword)
            named = param is not None and param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                          inspect.Parameter.KEYWORD_ONLY)
            if named or self.var_keyword is None:
                return (keyword,)
            return (keyword, self.var_keyword)
        if position is None:
            raise ValueError("names_of needs a position or a keyword")
        positional = self.positional_names
        if position < len(positional):
            return (positional[position],)
        return (self.var_positional or f"<positional {position}>",)

    def is_split(self, names: tuple[str, ...]) -> bool:
        """False when any of ``names`` is in ``non_split_inputs``."""
        return not any(n in self.non_split_inputs for n in names)

    def axis_of(self, names: tuple[str, ...]) -> int:
        """The split axis of the first of ``names`` found in ``input_split_axes``, else 0."""
        return next((self.input_split_axes[n] for n in names if n in self.input_split_axes), 0)

    def check_call(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Raise the TypeError the call itself would raise (missing or unexpected arguments), before
        any splitting happens."""
        try:
            self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.function_name}(): {e}") from None

    def warn_once(self, name: str, x: object, ops: StepOps) -> None:
        """Rule 5's one-time warning for an argument passed unchanged to every microbatch."""
        key = (name, f"{type(x).__module__}.{type(x).__qualname__}")
        if key in self._warned:
            return
        self._warned.add(key)
        message = (f"smp.step({self.function_name}): argument {name!r} is a {type(x).__qualname__}, which is "
                   f"passed unchanged to every microbatch. If it holds per-sample data, implement "
                   f"smp_slice(num_microbatches, microbatch_index, axis) on it or pass its tensors instead; "
                   f"list {name!r} in non_split_inputs to silence this warning.")
        hint = ops.probable_bug(x)
        if hint:
            message += f" This is probably a bug: {hint}"
        logger.warning(message)


# ----------------------------------------------------------------------------------------------
# Paths of nested values (containers are rebuilt by smp.structure)


def _child_path(path: str, key: object, template: object) -> str:
    if is_namedtuple(template):
        return f"{path}.{type(template)._fields[key]}"  # type: ignore[attr-defined]
    return f"{path}[{key!r}]"


# ----------------------------------------------------------------------------------------------
# Splitting


@dataclass
class _Splitter:
    """Splits one argument. Results are a list with one value per microbatch, or None when the value
    is the same object in every microbatch (so unchanged containers keep their identity)."""

    spec: StepSpec
    ops: StepOps
    num_microbatches: int
    name: str
    split: bool
    axis: int

    def walk(self, x: Any, path: str) -> list[Any] | None:
        n = self.num_microbatches
        smp_slice = None if isinstance(x, type) else getattr(x, "smp_slice", None)
        if callable(smp_slice):
            return [smp_slice(n, mb, self.axis) for mb in range(n)]
        if self.ops.is_step_output(x):
            return self._unpack_step_output(x, path)
        if isinstance(x, (list, tuple)):
            children = [self.walk(c, _child_path(path, i, x)) for i, c in enumerate(x)]
            if all(c is None for c in children):
                return None
            return [rebuild_sequence(x, [x[i] if c is None else c[mb] for i, c in enumerate(children)])
                    for mb in range(n)]
        if isinstance(x, Mapping):
            kids = {k: self.walk(v, _child_path(path, k, x)) for k, v in x.items()}
            if all(c is None for c in kids.values()):
                return None
            return [rebuild_mapping(x, {k: x[k] if c is None else c[mb] for k, c in kids.items()})
                    for mb in range(n)]
        if isinstance(x, _SETS):
            members = list(x)
            children = [self.walk(c, f"{path}{{...}}") for c in members]
            if all(c is None for c in children):
                return None
            return [type(x)(members[i] if c is None else c[mb] for i, c in enumerate(children))
                    for mb in range(n)]
        if not self.split:
            return None
        if self.ops.is_tensor(x):
            return self._narrow(x, path)
        # ``self``/``cls`` of a step method are the caller's own object, not data: no warning.
        if (not isinstance(x, _PRIMITIVES) and not callable(x) and self.name not in ("self", "cls")
                and not self.ops.quiet(x)):
            self.spec.warn_once(self.name, x, self.ops)
        return None

    def _unpack_step_output(self, x: Any, path: str) -> list[Any]:
        outputs = list(x.outputs)
        if len(outputs) != self.num_microbatches:
            raise TensorSplitError(
                f"smp.step({self.spec.function_name}): argument {path} is a StepOutput with {len(outputs)} "
                f"output(s), but this step runs {self.num_microbatches} microbatch(es). Rule: a StepOutput "
                f"passed into a step gives microbatch m its outputs[m]. Fix: run both steps with the same "
                f"number of microbatches, or pass a reduced value (.concat(), .reduce_mean()) instead.")
        return outputs

    def _narrow(self, x: Any, path: str) -> list[Any]:
        n = self.num_microbatches
        try:
            size = self.ops.dim_size(x, self.axis)
        except (IndexError, ValueError, RuntimeError) as e:
            raise TensorSplitError(
                f"smp.step({self.spec.function_name}): cannot split argument {path} along axis {self.axis}: "
                f"{e}. Rule: tensors of split arguments are narrowed along their axis (input_split_axes, "
                f"default 0). Fix: set input_split_axes={{{self.name!r}: <batch axis>}}, or list "
                f"{self.name!r} in non_split_inputs to pass it whole.") from e
        if size % n:
            raise TensorSplitError(
                f"smp.step({self.spec.function_name}): cannot split argument {path} into {n} microbatches: "
                f"its size along axis {self.axis} is {size}, which is not divisible by {n}. Rule: every "
                f"tensor of a split argument is cut into num_microbatches equal parts along its axis. Fix: "
                f"use a batch size divisible by {n} (drop the short last batch: torch "
                f"DataLoader(drop_last=True), tf.data batch(drop_remainder=True)), change the microbatches "
                f"config, or list {self.name!r} in non_split_inputs.")
        k = size // n
        return [self.ops.narrow(x, self.axis, mb * k, k) for mb in range(n)]


def split_arguments(
    spec: StepSpec,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    num_microbatches: int,
    ops: StepOps,
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Split a step call's arguments into one ``(args, kwargs)`` pair per microbatch.

    Applies the rules of the module docstring to every argument. Arguments (and containers) that
    no rule changes are the same objects in every microbatch.

    Args:
        spec: the step function's `StepSpec`.
        args: the positional arguments of the call.
        kwargs: the keyword arguments of the call.
        num_microbatches: how many microbatches (>= 1).
        ops: the framework's `StepOps`.

    Returns:
        ``num_microbatches`` pairs ``(args_mb, kwargs_mb)``; call the function as ``f(*a, **k)``.

    Raises:
        TypeError: the call does not match the function's signature.
        TensorSplitError: a tensor cannot be divided evenly, or a StepOutput argument has a
            different number of microbatches.

    Example:
        >>> import torch
        >>> from smp.torch.step_output import TorchStepOps
        >>> def train_step(model, x): ...
        >>> spec = StepSpec.from_function(train_step, non_split_inputs=["model"])
        >>> parts = split_arguments(spec, ("net", torch.arange(6)), {}, 3, TorchStepOps())
        >>> [a[1].tolist() for a, _ in parts]
        [[0, 1], [2, 3], [4, 5]]
    """
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise TensorSplitError(f"num_microbatches={num_microbatches!r}: must be an int >= 1. "
                               f"Fix: set the microbatches config to 1 or more")
    spec.check_call(args, kwargs)
    n = num_microbatches
    out_args: list[list[Any]] = [[] for _ in range(n)]
    out_kwargs: list[dict[str, Any]] = [{} for _ in range(n)]

    def split_one(value: Any, names: tuple[str, ...], path: str) -> list[Any] | None:
        splitter = _Splitter(spec, ops, n, names[0], spec.is_split(names), spec.axis_of(names))
        return splitter.walk(value, path)

    for i, value in enumerate(args):
        names = spec.names_of(i, None)
        path = names[0] if i < len(spec.positional_names) else f"{names[0]}[{i - len(spec.positional_names)}]"
        parts = split_one(value, names, path)
        for mb in range(n):
            out_args[mb].append(value if parts is None else parts[mb])
    for key, value in kwargs.items():
        parts = split_one(value, spec.names_of(None, key), key)
        for mb in range(n):
            out_kwargs[mb][key] = value if parts is None else parts[mb]
    return [(tuple(out_args[mb]), out_kwargs[mb]) for mb in range(n)]


# ----------------------------------------------------------------------------------------------
# Aggregation


def _mismatch(path: str, mb: int, expected: str, got: object) -> StepOutputError:
    return StepOutputError(
        f"smp.step: the return value of microbatch {mb} differs from microbatch 0's at {path}: microbatch 0 "
        f"returned {expected}, microbatch {mb} returned {got}. Rule: every microbatch must return the same "
        f"nested structure (microbatch 0's is the template; tensors become StepOutputs, other leaves lists). "
        f"Fix: return the same containers, keys and lengths from every microbatch, and a tensor in every "
        f"microbatch where one returns a tensor (e.g. a zero tensor instead of None).")


def _describe(x: object) -> str:
    if isinstance(x, Mapping):
        return f"a {type(x).__qualname__} with keys [{', '.join(map(repr, x))}]"
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__qualname__} of length {len(x)}"
    return f"a {type(x).__qualname__}"


def _aggregate(values: list[Any], path: str, ops: StepOps, make_step_output: Callable[[list[Any]], Any]) -> Any:
    template = values[0]
    if ops.is_tensor(template):
        for mb, v in enumerate(values[1:], 1):
            if not ops.is_tensor(v):
                raise _mismatch(path, mb, "a tensor", _describe(v))
        return make_step_output(list(values))
    if isinstance(template, Mapping):
        for mb, v in enumerate(values[1:], 1):
            if not isinstance(v, Mapping) or set(v.keys()) != set(template.keys()):
                raise _mismatch(path, mb, _describe(template), _describe(v))
        return rebuild_mapping(template, {
            k: _aggregate([v[k] for v in values], _child_path(path, k, template), ops, make_step_output)
            for k in template})
    if isinstance(template, (list, tuple)):
        for mb, v in enumerate(values[1:], 1):
            if type(v) is not type(template) or len(v) != len(template):
                raise _mismatch(path, mb, _describe(template), _describe(v))
        return rebuild_sequence(template, [
            _aggregate([v[i] for v in values], _child_path(path, i, template), ops, make_step_output)
            for i in range(len(template))])
    for mb, v in enumerate(values[1:], 1):
        if ops.is_tensor(v) or isinstance(v, (Mapping, list, tuple)):
            raise _mismatch(path, mb, _describe(template), _describe(v))
    return list(values)


def aggregate_outputs(
    per_mb_results: Sequence[Any],
    ops: StepOps,
    make_step_output: Callable[[list[Any]], Any],
) -> Any:
    """Gather the per-microbatch return values of a step into one structure.

    Microbatch 0's value is the template: lists, tuples (namedtuples included) and dicts are
    rebuilt with their own types; a tensor leaf becomes ``make_step_output([t_mb0, t_mb1, ...])``;
    any other leaf (float, int, None, str, set, ...) becomes the plain list of per-microbatch values.

    Args:
        per_mb_results: the return value of each microbatch, in microbatch order.
        ops: the framework's `StepOps` (only ``is_tensor`` is used).
        make_step_output: builds the frontend's StepOutput from a list of tensors.

    Returns:
        The aggregated structure, or None when there are no microbatches.

    Raises:
        StepOutputError: a microbatch's structure differs from microbatch 0's; the message names the
            microbatch and the path (e.g. ``output[1]['loss']``).

    Example:
        >>> import torch
        >>> from smp.torch.step_output import StepOutput, TorchStepOps
        >>> out = aggregate_outputs([(torch.tensor(1.0), 3), (torch.tensor(3.0), 4)], TorchStepOps(), StepOutput)
        >>> out[0].reduce_mean().item(), out[1]
        (2.0, [3, 4])
    """
    if not per_mb_results:
        return None
    return _aggregate(list(per_mb_results), "output", ops, make_step_output)
