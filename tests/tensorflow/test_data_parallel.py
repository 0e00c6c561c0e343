"""smp.tensorflow.data_parallel: gradients averaged over the DP group equal the mean of one process's per-replica gradients.

The model is plain Keras whose layers read their variables through `average_over_dp` (one layer
through `average_many`), as the engine wraps every variable read of the partitioned call. Each DP
rank feeds its own data; the reference is one process (this pytest process, no smp) computing each
replica's gradients and their mean.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest

from tests.helpers.mpi_spawn import run_mpi_ranks

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

BATCH, FEATURES, CLASSES, VOCAB = 8, 6, 3, 10


def _build() -> Any:
    """A seeded model: a bucketed dense layer, a per-tensor dense layer, an embedding (sparse gradient), a scalar."""
    import keras
    import tensorflow as tf
    from smp.tensorflow.data_parallel import average_many, average_over_dp

    class AvgDense(keras.layers.Layer):
        def __init__(self, units: int, bucketed: bool, **kw: Any) -> None:
            super().__init__(**kw)
            self.units, self.bucketed = units, bucketed

        def build(self, shape: Any) -> None:
            self.kernel = self.add_weight(shape=(shape[-1], self.units), initializer="glorot_uniform", name="kernel")
            self.bias = self.add_weight(shape=(self.units,), initializer="random_normal", name="bias")

        def call(self, x: Any) -> Any:
            if self.bucketed:
                kernel, bias = average_many([self.kernel, self.bias], self.name)
            else:
                kernel, bias = average_over_dp(self.kernel, "kernel"), average_over_dp(self.bias, "bias")
            return tf.matmul(x, kernel) + bias

    class Embed(keras.layers.Layer):
        def build(self, shape: Any) -> None:
            self.table = self.add_weight(shape=(VOCAB, FEATURES), initializer="random_normal", name="table")
            self.scale = self.add_weight(shape=(), initializer="ones", name="scale")  # a 0-d variable

        def call(self, ids: Any) -> Any:
            return tf.gather(average_over_dp(self.table, "table"), ids) * average_over_dp(self.scale, "scale")

    class Net(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.emb = Embed()
            self.d1 = AvgDense(16, bucketed=True)
            self.d2 = AvgDense(CLASSES, bucketed=False)

        def call(self, inputs: Any) -> Any:
            x, ids = inputs
            return self.d2(tf.tanh(self.d1(x + self.emb(ids))))

    keras.utils.set_random_seed(0)
    model = Net()
    model((np.zeros((1, FEATURES), np.float32), np.zeros((1,), np.int32)))
    return model


def _data(replica: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + replica)
    return (rng.standard_normal((BATCH, FEATURES)).astype(np.float32),
            rng.integers(0, VOCAB, BATCH).astype(np.int32), rng.integers(0, CLASSES, BATCH).astype(np.int32))


def _gradient_fns(model: Any) -> dict[str, Any]:
    """The three ways a step computes gradients: eager tape, tape in a tf.function, tf.gradients in a tf.function."""
    import keras
    import tensorflow as tf

    loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def tape_grads(x: Any, ids: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_obj(y, model((x, ids)))
        return [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_variables)], loss

    def graph_grads(x: Any, ids: Any, y: Any) -> Any:
        loss = loss_obj(y, model((x, ids)))
        grads = tf.gradients(loss, [v.value for v in model.trainable_variables], unconnected_gradients="zero")
        return [tf.convert_to_tensor(g) for g in grads], loss

    return {"eager": tape_grads, "function": tf.function(tape_grads), "gradients": tf.function(graph_grads)}


def dp_rank_fn(config: dict[str, Any], timing: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    import smp.tensorflow as smp
    from smp.tensorflow.data_parallel import dp_enabled

    smp.init(config)
    model = _build()
    x, ids, y = _data(smp.dp_rank())
    out: dict[str, Any] = {"dp_rank": smp.dp_rank(), "dp_size": smp.dp_size(), "enabled": dp_enabled(),
                           "names": [v.path for v in model.trainable_variables]}
    for how, fn in _gradient_fns(model).items():
        for repeat in range(2):  # a traced function called twice: the allreduces match again
            grads, loss = fn(x, ids, y)
            out[f"{how}{repeat}"] = [g.numpy() for g in grads]
            out[f"{how}{repeat}_loss"] = float(loss)
    if timing:  # the cost of the two averaging variants, measured in the same launch (see _time_variants)
        out["timing"] = {f"{layers} x Dense({width})": _time_variants(layers, width, 30) for layers, width in timing}
    return out


def _reference(dp: int) -> tuple[list[np.ndarray], list[float]]:
    """One process: each replica's gradients (no smp, so the wrappers are the identity) and their mean."""
    model = _build()
    fn = _gradient_fns(model)["eager"]
    per, losses = [], []
    for r in range(dp):
        grads, loss = fn(*_data(r))
        per.append([g.numpy() for g in grads])
        losses.append(float(loss))
    return [np.mean([p[i] for p in per], axis=0) for i in range(len(per[0]))], losses


