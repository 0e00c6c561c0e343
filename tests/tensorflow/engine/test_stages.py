"""Placement and stage cutting of traced Keras models, in this process (no MPI): the graph work of the engine."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import keras  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from smp.tensorflow.engine.executor import CALLS_PER_MICROBATCH, Tags  # noqa: E402
from smp.tensorflow.engine.stages import plan_stages  # noqa: E402
from smp.tensorflow.partitioning.decide import decide  # noqa: E402
from smp.tensorflow.partitioning.scopes import scope_partition  # noqa: E402
from smp.tensorflow.partitioning.trace import trace_call  # noqa: E402

from smp.config import resolve  # noqa: E402
from smp.errors import InvalidPartitionIDError, SMPError  # noqa: E402
from tests.tensorflow.model.models import MODELS  # noqa: E402


def _cfg(pp: int, default: int = 0) -> Any:
    return resolve({"pipeline_parallel_degree": pp, "auto_partition": False, "default_partition": default},
                   world_size=pp, framework="tensorflow")


def _plan(name: str, pp: int, x: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
    model = MODELS[name](keras.Model, pp)()
    traced = trace_call(model, (x,), kwargs, call=keras.Model.__call__)
    placement = decide(traced, pp_size=pp, cfg=_cfg(pp), owners=None)
    return model, traced, placement


def test_tags_are_distinct_and_inside_max_tag() -> None:
    tags = Tags(n_messages=5, num_microbatches=4, max_tag=32767)
    seen = set()
    for step_trace in range(tags.traces):
        for mb in range(4):
            for call in range(CALLS_PER_MICROBATCH):
                for msg in range(5):
                    for kind in (Tags.FORWARD, Tags.GRAD, Tags.SHAPE):
                        seen.add(tags.tag(step_trace=step_trace, microbatch=mb, call=call, message=msg, kind=kind))
    assert len(seen) == tags.traces * 4 * CALLS_PER_MICROBATCH * 5 * 3 and max(seen) <= 32767 and min(seen) == 0
    with pytest.raises(SMPError, match="fewer microbatches"):
        Tags(n_messages=5000, num_microbatches=64, max_tag=32767)
    with pytest.raises(SMPError, match="called 5 times"):
        tags.tag(step_trace=0, microbatch=0, call=CALLS_PER_MICROBATCH, message=0, kind=Tags.FORWARD)


def test_scope_partition_innermost_and_uniquified_scopes() -> None:
    assert scope_partition("m_1/smp_partition_0/blk/smp_partition_2/dense/MatMul") == 2
    assert scope_partition("m_1/smp_partition_1_1/dense/MatMul") == 1
    assert scope_partition("m_1/smp_partition_12/x") == 12
    assert scope_partition("m_1/my_smp_partition_1/x") is None
    assert scope_partition("m_1/dense/MatMul") is None


def test_tied_lm_pp2_cuts_the_cycle_into_four_stages() -> None:
    model, traced, placement = _plan("tied_lm", 2, tf.zeros((4, 3), tf.int32))
    plan = plan_stages(traced, placement, 2)
    assert [s.partition for s in plan.stages] == [0, 1, 0, 1], plan.describe()
    emb = [i for i, v in enumerate(model.variables) if "embedding" in v.path]
    mix = [i for i, v in enumerate(model.variables) if v is model.mix.kernel]
    assert placement.owners[emb[0]] == 0 and placement.owners[mix[0]] == 0
    # Every op touching a variable runs on its owner; the tied head's read is one of them.
    for op_name, var in traced.var_of_op.items():
        assert placement.op_partition[op_name] == placement.owners[var], op_name
    sent = {b.tensor.op.type for b in plan.boundaries}
    assert "ReadVariableOp" in sent and "GatherV2" in sent
    # Constants and inputs are never sent; each boundary goes to another partition.
    assert all(b.tensor.op.type not in ("Const", "Placeholder") and b.partition not in b.dests for b in plan.boundaries)
    assert plan.output_source == [1]


def test_bn_dropout_stage_fetches_its_assigns_after_the_reads() -> None:
    model, traced, placement = _plan("bn_dropout", 2, tf.zeros((4, 6)), training=True)
    plan = plan_stages(traced, placement, 2)
    first = plan.stages[0]
    assert sorted(op.type for op in first.effects) == ["AssignVariableOp"] * 3, [op.name for op in first.effects]
    seed = next(i for i, v in enumerate(model.variables) if "seed" in v.path)
    ops = [op for op in traced.ops if traced.var_of_op.get(op.name) == seed]
    write = next(op for op in ops if op.type == "AssignVariableOp")
    reads = [op for op in ops if op.type == "ReadVariableOp"]
    assert reads and all(r in write.control_inputs for r in reads)
    bn_before = model.bn.moving_mean.numpy().copy()
    plan.function(first)(tf.ones((4, 6)))
    assert (model.bn.moving_mean.numpy() != bn_before).any(), "the pruned stage dropped the BatchNorm update"
    seed_before = model.drop.seed_generator.state.numpy().copy()
    plan.function(first)(tf.ones((4, 6)))
    assert (model.drop.seed_generator.state.numpy() != seed_before).any(), "the dropout seed did not advance"


def test_out_of_range_partition_is_an_error_and_a_none_batch_boundary_is_not() -> None:
    model = MODELS["tied_lm"](keras.Model, 3)()
    traced = trace_call(model, (tf.zeros((4, 3), tf.int32),), {}, call=keras.Model.__call__)
    with pytest.raises(InvalidPartitionIDError, match=r"partition\(s\) \[2\]"):
        decide(traced, pp_size=2, cfg=_cfg(2), owners=None)
    mlp = MODELS["mlp"](keras.Model, 2)()
    traced = trace_call(mlp, (tf.TensorSpec((None, 6), tf.float32),), {}, call=keras.Model.__call__)
    placement = decide(traced, pp_size=2, cfg=_cfg(2), owners=None)
    plan = plan_stages(traced, placement, 2)
    assert [b.shape for b in plan.boundaries] == [(None, 16)]
    assert [op.type for op in traced.ops if op.name in plan.stages[1].ops].count("ReadVariableOp") == 4


def test_without_data_parallelism_a_stage_function_is_the_plain_pruned_trace() -> None:
    """No smp.init (dp_enabled() is False): no averaging op anywhere; the reads the DP path would feed are listed."""
    from smp.tensorflow.data_parallel import dp_enabled

    model, traced, placement = _plan("tied_lm", 2, tf.zeros((4, 3), tf.int32))
    plan = plan_stages(traced, placement, 2)
    assert not dp_enabled()
    for stage in plan.stages:
        fn = plan.function(stage)
        assert isinstance(fn, tf.types.experimental.ConcreteFunction), type(fn)
        assert not [op.name for op in fn.graph.get_operations() if "smp_dp_mean" in op.name]
        reads = plan.trainable_reads(stage)
        assert all(traced.var_of_read[r].trainable for r in reads)
        assert reads == [n for n in stage.ops if n in traced.var_of_read and traced.var_of_read[n].trainable]
    # The embedding is read by stage 0 (the lookup) and by stage 2 (its read is sent to the tied head).
    emb = model.emb.embeddings
    assert [any(traced.var_of_read[r] is emb for r in plan.trainable_reads(s)) for s in plan.stages] == [
        True, False, True, False]
