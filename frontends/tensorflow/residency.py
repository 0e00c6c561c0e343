"""Which variables a rank holds: after partitioning, the storage of the others' variables is released.

A pipeline builds its variables as handles without values (`partitioning.trace`) and each rank
gives values to its own; a model built before its first step (an explicit ``build``) holds every
value until partitioning. Either way, once partitioned, a rank keeps only what it owns::

    built:        [ d1.kernel | d1.bias | d2.kernel | d2.bias ]   on every rank
    pp_rank 0:    [ d1.kernel | d1.bias |    0 B    |   0 B   ]   d2's storage released
    pp_rank 1:    [    0 B    |   0 B   | d2.kernel | d2.bias ]

A released variable keeps its Python object, path, dtype and static shape (``zip(grads,
model.trainable_variables)``, checkpoint paths and the auto-partitioner's sizes see the same
model); its tensor is replaced by an empty one of the same rank (no rows: `empty_shape`, through
``AssignVariableOp`` with ``validate_shape=False``), so its memory goes back to the allocator. Nothing on this rank reads
it: the rank runs none of the ops that do (every op on a variable runs on its owner). What else
honours the release:

- the optimizer steps and keeps slots only for variables this rank holds (`optimizers` filters
  ``apply``), so Adam's moments exist once, on the owner;
- the gradient a step returns for a released variable is a zero-size zero (`engine.exchange`):
  one entry per variable, no full-size zeros;
- a checkpoint written by a stage holds only its own variables (a released variable writes and
  restores nothing), and ``save_model`` brings the others' values to rank 0 for the export only
  (`materialized`);
- the Horovod drop-in's ``broadcast_variables`` skips released variables (the replicas of a
  stage release the same ones).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["empty_shape", "held_bytes", "is_released", "materialized", "release"]

_FLAG = "_smp_released"


def _tf_variable(v: Any) -> Any:
    """The ``tf.Variable`` behind a Keras variable (or ``v`` itself)."""
    inner = getattr(v, "value", v)
    return inner if isinstance(inner, tf.Variable) else v


def _write_nothing() -> dict[str, Any]:
    return {}


def _restore_nothing(restored_tensors: Any) -> Any:
    return tf.no_op()


def release(variables: Iterable[Any]) -> int:
    """Release the storage of ``variables`` on this rank; returns the bytes given back.

    Calling it again on a released variable does nothing.
    """
    freed = 0
    for v in variables:
        if is_released(v) or len(v.shape) == 0:  # a scalar cannot be empty (and costs nothing)
            continue
        inner = _tf_variable(v)
        freed += int(np.prod(v.shape)) * inner.dtype.size
        tf.raw_ops.AssignVariableOp(resource=inner.handle, value=tf.zeros(empty_shape(v.shape), inner.dtype),
                                    validate_shape=False)
        setattr(v, _FLAG, True)
        # The checkpoint API asks the Keras variable for its tensors: a released one has none.
        v._serialize_to_tensors = _write_nothing
        v._restore_from_tensors = _restore_nothing
    return freed


def empty_shape(shape: Any) -> list[int]:
    """The shape of a released variable's (or its gradient's) storage: no rows, the other dimensions
    kept, so an op that takes the rank from the static shape (``tf.reduce_sum(g)`` over every axis)
    still agrees with the tensor.

    Example:
        >>> empty_shape((1024, 64)), empty_shape((7,))
        ([0, 64], [0])
    """
    dims = list(tf.TensorShape(shape).as_list()) if tf.TensorShape(shape).rank is not None else [0]
    return [0, *[d if d is not None else 0 for d in dims[1:]]]


def is_released(v: Any) -> bool:
    """Whether this rank released ``v``'s storage (another pipeline rank owns it)."""
    return bool(getattr(v, _FLAG, False))


@contextlib.contextmanager
def materialized(variables: Sequence[Any], values: Sequence[Any]) -> Iterator[None]:
    """``variables`` hold ``values`` for the duration of the block, then what they held before
    (``save_model`` on rank 0 exports the owners' values): a released variable gets its full
    storage back for the block only."""
    given, kept = [], []
    try:
        for v, value in zip(variables, values):
            if not is_released(v):
                kept.append((v, np.asarray(v.numpy())))
                v.assign(value)
                continue
            inner = _tf_variable(v)
            tf.raw_ops.AssignVariableOp(resource=inner.handle, value=tf.convert_to_tensor(value, inner.dtype),
                                        validate_shape=False)
            delattr(v, _FLAG)
            del v._serialize_to_tensors, v._restore_from_tensors
            given.append(v)
        yield
    finally:
        for v, value in kept:
            v.assign(value)
        release(given)


def held_bytes(variables: Iterable[Any]) -> int:
    """The bytes ``variables`` occupy on this rank right now (their storage, not their static shapes)."""
    return sum(int(tf.size(_tf_variable(v))) * _tf_variable(v).dtype.size for v in variables)
