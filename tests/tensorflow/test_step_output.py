"""TF StepOutput and TFStepOps on real tensors, eagerly and inside tf.function, against numpy."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import doctest  # noqa: E402
import logging  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from smp.tensorflow import step_output  # noqa: E402
from smp.tensorflow.step_output import StepOutput, TFStepOps  # noqa: E402

import smp.state  # noqa: E402
from smp.errors import StepOutputError, TensorSplitError  # noqa: E402
from smp.step import StepSpec, split_arguments  # noqa: E402

RNG = np.random.default_rng(0)
PARTS = [RNG.standard_normal((2, 3)).astype(np.float32) for _ in range(4)]


def outs() -> StepOutput:
    return StepOutput([tf.constant(p) for p in PARTS])


def close(a: object, b: object) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_methods_match_numpy_eagerly() -> None:
    out = outs()
    assert len(out) == 4 and out[2].numpy().tolist() == PARTS[2].tolist() and [o.shape for o in out] == [(2, 3)] * 4
    close(out.reduce_mean(), sum(p / 4 for p in PARTS))
    close(out.reduce_sum(), sum(PARTS))
    close(out.concat(), np.concatenate(PARTS, 0))
    close(out.stack(), np.stack(PARTS))
    close(out.merge(), np.concatenate(PARTS, 0))
    close(out.merge(axis=1), np.concatenate(PARTS, 1))
    for method in ("add_n", "accumulate_n", "variable"):
        close(out.accumulate(method), sum(p / 4 for p in PARTS))
    close(out.process_outputs(tf.abs).reduce_sum(), sum(np.abs(p) for p in PARTS))
    assert "4 microbatches of float32 tensors of shape (2, 3)" in repr(out)


def test_scalars_concat_and_merge_stack() -> None:
    out = StepOutput([tf.constant(1.0), tf.constant(4.0)])
    assert out.concat().numpy().tolist() == [1.0, 4.0] and out.merge().numpy().tolist() == [1.0, 4.0]
    assert float(out.reduce_mean()) == 2.5


def test_empty_and_bad_arguments_raise_clear_errors() -> None:
    with pytest.raises(StepOutputError, match=r"reduce_mean\(\) of an empty StepOutput"):
        StepOutput().reduce_mean()
    with pytest.raises(StepOutputError, match=r"method='sum'.*valid methods are \['add_n', 'accumulate_n', 'variable'\]"):
        outs().accumulate("sum")
    with pytest.raises(StepOutputError, match="var is the accumulator of method='variable' only"):
        outs().accumulate("add_n", var=tf.Variable(tf.zeros((2, 3))))
    with pytest.raises(StepOutputError, match=r"the variable is float32 \(3,\).*float32 \(2, 3\)"):
        outs().accumulate(var=tf.Variable(tf.zeros(3)))
    with pytest.raises(StepOutputError, match="var must be a tf.Variable"):
        outs().accumulate(var=np.zeros((2, 3)))


def test_accumulate_into_a_given_variable_restarts_each_call() -> None:
    var = tf.Variable(tf.fill((2, 3), 100.0), trainable=False)
    for _ in range(2):
        close(outs().accumulate(var=var), sum(p / 4 for p in PARTS))
    close(var, sum(p / 4 for p in PARTS))


def test_indexed_slices_accumulate_sparse_equals_dense() -> None:
    emb = keras.layers.Embedding(10, 3)
    emb.build((None,))
    grads, dense = [], []
    for ids in ([1, 2], [2, 2], [7, 0]):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(emb(tf.constant(ids)) ** 2)
        g = tape.gradient(loss, emb.embeddings)
        assert isinstance(g, tf.IndexedSlices)
        grads.append(g)
        dense.append(tf.convert_to_tensor(g).numpy())
    out = StepOutput(grads)
    for method in ("add_n", "accumulate_n", "variable"):
        close(out.accumulate(method), sum(d / 3 for d in dense))
    close(out.reduce_sum(), sum(dense))


def test_accumulate_inside_tf_function_over_several_calls() -> None:
    """Three methods in one graph; the variable accumulators are made once and never carry values."""
    before = len(step_output._ACCUMULATORS.variables)

    @tf.function
    def reduce(a: tf.Tensor, b: tf.Tensor) -> list[tf.Tensor]:
        grads = [StepOutput([a[0], a[1]]), StepOutput([b[0], b[1]]), StepOutput([a[1], a[0]])]
        return [g.accumulate() for g in grads] + [grads[0].accumulate("add_n"), grads[1].accumulate("accumulate_n")]

    for call in range(3):
        a = RNG.standard_normal((2, 3)).astype(np.float32) + call
        b = RNG.standard_normal((2, 5)).astype(np.float32) * call
        got = reduce(tf.constant(a), tf.constant(b))
        for value, want in zip(got, [(a[0] + a[1]) / 2, (b[0] + b[1]) / 2, (a[1] + a[0]) / 2,
                                     (a[0] + a[1]) / 2, (b[0] + b[1]) / 2], strict=True):
            close(value, want)
        assert got[0].shape == (3,) and got[1].shape == (5,)
    # A retrace with new shapes reuses the same three variables (a tf.function may not make new ones).
    got = reduce(tf.ones((2, 7)), tf.ones((2, 2)))
    close(got[0], np.ones(7))
    assert reduce.experimental_get_tracing_count() >= 2
    assert len(step_output._ACCUMULATORS.variables) - before == 3


def test_step_output_is_a_nest_structure_for_tf_function() -> None:
    @tf.function
    def double(out: StepOutput) -> StepOutput:
        return StepOutput([o * 2 for o in out.outputs])

    got = double(outs())
    assert isinstance(got, StepOutput)
    close(got.concat(), np.concatenate(PARTS) * 2)
    double(outs())
    assert double.experimental_get_tracing_count() == 1


def test_tf_step_ops_narrow_dim_size_and_hints() -> None:
    ops = TFStepOps(2, "f")
    x = np.arange(12).reshape(3, 4)
    assert ops.is_tensor(x) and ops.is_tensor(tf.constant(1)) and not ops.is_tensor(tf.Variable(1.0))
    assert ops.dim_size(x, 1) == 4 and ops.dim_size(x, -1) == 4
    assert ops.narrow(x, 1, 2, 2).numpy().tolist() == x[:, 2:4].tolist()
    assert ops.narrow(tf.constant(x), -1, 0, 2).numpy().tolist() == x[:, :2].tolist()
    with pytest.raises(IndexError, match="axis 2 does not exist"):
        ops.dim_size(x, 2)
    assert ops.quiet(keras.layers.Dense(1)) and ops.quiet(keras.optimizers.Adam()) and ops.quiet(tf.Variable(1.0))
    assert "tf.data.Dataset is not split" in ops.probable_bug(tf.data.Dataset.range(3))
    assert "iterator" in ops.probable_bug(iter(tf.data.Dataset.range(3)))
    assert ops.probable_bug(keras.layers.Dense(1)) is None and ops.probable_bug(object()) is None


def test_dataset_argument_warns_that_it_is_probably_a_bug(caplog: pytest.LogCaptureFixture) -> None:
    def body(x: object, data: object) -> None: ...

    spec = StepSpec.from_function(body)
    with caplog.at_level(logging.WARNING, logger="smp.step"):
        parts = split_arguments(spec, (np.ones((4, 2)), tf.data.Dataset.range(3)), {}, 2, TFStepOps(2))
    assert [p[0][0].shape for p in parts] == [(2, 2), (2, 2)]
    assert "This is probably a bug: a tf.data.Dataset is not split" in caplog.text


def test_unknown_dimension_is_split_in_units_with_a_runtime_check() -> None:
    @tf.function(input_signature=[tf.TensorSpec([None, 2])])
    def halves(x: tf.Tensor) -> list[tf.Tensor]:
        ops = TFStepOps(2, "f")
        assert ops.dim_size(x, 0) == 2  # two units of tf.shape(x)[0] // 2
        return [ops.narrow(x, 0, 0, 1), ops.narrow(x, 0, 1, 1)]

    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    a, b = halves(x)
    assert a.numpy().tolist() == x[:2].tolist() and b.numpy().tolist() == x[2:].tolist()
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"smp.step\(f\): cannot split an argument into 2"):
        halves(x[:3])


def test_split_errors_are_the_core_text() -> None:
    def body(x: object) -> None: ...

    with pytest.raises(TensorSplitError, match="its size along axis 0 is 3, which is not divisible by 2"):
        split_arguments(StepSpec.from_function(body), (tf.ones((3, 1)),), {}, 2, TFStepOps(2))


def test_docstring_examples() -> None:
    globs = {"tf": tf, "keras": keras, "np": np, "StepOutput": StepOutput, "TFStepOps": TFStepOps}
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in finder.find(step_output, globs=globs):
        runner.run(test)
    assert runner.failures == 0 and runner.tries >= 8


def test_reset_drops_the_accumulators() -> None:
    @tf.function
    def acc(a: tf.Tensor) -> tf.Tensor:
        return StepOutput([a, a]).accumulate()

    close(acc(tf.ones(2)), np.ones(2))
    assert step_output._ACCUMULATORS.variables
    smp.state.reset()
    assert not step_output._ACCUMULATORS.variables
