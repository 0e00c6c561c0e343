"""Automatic op partitioning on real traced Keras models: lowering, groups, contiguity, optimize, report."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import doctest  # noqa: E402
import logging  # noqa: E402
from collections import defaultdict  # noqa: E402
from typing import Any  # noqa: E402

import keras  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from smp.tensorflow.partitioning import lower  # noqa: E402
from smp.tensorflow.partitioning.auto import TFOpPartition, auto_partition, partition_ops  # noqa: E402
from smp.tensorflow.partitioning.lower import SOURCE, lower_ops, model_layer_names, op_cost  # noqa: E402
from smp.tensorflow.partitioning.trace import trace_call  # noqa: E402

from smp.config.resolve import resolve  # noqa: E402
from smp.errors import PartitionError  # noqa: E402
from smp.partition.report import format_count  # noqa: E402


def cfg(pp: int, **extra: Any) -> Any:
    return resolve({"partitions": pp, **extra}, world_size=pp, framework="tensorflow")


def trace(model: keras.Model, spec: tf.TensorSpec) -> tuple[list[tf.Operation], dict[str, Any]]:
    """What the DistributedModel does on its first step: trace call() once at the microbatch spec
    (`smp.tensorflow.partitioning.trace.trace_call`: ops without Const/Placeholder)."""
    traced = trace_call(model, (tf.zeros(spec.shape, spec.dtype),), {"training": True}, call=keras.Model.__call__)
    return traced.ops, traced.var_of_read


def trace_with_constants(model: keras.Model, spec: tf.TensorSpec) -> tuple[list[tf.Operation], dict[str, Any]]:
    """The same trace by hand, keeping Const ops in the list (the lowering places them too)."""
    model(tf.zeros(spec.shape, spec.dtype))
    wf = tf.compat.v1.wrap_function(lambda x: model(x, training=True), [spec])
    by_handle = {}
    for external, internal in wf.graph.captures:
        for v in model.variables:
            if external is v.handle:
                by_handle[internal.name] = v
    ops = [op for op in wf.graph.get_operations() if op.type != "Placeholder"]
    var_of_read = {op.name: by_handle[op.inputs[0].name] for op in ops
                   if op.type == "ReadVariableOp" and op.inputs[0].name in by_handle}
    return ops, var_of_read


class MLP(keras.Model):
    def __init__(self, widths: tuple[int, ...] = (64, 64, 64, 10)) -> None:
        super().__init__()
        self.dense = [keras.layers.Dense(w, activation="relu") for w in widths]

    def call(self, x: tf.Tensor, training: bool = False) -> tf.Tensor:
        for d in self.dense:
            x = d(x)
        return x


class CNN(keras.Model):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = keras.layers.Conv2D(8, 3, activation="relu")
        self.pool = keras.layers.MaxPooling2D()
        self.c2 = keras.layers.Conv2D(16, 3, activation="relu")
        self.flat = keras.layers.Flatten()
        self.d1 = keras.layers.Dense(32, activation="relu")
        self.d2 = keras.layers.Dense(10)

    def call(self, x: tf.Tensor, training: bool = False) -> tf.Tensor:
        return self.d2(self.d1(self.flat(self.c2(self.pool(self.c1(x))))))


class Block(keras.layers.Layer):
    def __init__(self, width: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.a = keras.layers.Dense(width, activation="relu")
        self.b = keras.layers.Dense(width)
        self.drop = keras.layers.Dropout(0.1)

    def call(self, x: tf.Tensor, training: bool = False) -> tf.Tensor:
        return x + self.drop(self.b(self.a(x)), training=training)


class TiedResNet(keras.Model):
    """An embedding, residual blocks, and an output tied to the embedding (read on two partitions)."""

    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.emb = keras.layers.Embedding(50, 32)
        self.blocks = [Block(32) for _ in range(blocks)]

    def call(self, x: tf.Tensor, training: bool = False) -> tf.Tensor:
        h = self.emb(x)
        with tf.name_scope("smp_partition_1"):  # ignored by auto-partitioning
            for b in self.blocks:
                h = b(h, training=training)
        return tf.matmul(h, self.emb.embeddings, transpose_b=True)


class TransformerBlock(keras.layers.Layer):
    def __init__(self, dim: int, heads: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.attn = keras.layers.MultiHeadAttention(heads, dim // heads)
        self.ln1 = keras.layers.LayerNormalization()
        self.ff1 = keras.layers.Dense(4 * dim, activation="gelu")
        self.ff2 = keras.layers.Dense(dim)
        self.ln2 = keras.layers.LayerNormalization()

    def call(self, x: tf.Tensor, training: bool = False) -> tf.Tensor:
        x = self.ln1(x + self.attn(x, x, training=training))
        return self.ln2(x + self.ff2(self.ff1(x)))


class Transformer(keras.Model):
    def __init__(self, vocab: int = 100, dim: int = 32, blocks: int = 8) -> None:
        super().__init__()
        self.emb = keras.layers.Embedding(vocab, dim)
        self.blocks = [TransformerBlock(dim, 4) for _ in range(blocks)]
        self.head = keras.layers.Dense(vocab)

    def call(self, x: tf.Tensor, training: bool = False) -> tf.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = b(h, training=training)
        return self.head(h)


class WideEmbedding(keras.Model):
    """Most bytes in a cheap layer, most FLOPs in small ones: speed and memory must disagree."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = keras.layers.Embedding(4000, 64)
        self.dense = [keras.layers.Dense(64, activation="relu") for _ in range(5)]

    def call(self, x: tf.Tensor, training: bool = False) -> tf.Tensor:
        h = self.emb(x)
        for d in self.dense:
            h = d(h)
        return h


