"""One trace of ``DistributedModel.call`` at a microbatch's input spec: the op graph the partitioner cuts.

`trace_call` wraps the model's Keras ``__call__`` in ``tf.compat.v1.wrap_function`` (a graph that
is never run as a whole: the engine prunes one function per stage out of it). The first trace also
builds the model, since Keras creates variables on the first call and lifts them out of the graph.
What comes back (`TracedCall`) names, for every op that touches a variable (a ``ReadVariableOp``,
a BatchNorm ``AssignVariableOp``, a dropout seed update), the index of that variable in
``model.variables``, the key every rank agrees on (raw variable paths differ between processes
when a script builds two models).

Example:
    >>> traced = trace_call(model, (x,), {"training": True}, call=keras.Model.__call__)
    >>> [op.type for op in traced.ops][:3]
    ['ReadVariableOp', 'MatMul', 'ReadVariableOp']
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.tensorflow.core import Variable as KerasTFVariable  # Keras' TF variable (private)
from tensorflow.python.ops import resource_variable_ops

from smp.errors import SMPError

from ..engine.matmul_grad import use_small_batch_gradient

__all__ = ["TracedCall", "initialize_deferred", "input_signature", "trace_call"]

# Ops that are never partitioned: recomputed by every stage that needs them, never sent.
FREE_TYPES = frozenset({"Const", "Placeholder"})
_TENSORS = (tf.Tensor, tf.Variable, np.ndarray, tf.TensorSpec)


@dataclass
class TracedCall:
    """The traced forward of one call signature.

    Attributes:
        wrapped: the ``wrap_function`` result (``.prune`` makes the stage functions).
        inputs: the placeholders of the tensor leaves of the call's arguments, in flat order.
        outputs: the flat output tensors; ``output_structure`` rebuilds the returned structure.
        ops: the forward ops in program order, without Const/Placeholder.
        var_of_op: op name -> index in ``model.variables`` of the variable the op reads or writes.
        var_of_read: ``ReadVariableOp`` name -> its variable (what the auto-partitioner takes).
        deferred: with ``defer_values``: each variable the build created without a value, with its
            initializer, in the order Keras would have initialized them (`initialize_deferred`).
    """

    wrapped: Any
    inputs: list[tf.Tensor]
    outputs: list[tf.Tensor]
    output_structure: Any
    ops: list[tf.Operation]
    var_of_op: dict[str, int]
    var_of_read: dict[str, Any]
    deferred: list[tuple[Any, Any]] = field(default_factory=list)

    @property
    def graph(self) -> tf.Graph:
        return self.wrapped.graph


def input_signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[tf.TensorSpec], Any]:
    """The TensorSpecs of the tensor leaves of ``(args, kwargs)`` and a hashable key of the rest.

    Non-tensor leaves (``training=True``) are part of the key: they are constants of the trace.
    A ``tf.TensorSpec`` leaf stands for a tensor of that spec.
    """
    specs: list[tf.TensorSpec] = []
    key: list[Any] = []
    for leaf in tf.nest.flatten((args, kwargs)):
        if isinstance(leaf, _TENSORS):
            if isinstance(leaf, tf.TensorSpec):
                spec = tf.TensorSpec(leaf.shape, leaf.dtype)
            else:
                t = tf.convert_to_tensor(leaf)
                spec = tf.TensorSpec(t.shape, t.dtype)
            specs.append(spec)
            key.append(("tensor", tuple(spec.shape.as_list()) if spec.shape.rank is not None else None,
                        spec.dtype.name))
        else:
            key.append(("const", repr(leaf)))
    return specs, (tf.nest.map_structure(lambda _: 0, (args, kwargs)).__repr__(), tuple(key))


def _build(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any], flat: list[Any], tensor_pos: list[int],
           specs: list[tf.TensorSpec], defer_values: bool = False) -> list[tuple[Any, Any]]:
    """Create the model's variables before the trace, with Keras' own symbolic build.

    Keras builds a subclassed model on its first call by running ``call()`` on symbolic tensors in
    a stateless scope (nothing is assigned: no BatchNorm update, no seed consumed) and initializes
    the variables when the outermost such scope closes. Inside ``wrap_function`` that scope is not
    the outermost, so the variables stayed uninitialized and the trace would read their
    initializers' values as constants; building first, eagerly, avoids that.

    With ``defer_values`` (a pipeline: each rank will own part of the variables) the variables get
    a handle of their full shape and no value (``UninitializedVariable``): the trace needs only the
    handles, and `initialize_deferred` later gives values to the ones this rank owns. Returns those
    variables with their initializers, in Keras' order (empty when Keras had nothing to defer, e.g.
    a model built before its first step).
    """
    if model.built and all(getattr(v, "_value", True) is not None for v in model.variables):
        return []
    leaves = list(flat)
    for pos, spec in zip(tensor_pos, specs):
        leaves[pos] = keras.KerasTensor(spec.shape.as_list(), spec.dtype.name)
    a, k = tf.nest.pack_sequence_as((args, kwargs), leaves)
    deferred: list[tuple[Any, Any]] = []
    with warnings.catch_warnings(), _values_deferred(deferred, enabled=defer_values):
        # Keras warns that build() "looks like it has unbuilt state": it checks before the symbolic
        # call has built the sublayers; the check below is the one that matters.
        warnings.filterwarnings("ignore", message=r".*does not have a `build\(\)` method implemented.*")
        model.compute_output_spec(*a, **k)
    # Keras' marker of a deferred variable (private, stable across Keras 3): None until initialized.
    pending = [v.path for v in model.variables if getattr(v, "_value", True) is None]
    if pending:
        raise SMPError(f"{type(model).__name__}: Keras left variables uninitialized after building: {pending[:5]}. "
                       "Fix: create the layers' variables in build() or __init__")
    # Built: the traced call must not run Keras' symbolic build again (nor warn about it).
    model.built = True
    return deferred


@contextlib.contextmanager
def _values_deferred(deferred: list[tuple[Any, Any]], enabled: bool) -> Iterator[None]:
    """While the block runs, Keras' deferred initialization makes value-less handles (see `_build`)."""
    if not enabled:
        yield
        return
    cls = KerasTFVariable
    original = cls._deferred_initialize

    def handle_only(self: Any) -> None:
        with tf.init_scope():
            self._value = resource_variable_ops.UninitializedVariable(
                shape=self._shape, dtype=tf.as_dtype(self._dtype), trainable=self.trainable, name=self.name)
        deferred.append((self, self._initializer))
        self._initializer = None

    cls._deferred_initialize = handle_only
    try:
        yield
    finally:
        cls._deferred_initialize = original


