"""The stage functions' MatMul gradient (engine/matmul_grad.py): TensorFlow's numbers, used where it should be."""

from __future__ import annotations

import os
from typing import Any
from unittest import mock

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from smp.tensorflow.engine import matmul_grad  # noqa: E402
from smp.tensorflow.engine.matmul_grad import GRADIENT, use_small_batch_gradient  # noqa: E402
from smp.tensorflow.partitioning.trace import trace_call  # noqa: E402


def _grads(rows: int, k: int, n: int, marked: bool, *, t_a: bool = False, t_b: bool = False,
           dtype: Any = tf.float32) -> tuple[list[np.ndarray], int]:
    """d(sum(matmul(x, w) * c))/d(x, w) through a function made as the engine makes its stage functions
    (``wrap_function``), with or without the mark; and how often the small-batch rewrite ran."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((k, rows) if t_a else (rows, k)), dtype)
    w = tf.constant(rng.standard_normal((n, k) if t_b else (k, n)), dtype)
    c = tf.constant(rng.standard_normal((rows, n)), dtype)
    stage = tf.compat.v1.wrap_function(lambda x, w: tf.linalg.matmul(x, w, transpose_a=t_a, transpose_b=t_b),
                                       [tf.TensorSpec(x.shape, dtype), tf.TensorSpec(w.shape, dtype)])
    if marked:
        assert use_small_batch_gradient(stage.graph) == 1

    @tf.function
    def run(x: Any, w: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            loss = tf.reduce_sum(stage(x, w) * c)
        return tape.gradient(loss, [x, w])

    with mock.patch.object(matmul_grad.tf, "transpose", wraps=tf.transpose) as transpose:
        got = [g.numpy() for g in run(x, w)]
    return got, transpose.call_count


@pytest.mark.parametrize("rows,k,n", [(64, 768, 768), (16, 512, 384), (1, 33, 40)])
def test_small_batch_gradient_is_tensorflows_and_takes_the_small_transpose(rows: int, k: int, n: int) -> None:
    want, before = _grads(rows, k, n, marked=False)
    got, after = _grads(rows, k, n, marked=True)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    assert (before, after) == (0, 1), "the input gradient is the transpose of w @ dy^T"


@pytest.mark.parametrize("case", [dict(rows=1024, k=64, n=64), dict(rows=8, k=32, n=16, t_a=True),
                                  dict(rows=8, k=32, n=16, t_b=True), dict(rows=8, k=32, n=64, dtype=tf.float16)])
def test_other_matmuls_keep_tensorflows_own_gradient(case: dict[str, Any]) -> None:
    want, before = _grads(**case, marked=False)
    got, after = _grads(**case, marked=True)
    tol = 1e-2 if case.get("dtype") is tf.float16 else 1e-5
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)
    if case.get("dtype") is not tf.float16:
        assert after == before == 0, "a large batch or a transposed operand keeps TensorFlow's gradient"


def test_traced_model_marks_its_dense_layers() -> None:
    model = keras.Sequential([keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(4)])
    traced = trace_call(model, (tf.zeros((8, 16)),), {}, call=keras.Model.__call__)
    marks = [op.get_attr("_gradient_op_type") for op in traced.graph.get_operations() if op.type == "MatMul"]
    assert marks == [GRADIENT.encode()] * 2