MODELS = {
    "mlp": (MLP, tf.TensorSpec((4, 32), tf.float32)),
    "cnn": (CNN, tf.TensorSpec((2, 28, 28, 1), tf.float32)),
    "tied": (TiedResNet, tf.TensorSpec((4, 5), tf.int32)),
    "transformer": (Transformer, tf.TensorSpec((2, 16), tf.int32)),
}
_TRACES: dict[str, tuple[list[tf.Operation], dict[str, Any], keras.Model]] = {}


def traced(name: str) -> tuple[list[tf.Operation], dict[str, Any], keras.Model]:
    if name not in _TRACES:
        keras.utils.set_random_seed(0)
        make, spec = MODELS[name]
        model = make()
        _TRACES[name] = (*trace(model, spec), model)
    return _TRACES[name]


def check_invariants(ops: list[tf.Operation], result: TFOpPartition, pp: int) -> None:
    a = result.assignment
    assert set(a) == {op.name for op in ops} and set(a.values()) == set(range(pp))  # every op; no idle rank
    by_resource: dict[str, set[int]] = defaultdict(set)
    for op in ops:
        for t in op.inputs:
            if t.dtype == tf.resource:
                by_resource[t.name].add(a[op.name])
    assert all(len(r) == 1 for r in by_resource.values()), "ops using one variable were split"
    by_layer: dict[str, set[int]] = defaultdict(set)
    for name, layer in result.lowered.layers.items():
        by_layer[layer].add(a[name])
    assert by_layer and all(len(r) == 1 for r in by_layer.values()), "a Keras layer was split"
    graph, part = result.lowered.graph, result.partition
    for name, target in result.lowered.follows.items():  # constants sit with their consumer
        if target is not None:
            assert a[name] == a[target]
    for e in graph.edges:  # acyclic in pipeline order
        assert part.position_of(e.src) <= part.position_of(e.dst)
    # contiguous=True: every piece of the chain is connected (the core's rule, checked from outside)
    pieces: list[set[str]] = []
    for k, (group, rank) in enumerate(zip(part.groups, part.group_ranks, strict=True)):
        if k == 0 or rank != part.group_ranks[k - 1]:
            pieces.append(set())
        pieces[-1].update(group.ops)
    relaxed = any("relaxed" in n for n in part.notes)
    for piece in pieces:
        start = next(iter(piece))
        seen, stack = {start}, [start]
        while stack:
            x = stack.pop()
            for y in (*graph.successors(x), *graph.predecessors(x)):
                if y in piece and y not in seen:
                    seen.add(y)
                    stack.append(y)
        assert relaxed or seen == piece, f"piece of {len(piece)} ops is not connected"
    text = str(result.report)
    for summary in result.report.ranks:
        assert f"{format_count(summary.params)}" in text
    assert "Automatic op partition (pp=" in text and "chain (ranks a microbatch visits)" in text


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("pp", [2, 3])
def test_partition_of_real_models(name: str, pp: int) -> None:
    ops, var_of_read, model = traced(name)
    result = partition_ops(ops, var_of_read, pp, cfg(pp), model=model)
    check_invariants(ops, result, pp)
    assert not any("relaxed" in n for n in result.partition.notes), result.partition.notes
    again = partition_ops(ops, var_of_read, pp, cfg(pp), model=model)
    assert again.assignment == result.assignment  # deterministic


