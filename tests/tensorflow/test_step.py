"""smp.step for TensorFlow in one process: split rules, tracing, the TFState contract, outer tf.function.

``smp.init`` runs at world 1 (one process, no launcher) before each test; the steps, tensors and
Keras models are real.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import smp.tensorflow as smp_tf  # noqa: E402
import tensorflow as tf  # noqa: E402
from smp.tensorflow.state import tf_state  # noqa: E402
from smp.tensorflow.step import FinishStepError, StepFunctionCalledError, step  # noqa: E402
from smp.tensorflow.step_output import StepOutput  # noqa: E402

from smp.errors import NotInitializedError, TensorSplitError  # noqa: E402
from tests.helpers.tf_graph import ancestors  # noqa: E402

X = np.arange(48, dtype=np.float32).reshape(8, 6)


def configure(microbatches: int = 4) -> None:
    smp_tf.reset()
    smp_tf.init({"microbatches": microbatches})


@pytest.fixture(autouse=True)
def initialized() -> Iterator[None]:
    configure(4)
    yield
    smp_tf.reset()


def test_not_initialized_raises() -> None:
    smp_tf.reset()

    @step
    def f(x: tf.Tensor) -> tf.Tensor:
        return x

    with pytest.raises(NotInitializedError, match=r"smp.init\(config\) before calling the @smp.step function"):
        f(X)


def test_split_aggregate_and_state_during_the_body() -> None:
    seen: list[tuple[int | None, int]] = []

    @step(non_split_inputs=["scale"])
    def f(x: tf.Tensor, y: tf.Tensor, scale: tf.Tensor, note: str = "n") -> Any:
        seen.append((tf_state().microbatch, tf_state().num_microbatches))
        return {"x": x * scale, "sum": tf.reduce_sum(y)}, note, tf_state().microbatch, None

    y = np.ones(8, np.float32)
    out, note, mb, none = f(X, y, tf.constant(2.0))
    assert seen == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert tf_state().microbatch is None and tf_state().num_microbatches == 1 and tf_state().step_traces == 1
    assert isinstance(out["x"], StepOutput) and len(out["x"]) == 4 and out["x"][1].shape == (2, 6)
    np.testing.assert_array_equal(out["x"].concat(), X * 2)
    assert out["sum"].reduce_sum().numpy() == 8.0 and [float(s) for s in out["sum"]] == [2.0] * 4
    assert note == ["n"] * 4 and mb == [0, 1, 2, 3] and none == [None] * 4  # Python leaves stay Python
    f(X, y, tf.constant(3.0))
    assert tf_state().step_traces == 1 and len(seen) == 4  # same signature: no retrace
    f(X[:4], y[:4], tf.constant(3.0))
    assert tf_state().step_traces == 2  # a new shape retraces (no input_signature)


def test_input_split_axes_and_merge_restore_the_batch_order() -> None:
    @step(input_split_axes={"x": 1})
    def f(x: tf.Tensor) -> tf.Tensor:
        assert x.shape == (8, 3)
        return x + 0.5

    configure(2)
    np.testing.assert_array_equal(f(X).merge(axis=1), X + 0.5)
    configure(3)
    out = f(np.concatenate([X, X[:, :3]], axis=1))
    np.testing.assert_array_equal(out.merge(axis=1), np.concatenate([X, X[:, :3]], axis=1) + 0.5)
    np.testing.assert_array_equal(out[2], X[:, :3] + 0.5)


def test_step_output_argument_gives_microbatch_m_its_output() -> None:
    @step
    def first(x: tf.Tensor) -> tf.Tensor:
        return tf.reduce_sum(x)

    @step
    def second(prev: StepOutput, x: tf.Tensor) -> tf.Tensor:
        return prev - tf.reduce_sum(x)

    sums = first(X)
    np.testing.assert_array_equal(second(sums, X).stack(), np.zeros(4))
    configure(2)
    with pytest.raises(TensorSplitError, match="is a StepOutput with 4 output"):
        second(sums, X)


def test_bad_options_and_non_divisible_batches() -> None:
    with pytest.raises(TensorSplitError, match=r"non_split_inputs: 'model' is not an argument of .*\['x'\]"):
        step(lambda x: x, non_split_inputs=["model"])

    @step
    def f(x: tf.Tensor) -> tf.Tensor:
        return x

    with pytest.raises(TensorSplitError, match="cannot split argument x into 4 microbatches: its size along axis 0 "
                                               "is 6, which is not divisible by 4"):
        f(X[:6])
    assert tf_state().step_traces == 0 and tf_state().microbatch is None


def test_none_batch_signature_traces_once_and_checks_sizes() -> None:
    @step(input_signature=[tf.TensorSpec([None, 6], tf.float32)])
    def f(x: tf.Tensor) -> tf.Tensor:
        assert x.shape.as_list() == [None, 6]
        return x * 2

    for rows in (8, 4, 16):
        np.testing.assert_array_equal(f(np.tile(X, (2, 1))[:rows]).merge(), np.tile(X, (2, 1))[:rows] * 2)
    assert tf_state().step_traces == 1
    with pytest.raises(TensorSplitError, match="its size along axis 0 is 6, which is not divisible by 4"):
        f(X[:6])

    @tf.function(input_signature=[tf.TensorSpec([None, 6], tf.float32)])
    def outer(x: tf.Tensor) -> tf.Tensor:
        return f(x).concat()

    np.testing.assert_array_equal(outer(X), X * 2)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"smp.step\(.*f\): cannot split an argument into 4 "
                                                             r"microbatches.*not divisible by 4"):
        outer(X[:6])


def test_inside_an_outer_tf_function_the_step_traces_into_its_graph() -> None:
    graphs: list[Any] = []
    outer_graphs: list[Any] = []

    @step
    def f(x: tf.Tensor) -> tf.Tensor:
        graphs.append(tf.compat.v1.get_default_graph())
        return tf.reduce_mean(x, axis=0)

    @tf.function
    def outer(x: tf.Tensor) -> list[tf.Tensor]:
        outer_graphs.append(tf.compat.v1.get_default_graph())
        out = f(x)
        assert isinstance(out, StepOutput) and len(out) == 4
        return [out.reduce_mean(), out.accumulate(), out.merge()]

    mean, acc, merged = outer(tf.constant(X))
    # accumulate() makes a variable, so tf.function traces outer twice on its first call; the step
    # body is traced into each of those graphs (4 microbatches each), never into a graph of its own.
    assert graphs == [g for g in outer_graphs for _ in range(4)]
    traces = tf_state().step_traces
    assert traces == len(outer_graphs) == outer.experimental_get_tracing_count()
    np.testing.assert_allclose(mean, X.mean(0), rtol=1e-6)
    np.testing.assert_allclose(acc, X.mean(0), rtol=1e-6)
    np.testing.assert_allclose(merged, X.reshape(4, 2, 6).mean(1).reshape(-1), rtol=1e-6)
    outer(tf.constant(X + 1))
    assert tf_state().step_traces == traces


def test_without_a_pipeline_each_microbatch_waits_for_the_previous_ones_results_and_their_sum() -> None:
    """pp 1: nothing else orders the microbatches; run at once, or ahead of the sums, they held several
    microbatches' gradients together (with a pipeline the engine's exchanges order them)."""
    starts: list[tf.Operation] = []
    ends: list[tf.Operation] = []

    @step
    def f(x: tf.Tensor) -> tf.Tensor:
        starts.append(tf.identity(x).op)
        y = tf.reduce_sum(tf.square(x), axis=0)
        ends.append(y.op)
        return y

    def summed(method: str) -> Any:
        starts.clear()
        ends.clear()
        fn = tf.function(lambda x: f(x).accumulate(method)).get_concrete_function(tf.TensorSpec(X.shape, tf.float32))
        del starts[:-4], ends[:-4]  # the last trace (a new accumulator variable makes tf.function trace twice)
        return fn

    fn = summed("variable")
    sums = ["AssignVariableOp"] + ["AssignAddVariableOp"] * 2  # microbatch 0's value, then what adds 1 and 2
    for m in range(1, 4):
        before = ancestors(starts[m])
        assert ends[m - 1] in before
        assert sums[m - 1] in {op.type for op in before if op not in ancestors(ends[m - 1])}, m
    np.testing.assert_allclose(fn(tf.constant(X)), (X.reshape(4, 2, 6) ** 2).sum(1).mean(0), rtol=1e-6)
    fn = summed("add_n")  # a dataflow sum: the order of the results only
    assert all(ends[m - 1] in ancestors(starts[m]) for m in range(1, 4))
    np.testing.assert_allclose(fn(tf.constant(X)), (X.reshape(4, 2, 6) ** 2).sum(1).mean(0), rtol=1e-6)


def test_finish_step_gets_the_flat_outputs_and_its_answer_is_used() -> None:
    calls: list[list[Any]] = []

    def finish(flat: list[Any]) -> list[Any]:
        calls.append(flat)
        return [t * 0 + i for i, t in enumerate(flat)]

    tf_state().finish_step.append(finish)

    @step
    def f(x: tf.Tensor) -> Any:
        return tf.reduce_sum(x), {"double": x * 2}, 7

    total, parts, seven = f(X)
    assert len(calls) == 1 and len(calls[0]) == 8  # 2 tensors x 4 microbatches, microbatch-major
    assert [float(t) for t in total] == [0.0, 2.0, 4.0, 6.0]
    assert parts["double"].concat().numpy().tolist() == np.repeat([1.0, 3.0, 5.0, 7.0], 12).reshape(8, 6).tolist()
    assert seven == [7] * 4

    @tf.function
    def outer(x: tf.Tensor) -> tf.Tensor:
        return f(x)[0].reduce_sum()

    assert float(outer(X)) == 12.0 and len(calls) == 2
    tf_state().finish_step.append(lambda flat: flat[:1])
    f(X + 1)  # callbacks run when the step is traced; the same signature does not retrace
    with pytest.raises(FinishStepError, match="returned list of 1; it must return a list of 8 tensor"):
        f(X[:4])


def test_variables_become_their_values_and_nested_steps_are_refused() -> None:
    counter = tf.Variable(5.0)

    @step
    def f(x: tf.Tensor) -> Any:
        counter.assign_add(1.0)
        return counter

    values = f(X)
    assert isinstance(values, StepOutput) and [float(v) for v in values] == [6.0, 7.0, 8.0, 9.0]

    @step
    def inner(x: tf.Tensor) -> tf.Tensor:
        return x

    @step
    def outer(x: tf.Tensor) -> tf.Tensor:
        return inner(x)

    with pytest.raises(StepFunctionCalledError, match="was called inside another @smp.step function"):
        outer(X)
    assert tf_state().microbatch is None


def test_autograph_converts_python_control_flow_on_tensors() -> None:
    @step
    def f(x: tf.Tensor) -> tf.Tensor:
        if tf.reduce_sum(x) > 100.0:
            return x * 0
        return x

    np.testing.assert_array_equal(f(X).concat(), np.concatenate([X[:2], X[2:] * 0]))  # row sums 66, 210, ...


def test_keras_gradients_over_microbatches_equal_the_full_batch() -> None:
    """A real Keras MLP: the accumulated per-microbatch gradients of loss/M equal one full-batch tape."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.SGD(0.1)
    x = np.random.default_rng(1).standard_normal((8, 6)).astype(np.float32)
    y = np.array([0, 1, 2, 0, 1, 2, 0, 1])

    with tf.GradientTape() as tape:
        ref_loss = loss_obj(y, model(x, training=True))
    ref = [g.numpy() for g in tape.gradient(ref_loss, model.trainable_variables)]

    @step
    def get_grads(images: tf.Tensor, labels: tf.Tensor) -> Any:
        with tf.GradientTape() as tape:
            predictions = model(images, training=True)
            loss = loss_obj(labels, predictions)
        return tape.gradient(loss, model.trainable_variables), loss, predictions

    @tf.function
    def train_step(images: tf.Tensor, labels: tf.Tensor) -> Any:
        grads, loss, predictions = get_grads(images, labels)
        grads = [g.accumulate() for g in grads]
        return grads, loss.reduce_mean(), predictions.merge()

    for _ in range(2):  # the accumulators start afresh on every call
        grads, loss, predictions = train_step(x, y)
        assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
        for g, r in zip(grads, ref, strict=True):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(predictions, model(x), rtol=1e-6, atol=1e-6)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    # train_step makes accumulator variables, so its first call traces twice; later calls do not.
    assert tf_state().step_traces == 2 == train_step.experimental_get_tracing_count()


def test_tf_function_options_pass_through_and_unknown_ones_fail_at_decoration() -> None:
    with pytest.raises(TypeError, match="not_an_option"):
        step(lambda x: x, not_an_option=True)

    @step(reduce_retracing=True)
    def f(x: tf.Tensor) -> tf.Tensor:
        return x + 1

    for rows in (4, 8, 12, 16):
        np.testing.assert_array_equal(f(np.ones((rows, 2), np.float32)).merge(), np.full((rows, 2), 2.0))
    assert tf_state().step_traces <= 2  # reduce_retracing generalises the batch dimension to None
    with pytest.raises(TensorSplitError, match="its size along axis 0 is 6"):
        f(np.ones((6, 2), np.float32))


def test_docstring_examples() -> None:
    import doctest
    import types

    from smp.tensorflow import step as step_module

    configure(2)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    globs = {"smp": types.SimpleNamespace(step=step), "tf": tf}  # smp.step once the package exports it
    for test in doctest.DocTestFinder().find(step_module, globs=globs):
        runner.run(test)
    assert runner.failures == 0 and runner.tries >= 3