def initialize_deferred(deferred: list[tuple[Any, Any]], owned: Callable[[Any], bool]) -> None:
    """Give the deferred variables that this rank ``owned`` their initial values.

    Every initializer runs, in Keras' order, so the random streams advance as in one process and
    each owned variable gets exactly the value an unpartitioned build gives it; the value of a
    variable this rank does not own is dropped at once (one variable's memory at a time), and its
    handle stays without a value until the model releases it (`residency`).
    """
    for v, initializer in deferred:
        value = initializer(v.shape, dtype=v.dtype)
        if owned(v):
            v._value.assign(tf.cast(value, v._value.dtype))
        del value


def trace_call(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
               call: Callable[..., Any], defer_values: bool = False) -> TracedCall:
    """Trace ``call(model, *args, **kwargs)`` once at the specs of the tensor leaves of the arguments.

    Args:
        model: the Keras model (its ``variables`` are mapped to the captured resources).
        args, kwargs: the arguments of this call (graph tensors of the step are fine: only their
            specs are used; a ``tf.TensorSpec`` leaf traces at that spec).
        call: the unpartitioned ``__call__`` (``keras.Model.__call__``).
        defer_values: build the variables without values (`_build`); `TracedCall.deferred` lists them.

    Raises:
        SMPError: the call returns something that is not a structure of tensors.
    """
    flat = tf.nest.flatten((args, kwargs))
    tensor_pos = [i for i, leaf in enumerate(flat) if isinstance(leaf, _TENSORS)]
    specs, _ = input_signature(args, kwargs)
    holder: dict[str, Any] = {}

    def body(*tensors: tf.Tensor) -> Any:
        leaves = list(flat)
        for pos, t in zip(tensor_pos, tensors):
            leaves[pos] = t
        a, k = tf.nest.pack_sequence_as((args, kwargs), leaves)
        out = call(model, *a, **k)
        holder["structure"] = out
        return tf.nest.flatten(out)

    deferred = _build(model, args, kwargs, flat, tensor_pos, specs, defer_values)
    wrapped = tf.compat.v1.wrap_function(body, specs)
    graph = wrapped.graph
    use_small_batch_gradient(graph)  # the stage functions' backward of a Dense layer (engine/matmul_grad.py)
    outputs = list(wrapped.outputs)
    if len(outputs) != len(tf.nest.flatten(holder["structure"])):
        raise SMPError(f"{type(model).__name__}.call must return tensors (or a nest of tensors); got "
                       f"{holder['structure']!r}. Fix: return only the tensors you need (they are sent to every rank)")
    by_handle = {id(v.handle): i for i, v in enumerate(model.variables)}
    resource_var = {internal.name: by_handle[id(ext)] for ext, internal in graph.captures if id(ext) in by_handle}
    var_of_op: dict[str, int] = {}
    var_of_read: dict[str, Any] = {}
    ops = []
    for op in graph.get_operations():
        if op.type in FREE_TYPES:
            continue
        ops.append(op)
        for t in op.inputs:
            if t.name in resource_var:
                var_of_op[op.name] = resource_var[t.name]
                if op.type == "ReadVariableOp":
                    var_of_read[op.name] = model.variables[resource_var[t.name]]
                break
    return TracedCall(wrapped=wrapped, inputs=list(wrapped.inputs[: len(specs)]), outputs=outputs,
                      output_structure=holder["structure"], ops=ops, var_of_op=var_of_op, var_of_read=var_of_read,
                      deferred=deferred)