def test_lowering_of_the_tied_resnet() -> None:
    ops, var_of_read, model = traced("tied")
    lowered = lower_ops(ops, var_of_read)  # without the model: layers from the variables' paths
    graph = lowered.graph
    names = {n.name for n in graph}
    assert SOURCE in names and all(op.type != "Const" or op.name not in names for op in ops)
    assert lowered.depth == 1 and set(lowered.layers.values()) == {model.emb.name, *(b.name for b in model.blocks)}
    # the tied read of the embedding (a MatMul input outside any layer) carries the embedding's bytes
    tied = [n for n in graph if n.name.endswith("MatMul/ReadVariableOp")]
    assert len(tied) == 1 and list(tied[0].variables.values()) == [50 * 32 * 4] and tied[0].layer is None
    # dropout's seed update (an AssignVariableOp on its state) travels with the seed's reads
    assign = [n for n in graph if n.name.endswith("AssignVariableOp")]
    assert len(assign) == 4 and all(len(n.variables) == 1 for n in assign)
    matmuls = [graph.node(op.name) for op in ops if op.type == "MatMul"]  # the blocks' Dense layers
    assert len(matmuls) == 8 and all(n.cost == 2 * 20 * 32 * 32 for n in matmuls)
    assert graph.successors(SOURCE) and all(e.bytes == 0 for e in graph.edges if e.src == SOURCE)
    result = partition_ops(ops, var_of_read, 2, cfg(2), model=model)
    # the tied read runs where the embedding is: its variable stays in one place
    assert result.assignment[tied[0].name] == result.assignment[next(n.name for n in graph if "GatherV2" in n.name)]


def test_layers_without_variables_are_groups_when_the_model_is_known() -> None:
    """Dropout has no variable of its own (its seed state's path is not under the layer): with the
    model's layer names its ops (mask, seed read and seed update) are one group on one rank."""
    keras.utils.set_random_seed(0)
    model = TiedResNet(blocks=2)
    ops, var_of_read = trace_with_constants(model, tf.TensorSpec((4, 5), tf.int32))
    assert any(op.type == "Const" for op in ops)
    names = model_layer_names(model)
    assert {model.emb.name, model.blocks[0].name, model.blocks[0].drop.name} <= names
    lowered = lower_ops(ops, var_of_read, layer_names=names)
    dropout_ops = [op.name for op in ops if "/dropout" in op.name and op.name not in lowered.follows]
    assert dropout_ops and all(lowered.layers[name].startswith("block") for name in dropout_ops)
    # a Dropout at the top level: its own group only when the model's layer names are known
    flat = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), keras.layers.Dropout(0.5), keras.layers.Dense(4)])
    ops, var_of_read = trace_with_constants(flat, tf.TensorSpec((2, 8), tf.float32))
    lowered = lower_ops(ops, var_of_read, layer_names=model_layer_names(flat))
    with_model = lowered.layers
    without = lower_ops(ops, var_of_read).layers
    drop = [op.name for op in ops if "dropout" in op.name and op.name not in lowered.follows]
    dropout_name = flat.layers[1].name
    assert drop and {with_model.get(n) for n in drop} == {dropout_name} and not any(n in without for n in drop)
    result = partition_ops(ops, var_of_read, 2, cfg(2), model=flat)
    check_invariants(ops, result, 2)
    assert len({result.assignment[n] for n in drop}) == 1


