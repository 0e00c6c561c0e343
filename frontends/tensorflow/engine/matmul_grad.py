"""The input gradient of a small-batch ``MatMul`` without TensorFlow's transposed-weight product.

TensorFlow differentiates ``y = x @ w`` (a Dense layer: ``x`` is ``[rows, k]``, ``w`` is
``[k, n]``) into ``dx = dy @ w^T`` with ``transpose_b``; on CPU that product costs about twice
the forward one when ``rows`` is small, as if ``w`` were transposed first (measured on the dev
box, TF 2.21, one thread, a 768 x 768 weight: 64 rows 1.49 ms against 0.78 ms for ``dy @ w``;
16 rows 1.18 against 0.44). ``(w @ dy^T)^T`` is the same product (bit for bit in those
measurements; summed over microbatches, within float rounding) in 0.87 and 0.51 ms: the
transpose is of the small result. A pipeline stage runs
one microbatch at a time, so every microbatch pays it: on `benchmarks/tf_pipeline.py`'s model
(8 Dense(768) blocks, 64 rows) it was about a quarter of each backward. With many rows the
default is the faster one (1,024 rows: 8.5 ms against 13.4), so the rewrite is used only when
``rows`` is known and at most a quarter of ``n``.

`use_small_batch_gradient` marks every ``MatMul`` of a traced graph with the gradient below (the
``_gradient_op_type`` attribute that `ops.get_gradient_function` reads; the stage functions
pruned from the graph keep it), so only smp's stage functions are affected, never the user's
own TensorFlow code. ``SMP_TF_MATMUL_GRADIENT=tensorflow`` keeps TensorFlow's own gradient there
too (`benchmarks/tf_pipeline.py` times both).
"""

from __future__ import annotations

import os
from typing import Any

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.framework import ops

__all__ = ["GRADIENT", "use_small_batch_gradient"]

GRADIENT = "SMPSmallBatchMatMul"


def _default(op: Any, grad: tf.Tensor) -> Any:
    return ops.gradient_registry.lookup("MatMul")(op, grad)


@ops.RegisterGradient(GRADIENT)  # type: ignore[untyped-decorator]
def _small_batch_matmul_grad(op: Any, grad: tf.Tensor) -> Any:
    """TensorFlow's MatMul gradient, with ``dx = (w @ dy^T)^T`` for a small-batch ``x @ w``."""
    if op.get_attr("transpose_a") or op.get_attr("transpose_b") or op.inputs[0].dtype.is_complex:
        return _default(op, grad)
    rows, n = op.inputs[0].shape[0], op.inputs[1].shape[-1]
    if rows is None or n is None or 4 * rows > n:
        return _default(op, grad)
    skip = getattr(op, "skip_input_indices", None) or ()
    x, w = op.inputs
    dx = None if 0 in skip else tf.transpose(tf.linalg.matmul(w, grad, transpose_b=True))
    dw = None if 1 in skip else tf.linalg.matmul(x, grad, transpose_a=True)
    return dx, dw


def use_small_batch_gradient(graph: tf.Graph) -> int:
    """Give every ``MatMul`` of ``graph`` the gradient above; returns how many there were."""
    if os.environ.get("SMP_TF_MATMUL_GRADIENT", "").lower() == "tensorflow":
        return 0
    mark = attr_value_pb2.AttrValue(s=GRADIENT.encode())
    count = 0
    for op in graph.get_operations():
        if op.type == "MatMul":
            op._set_attr("_gradient_op_type", mark)  # noqa: SLF001 - what gradient_override_map sets
            count += 1
    return count