@pytest.mark.mpi
@pytest.mark.parametrize("n, config, timing", [
    (2, {"partitions": 1, "horovod": True}, [(8, 256), (32, 16)]),
    (4, {"partitions": 1, "ddp": True}, None),
])
def test_gradients_are_the_mean_over_the_dp_group(n: int, config: dict[str, Any],
                                                   timing: list[tuple[int, int]] | None) -> None:
    """At 2 ranks the launch also measures per-read vs bucketed averaging (printed with -s; the box is
    shared, so no speed assertion; the figures are in smp/tensorflow/data_parallel.py's docstring)."""
    got = run_mpi_ranks(dp_rank_fn, n, args=(config, timing), timeout=180)
    if timing:
        print(f"\nDP averaging at 2 ranks, median ms per forward+backward (2 variables per layer): {got[0]['timing']}")
        assert all(v > 0 for per in got[0]["timing"].values() for v in per.values())
    ref, ref_losses = _reference(n)
    for r, out in enumerate(got):
        assert (out["dp_rank"], out["dp_size"], out["enabled"]) == (r, n, True)
        for key in ("eager0", "eager1", "function0", "function1", "gradients0", "gradients1"):
            for name, g, want in zip(out["names"], out[key], ref):
                np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-7, err_msg=f"rank {r} {key} {name}")
            # each replica's loss stays its own
            assert out[f"{key}_loss"] == pytest.approx(ref_losses[r], rel=1e-6)
    # the gradients differ from any single replica's: the average really happened
    single, _ = _reference(1)
    assert not np.allclose(got[0]["function0"][-2], single[-2])


def test_identity_without_data_parallelism() -> None:
    import tensorflow as tf
    from smp.tensorflow.data_parallel import average_many, average_over_dp, dp_enabled

    assert not dp_enabled()
    v = tf.Variable([[1.0, 2.0]])

    @tf.function
    def f() -> Any:
        with tf.GradientTape() as tape:
            a = average_over_dp(v, "v")
            (b,) = average_many([v])
            loss = tf.reduce_sum(a * 3.0 + b)
        return tape.gradient(loss, v)

    np.testing.assert_array_equal(f().numpy(), [[4.0, 4.0]])
    graph = f.get_concrete_function().graph
    assert not [op for op in graph.get_operations() if op.type in ("PyFunc", "PyFuncStateless", "EagerPyFunc")]


def _time_variants(layers: int, width: int, calls: int) -> dict[str, float]:
    """Median ms of one tf.function forward+backward of ``layers`` x Dense(``width``): none / per-read / bucketed."""
    import keras
    import tensorflow as tf
    from smp.tensorflow.data_parallel import average_many, average_over_dp

    keras.utils.set_random_seed(0)
    ws = [tf.Variable(tf.random.normal((width, width)) * 0.1) for _ in range(layers)]
    bs = [tf.Variable(tf.zeros((width,))) for _ in range(layers)]
    x = tf.random.normal((16, width))

    def make(mode: str) -> Any:
        @tf.function
        def step() -> Any:
            with tf.GradientTape() as tape:
                if mode == "none":
                    w_reads, b_reads = list(ws), list(bs)
                elif mode == "bucketed":
                    reads = average_many(ws + bs, "all")
                    w_reads, b_reads = reads[:layers], reads[layers:]
                else:
                    w_reads = [average_over_dp(w, f"w{i}") for i, w in enumerate(ws)]
                    b_reads = [average_over_dp(b, f"b{i}") for i, b in enumerate(bs)]
                h = x
                for w, b in zip(w_reads, b_reads):
                    h = tf.tanh(tf.matmul(h, w) + b)
                loss = tf.reduce_mean(h * h)
            return tape.gradient(loss, ws + bs)
        return step

    steps = {label: make(label) for label in ("none", "per_tensor", "bucketed")}
    times: dict[str, list[float]] = {label: [] for label in steps}
    for fn in steps.values():
        fn()  # trace
    for _ in range(calls):  # interleaved, so load changes on the shared machine hit every variant alike
        for label, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[label].append((time.perf_counter() - t0) * 1e3)
    out = {label: float(np.median(t)) for label, t in times.items()}
    return out