def test_speed_and_memory_balance_different_things() -> None:
    keras.utils.set_random_seed(0)
    ops, var_of_read = trace(WideEmbedding(), tf.TensorSpec((2, 64), tf.int32))  # no model: tf_state().model
    speed = partition_ops(ops, var_of_read, 2, cfg(2, optimize="speed")).report
    memory = partition_ops(ops, var_of_read, 2, cfg(2, optimize="memory")).report
    assert speed.compute_imbalance < memory.compute_imbalance
    assert memory.param_imbalance < speed.param_imbalance
    assert [r.params for r in memory.ranks][0] == 4000 * 64  # the embedding alone
    blended = partition_ops(ops, var_of_read, 2, cfg(2, optimize="speed", memory_weight=1.0)).report
    assert [r.params for r in blended.ranks] == [r.params for r in memory.ranks]  # an explicit weight wins


def test_too_few_layers_is_a_clear_error() -> None:
    keras.utils.set_random_seed(0)
    ops, var_of_read = trace(MLP((8, 4)), tf.TensorSpec((2, 3), tf.float32))
    with pytest.raises(PartitionError, match=r"has 2 Keras layer\(s\) or variable\(s\) outside layers \(\w+, \w+\) to spread over 3 pipeline ranks.*Fix: use at most 2 partitions"):
        partition_ops(ops, var_of_read, 3, cfg(3))
    with pytest.raises(PartitionError, match="pp_size=0"):
        partition_ops(ops, var_of_read, 0, cfg(1))


def test_layers_inside_one_container_are_refined() -> None:
    class Wrapped(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.body = keras.Sequential([keras.layers.Dense(16, activation="relu") for _ in range(4)])

        def call(self, x: tf.Tensor, training: bool = False) -> tf.Tensor:
            return self.body(x)

    keras.utils.set_random_seed(0)
    ops, var_of_read = trace(Wrapped(), tf.TensorSpec((2, 16), tf.float32))
    result = partition_ops(ops, var_of_read, 2, cfg(2))
    assert result.lowered.depth == 2 and len(set(result.lowered.layers.values())) == 4
    check_invariants(ops, result, 2)


def test_auto_partition_logs_the_report_on_rank_0(caplog: pytest.LogCaptureFixture) -> None:
    ops, var_of_read, model = traced("mlp")
    with caplog.at_level(logging.INFO, logger="smp"):
        assignment = auto_partition(ops, var_of_read, 2, cfg(2))
    assert assignment == partition_ops(ops, var_of_read, 2, cfg(2), model=model).assignment
    assert "automatic partition:" in caplog.text and "Automatic op partition (pp=2" in caplog.text


def test_op_cost_estimates() -> None:
    g = tf.Graph()
    with g.as_default():
        tf.matmul(tf.zeros((4, 3)), tf.zeros((5, 3)), transpose_b=True, name="mm")
        tf.nn.conv2d(tf.zeros((1, 8, 8, 2)), tf.zeros((3, 3, 2, 4)), 1, "SAME", name="conv")
        tf.einsum("bij,bjk->bik", tf.zeros((2, 3, 4)), tf.zeros((2, 4, 5)), name="ein")
        tf.nn.relu(tf.zeros((6, 7)), name="relu")
    cost = {n: op_cost(g.get_operation_by_name(n)) for n in ("mm", "conv", "relu")}
    assert cost == {"mm": 2 * 4 * 5 * 3, "conv": 2 * 8 * 8 * 4 * 3 * 3 * 2, "relu": 42}
    einsum = next(op for op in g.get_operations() if op.type == "Einsum")
    assert op_cost(einsum) == 2 * 2 * 3 * 5 * 4


def test_docstring_examples() -> None:
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in doctest.DocTestFinder().find(lower, globs={"tf": tf, "op_cost": op_cost}):
        runner.run(test)
    assert runner.failures == 0 and runner.tries >= 2
