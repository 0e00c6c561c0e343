"""The Keras optimizer patch of ``smp.tensorflow.optimizers`` in one process: traced, the variables'
updates run one after another, with the values of Keras's own ``apply``."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

from collections.abc import Iterator  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from smp.tensorflow import optimizers  # noqa: E402

from tests.helpers.tf_graph import ancestors  # noqa: E402

SHAPES = [(6, 5), (5,), (5, 3), (3,)]


@pytest.fixture
def patched() -> Iterator[None]:
    optimizers.install()
    yield
    optimizers.uninstall()


def _train(steps: int) -> tuple[list[np.ndarray], tf.Graph, list[tf.Variable]]:
    rng = np.random.default_rng(0)
    variables = [tf.Variable(rng.standard_normal(s).astype(np.float32), name=f"w{i}") for i, s in enumerate(SHAPES)]
    opt = keras.optimizers.Adam(0.1)

    @tf.function
    def step(grads: list[tf.Tensor]) -> None:
        opt.apply_gradients(zip(grads, variables))

    graph = step.get_concrete_function([tf.TensorSpec(s, tf.float32) for s in SHAPES]).graph
    for k in range(steps):
        step([tf.constant(np.random.default_rng(k).standard_normal(s).astype(np.float32)) for s in SHAPES])
    return [v.numpy() for v in variables], graph, variables


def _update_ops(graph: tf.Graph, variables: list[tf.Variable]) -> list[tuple[list[tf.Operation], tf.Operation]]:
    """Per variable: the ops that compute its update from its gradient (outputs of the variable's shape, past
    Keras's IdentityN of the gradients) and the op that writes it (Adam's ``assign_sub``)."""
    inside = {id(outer): inner for outer, inner in graph.captures}
    passed = next(op for op in graph.get_operations() if op.type == "IdentityN")
    out = []
    for i, v in enumerate(variables):
        handle = inside[id(v.handle)]
        write = next(op for op in graph.get_operations() if op.type == "AssignSubVariableOp" and op.inputs[0] is handle)
        math = [c for c in passed.outputs[i].consumers() if any(o.shape == v.shape for o in c.outputs)]
        assert math, f"no update op reads the gradient of variable {i}"
        out.append((math, write))
    return out


def _waits_for(ops: list[tf.Operation], op: tf.Operation) -> bool:
    return op in set().union(*[ancestors(o) for o in ops])


def test_traced_updates_run_one_variable_after_another_with_keras_values(patched: None) -> None:
    ordered, graph, variables = _train(3)
    updates = _update_ops(graph, variables)
    for i in range(1, len(SHAPES)):
        assert _waits_for(updates[i][0], updates[i - 1][1]), f"variable {i}'s update does not wait for {i - 1}'s"
    optimizers.uninstall()
    free, free_graph, free_variables = _train(3)
    free_updates = _update_ops(free_graph, free_variables)
    assert not _waits_for(free_updates[1][0], free_updates[0][1])  # Keras alone runs them at once
    for a, b in zip(ordered, free):
        np.testing.assert_array_equal(a, b)


def test_eager_apply_and_an_instance_update_step_are_left_as_they_were(patched: None) -> None:
    v = tf.Variable([1.0, 2.0])
    opt = keras.optimizers.SGD(0.5)
    opt.apply_gradients([(tf.constant([1.0, 1.0]), v)])
    np.testing.assert_array_equal(v.numpy(), [0.5, 1.5])
    calls: list[int] = []
    base = opt.update_step

    def mine(gradient: tf.Tensor, variable: tf.Variable, learning_rate: tf.Tensor) -> None:
        calls.append(1)
        base(gradient, variable, learning_rate)

    object.__setattr__(opt, "update_step", mine)
    tf.function(lambda: opt.apply_gradients([(tf.constant([1.0, 1.0]), v)]))()
    assert calls == [1] and opt.__dict__["update_step"] is mine
    np.testing.assert_array_equal(v.numpy(), [0.0, 1.0])
