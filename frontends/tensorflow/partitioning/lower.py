"""Lower the traced forward ops of ``call()`` to the core's op graph (`smp.partition.opgraph.OpGraph`).

The input is what the model traced once at the microbatch spec (``tf.compat.v1.wrap_function``):
its ops in program order, Placeholders excluded, and the Keras variable each ``ReadVariableOp``
reads. The output is an `OpGraph` plus the ops left out of it, each with the op whose partition
it follows. What each node carries:

- **cost**: a FLOP estimate: ``2*M*N*K`` for MatMul / BatchMatMul, ``2 * output elements *
  kh*kw*cin`` for Conv2D/3D (``kh*kw`` for depthwise), ``2 * output elements * contracted size``
  for Einsum; every other op costs its output elements (one pass over its result);
- **variables**: bytes of the variable the op touches: a ``ReadVariableOp`` (and any other op
  taking the same resource, e.g. a BatchNorm or dropout-seed ``AssignVariableOp``) carries the
  variable named by ``var_of_read``, so every op using one variable is kept together;
- **layer**: the Keras layer the op belongs to: the first name-scope component after the model's
  whose name, with one ``_\\d+`` call suffix stripped, is a layer name (``net_1/blk_1_2/dense_3_1/
  MatMul`` -> ``blk_1``; ``smp_partition_<i>`` scopes are skipped, they are ignored under
  auto-partitioning). Layer names are the model's layers (``layer_names``, from the model when the
  caller has it) and the components of the variables' paths (``net/blk_1/dense_3/kernel``);
  without the model, a layer that has no variables (Dropout, Flatten) is no group of its own and its
  ops join a neighbour;
- **colocation**: TF colocation constraints other than an op's own name (``op.colocation_groups()``);
- **edges**: every data input from another kept op (bytes = elements x dtype size; shapes are static
  at the microbatch spec), control inputs as 0-byte edges;
- ops using one variable are linked by 0-byte edges from its first user (they are one group);
- a **virtual source** ``SOURCE`` (cost 0) feeding every op that reads a model input, with 0-byte
  edges (the inputs are on every rank), so ``contiguous=True`` sees one connected graph.

Ops that depend on no model input and no variable (``Const``, shape arithmetic on constants,
dropout's seed constants) are not nodes: each follows its first consumer's partition.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from smp.partition.opgraph import OpEdge, OpGraph, OpNode

__all__ = ["SOURCE", "LoweredGraph", "lower_ops", "model_layer_names", "op_cost"]

SOURCE = "(model input)"
_CALL_SUFFIX = re.compile(r"_\d+$")
_MANUAL_SCOPE = re.compile(r"^smp_partition_\d+$")


@dataclass(frozen=True)
class LoweredGraph:
    """The op graph of a traced ``call()`` and how the ops left out of it are placed.

    Attributes:
        graph: the core op graph (``SOURCE`` included).
        follows: op left out of the graph -> the op whose partition it takes (None: partition 0).
        layers: the layer scope of each op in the graph that has one.
        depth: how many layer-scope levels the layer names use (1: top-level layers of the model).
    """

    graph: OpGraph
    follows: Mapping[str, str | None]
    layers: Mapping[str, str]
    depth: int


def _elements(shape: tf.TensorShape) -> int:
    if shape.rank is None:
        return 1
    return int(np.prod([d if d is not None else 1 for d in shape.as_list()], dtype=np.int64))


def _bytes(t: tf.Tensor) -> int:
    try:
        size = t.dtype.size
    except (TypeError, ValueError):
        size = 0
    if t.dtype in (tf.resource, tf.variant, tf.string):
        size = 0
    return _elements(t.shape) * int(size)


def _dims(t: tf.Tensor) -> list[int]:
    return [d if d is not None else 1 for d in t.shape.as_list()] if t.shape.rank is not None else []


def _attr(op: tf.Operation, name: str, default: Any) -> Any:
    try:
        return op.get_attr(name)
    except (ValueError, TypeError):
        return default


def op_cost(op: tf.Operation) -> float:
    """The FLOP estimate of one op (see the module docstring).

    Example:
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     _ = tf.matmul(tf.zeros((20, 32)), tf.zeros((32, 16)), name="mm")
        >>> op_cost(g.get_operation_by_name("mm"))  # 2 * 20 * 16 * 32
        20480.0
    """
    out = float(sum(_elements(t.shape) for t in op.outputs))
    if op.type == "MatMul" and len(op.inputs) >= 2:
        a = _dims(op.inputs[0])
        if len(a) == 2:
            return 2.0 * out * (a[0] if _attr(op, "transpose_a", False) else a[1])
    if op.type in ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3") and len(op.inputs) >= 2:
        a = _dims(op.inputs[0])
        if len(a) >= 2:
            return 2.0 * out * (a[-2] if _attr(op, "adj_x", False) else a[-1])
    if op.type in ("Conv2D", "Conv3D", "Conv1D") and len(op.inputs) >= 2:
        f = _dims(op.inputs[1])
        if f:
            return 2.0 * out * float(np.prod(f[:-1]))
    if op.type == "DepthwiseConv2dNative" and len(op.inputs) >= 2:
        f = _dims(op.inputs[1])
        if len(f) == 4:
            return 2.0 * out * f[0] * f[1]
    if op.type == "Einsum":
        equation = _attr(op, "equation", b"")
        equation = equation.decode() if isinstance(equation, bytes) else str(equation)
        if "->" in equation and "." not in equation:
            lhs, rhs = equation.split("->")
            sizes: dict[str, int] = {}
            for spec, t in zip(lhs.split(","), op.inputs, strict=False):
                for letter, d in zip(spec, _dims(t), strict=False):
                    sizes[letter] = d
            contracted = [sizes[c] for c in sizes if c not in rhs]
            return 2.0 * out * float(np.prod(contracted)) if contracted else out
    return out


def _layer_names(var_of_read: Mapping[str, Any]) -> set[str]:
    names: set[str] = set()
    for var in var_of_read.values():
        # "net/blk_1/dense_3/kernel" or, for a model built symbolically, "blk_1/dense_3/kernel": every
        # component but the variable's own name (the model's name never matches a scope below it).
        names.update(_var_name(var).split("/")[:-1])
    return names


def _var_name(var: Any) -> str:
    return str(getattr(var, "path", None) or getattr(var, "name", var))


def _var_bytes(var: Any) -> tuple[int, int]:
    shape = tf.TensorShape(var.shape)
    return _elements(shape) * tf.as_dtype(var.dtype).size, _elements(shape)


def _layer_of(op_name: str, names: set[str], depth: int) -> str | None:
    found: list[str] = []
    for part in op_name.split("/")[1:-1]:
        if _MANUAL_SCOPE.match(part):
            continue
        stripped = _CALL_SUFFIX.sub("", part)
        if stripped in names:
            found.append(stripped)
        elif part in names:
            found.append(part)
        else:
            continue
        if len(found) == depth:
            break
    return "/".join(found) if found else None


def model_layer_names(model: Any) -> set[str]:
    """The names of every layer inside a Keras model (nested ones included; not the model's own)."""
    flatten = getattr(model, "_flatten_layers", None)  # Keras 3 (private, stable); public .layers is one level
    if callable(flatten):
        return {layer.name for layer in flatten(include_self=False, recursive=True)}
    return {layer.name for layer in getattr(model, "layers", ())}


def lower_ops(ops: Sequence[tf.Operation], var_of_read: Mapping[str, Any], min_layers: int = 1,
              layer_names: set[str] | None = None) -> LoweredGraph:
    """Build the op graph of a traced ``call()``.

    Args:
        ops: the forward ops in program order, Placeholders excluded.
        var_of_read: ``ReadVariableOp`` name -> the Keras (or tf) variable it reads.
        min_layers: the layer scopes go one level deeper (up to 3) while the model has fewer
            distinct layers than this (a model whose blocks sit in one ``keras.Sequential``).
        layer_names: the model's layer names (`model_layer_names`), when the caller has the model.

    Returns:
        The `LoweredGraph`.
    """
    names = {op.name for op in ops}
    index = {op.name: i for i, op in enumerate(ops)}
    # Which variable each resource placeholder is (every op touching that resource carries it).
    var_of_resource: dict[str, Any] = {}
    for op in ops:
        if op.name in var_of_read and op.inputs:
            var_of_resource[op.inputs[0].name] = var_of_read[op.name]

    def resource_inputs(op: tf.Operation) -> list[tf.Tensor]:
        return [t for t in op.inputs if t.dtype == tf.resource and t.op.name not in names]

    # Live ops depend on a model input or a variable; the others are constants to recompute.
    live: set[str] = set()
    for op in ops:
        if (op.name in var_of_read or resource_inputs(op)
                or any(t.op.type == "Placeholder" and t.dtype != tf.resource for t in op.inputs)
                or any(t.op.name in live for t in op.inputs) or any(c.name in live for c in op.control_inputs)):
            live.add(op.name)
    layer_names = _layer_names(var_of_read) | set(layer_names or ())
    depth, layers = 1, {}
    for depth in (1, 2, 3):
        layers = {op.name: layer for op in ops if op.name in live
                  and (layer := _layer_of(op.name, layer_names, depth)) is not None}
        if len(set(layers.values())) >= min_layers:
            break
    nodes = [OpNode(SOURCE, 0.0, layer=None)]
    edges: list[OpEdge] = []
    elements: dict[str, int] = {}
    first_user: dict[str, str] = {}
    for op in ops:
        if op.name not in live:
            continue
        variables: dict[str, int] = {}
        for t in resource_inputs(op):
            # Ops using one variable are one group; a 0-byte edge from its first user keeps them
            # connected too (a dropout seed's read-add-assign has no data edge to the seed's reads).
            first = first_user.setdefault(t.name, op.name)
            if first != op.name:
                edges.append(OpEdge(first, op.name, 0, tensor=f"{t.name}->{op.name}"))
            var = var_of_resource.get(t.name)
            if var is None:
                variables[f"resource:{t.name}"] = 0
            else:
                size, count = _var_bytes(var)
                variables[_var_name(var)] = size
                elements[_var_name(var)] = count
        if op.name in var_of_read and not variables:
            size, count = _var_bytes(var_of_read[op.name])
            variables[_var_name(var_of_read[op.name])] = size
            elements[_var_name(var_of_read[op.name])] = count
        groups = [g.decode() if isinstance(g, bytes) else str(g) for g in op.colocation_groups()]
        others = sorted(g for g in groups if g != f"loc:@{op.name}")
        nodes.append(OpNode(op.name, op_cost(op), variables, layers.get(op.name), ",".join(others) or None))
        reads_input = False
        for t in op.inputs:
            if t.op.name in live:
                edges.append(OpEdge(t.op.name, op.name, _bytes(t), tensor=t.name))
            elif t.op.type == "Placeholder" and t.dtype != tf.resource:
                reads_input = True
        for c in op.control_inputs:
            if c.name in live:
                edges.append(OpEdge(c.name, op.name, 0, tensor=f"^{c.name}"))
        if reads_input:
            edges.append(OpEdge(SOURCE, op.name, 0, tensor=f"{SOURCE}->{op.name}"))
    # Constants follow their first live consumer (reverse program order settles chains of them).
    follows: dict[str, str | None] = {}
    consumers: dict[str, list[str]] = {op.name: [] for op in ops}
    for op in ops:
        for t in op.inputs:
            if t.op.name in consumers:
                consumers[t.op.name].append(op.name)
        for c in op.control_inputs:
            if c.name in consumers:
                consumers[c.name].append(op.name)
    for op in reversed(ops):
        if op.name in live:
            continue
        target = None
        for user in sorted(consumers[op.name], key=index.__getitem__):
            target = user if user in live else follows.get(user)
            if target is not None:
                break
        follows[op.name] = target
    return LoweredGraph(OpGraph(nodes, edges, variable_elements=elements), follows, layers, depth)
