"""Automatic op partitioning (``auto_partition: True``): every forward op of ``call()`` to a pipeline rank.

The traced ops are lowered to the core's op graph (``lower.py``) and cut by the core's DAG
partitioner (`smp.partition.ops.partition_op_graph`), with the configuration's ``optimize``
(``"speed"`` balances the FLOP estimate, ``"memory"`` the variable bytes; an explicit
``memory_weight`` blends the two), ``contiguous`` and ``pipeline_parallel_degree``. Ops that read
the same variable, belong to the same Keras layer or share a TF colocation group stay on one rank;
the result minimises the bytes crossing ranks among the best-balanced splits.

Deterministic: the same ops give the same answer on every rank (the engine still broadcasts
rank 0's). `auto_partition` logs the partition report (``smp.partition.report``, the table the
torch frontend prints) on rank 0 at INFO; `partition_ops` returns it for callers that show it
themselves.

Example (ops from ``tf.compat.v1.wrap_function(lambda x: model(x), [spec]).graph``)::

    assignment = auto_partition(ops, var_of_read, pp_size=2, cfg=smp.state.cfg)
    assignment["net_1/blk_3_1/dense_7_1/MatMul"]    # -> 1
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

import smp.state as smp_state
from smp.errors import PartitionError
from smp.partition.opresult import OpPartition
from smp.partition.ops import partition_op_graph
from smp.partition.report import PartitionReport

from ..state import tf_state
from .lower import SOURCE, LoweredGraph, lower_ops, model_layer_names

__all__ = ["TFOpPartition", "auto_partition", "partition_ops"]

logger = logging.getLogger("smp")


@dataclass(frozen=True)
class TFOpPartition:
    """The automatic partition of a traced ``call()``.

    Attributes:
        assignment: every given op's name -> its partition (0 .. pp_size-1).
        partition: the core's `OpPartition` of the op graph (chain, cut bytes, groups).
        lowered: the op graph and how the constants were placed.
        report: the partition table.
    """

    assignment: dict[str, int]
    partition: OpPartition
    lowered: LoweredGraph
    report: PartitionReport


def _options(cfg: Any) -> tuple[str, bool, float | None]:
    section = cfg.partition_section()
    given = getattr(cfg, "given", frozenset())
    weight = section.memory_weight if "memory_weight" in given else None
    return section.optimize, section.contiguous, weight


def partition_ops(ops: Sequence[tf.Operation], var_of_read: Mapping[str, Any], pp_size: int, cfg: Any, *,
                  model: Any = None) -> TFOpPartition:
    """Partition the forward ops of ``call()`` over ``pp_size`` pipeline ranks.

    Args:
        ops: the forward ops in program order, Placeholders excluded.
        var_of_read: ``ReadVariableOp`` name -> the Keras variable it reads.
        pp_size: pipeline ranks.
        cfg: the resolved configuration (``optimize``, ``contiguous``, ``memory_weight``).
        model: the traced Keras model, whose layer names make layers without variables (Dropout)
            groups too; default ``tf_state().model`` (the model being partitioned).

    Returns:
        The `TFOpPartition`.

    Raises:
        PartitionError: the model has fewer indivisible units (layers, variables) than ranks, or a
            rank would be left with no work; the message says which and shows the partition.
    """
    if isinstance(pp_size, bool) or not isinstance(pp_size, int) or pp_size < 1:
        raise PartitionError(f"pp_size={pp_size!r}: must be an int >= 1 (pipeline_parallel_degree)")
    optimize, contiguous, weight = _options(cfg)
    if model is None:
        model = tf_state().model
    names = model_layer_names(model) if model is not None else None
    lowered = lower_ops(ops, var_of_read, min_layers=pp_size, layer_names=names)
    graph = lowered.graph
    units = {node.layer for node in graph if node.layer is not None}
    units |= {f"variable {v}" for node in graph if node.layer is None for v in node.variables}
    if len(units) < pp_size:
        listed = ", ".join(sorted(units)) or "none"
        raise PartitionError(
            f"auto_partition: the model has {len(units)} Keras layer(s) or variable(s) outside layers ({listed}) "
            f"to spread over {pp_size} pipeline ranks; ops of one layer stay on one rank, so some rank would get "
            f"nothing. Fix: use at most {max(1, len(units))} partitions, split the model into more layers, or "
            f"place the ops by hand (auto_partition: False with smp.partition(i) blocks)")
    try:
        part = partition_op_graph(graph, pp_size, optimize=optimize, contiguous=contiguous, memory_weight=weight)
    except PartitionError as e:
        raise PartitionError(f"auto_partition over {pp_size} pipeline ranks of {len(graph) - 1} traced ops: {e}") \
            from None
    report = part.report(f"Automatic op partition (pp={pp_size}, optimize={optimize!r}, "
                         f"contiguous={contiguous})")
    working = {r for name, r in part.assignment.items() if name != SOURCE
               and (graph.node(name).cost > 0 or graph.node(name).variables)}
    idle = sorted(set(range(pp_size)) - working)
    if idle:
        raise PartitionError(f"auto_partition left pipeline rank(s) {idle} with no work. Fix: use fewer partitions "
                             f"or a model with more layers.\n{report}")
    assignment: dict[str, int] = {}
    for op in ops:
        if op.name in part.assignment:
            assignment[op.name] = part.assignment[op.name]
    for name, target in lowered.follows.items():
        assignment[name] = part.assignment[target] if target is not None else 0
    return TFOpPartition({op.name: assignment[op.name] for op in ops}, part, lowered, report)


def auto_partition(ops: Sequence[tf.Operation], var_of_read: Mapping[str, Any], pp_size: int,
                   cfg: Any) -> dict[str, int]:
    """Op name -> partition for every op of ``ops`` (see `partition_ops`, the model from
    ``tf_state().model``); logs the report on rank 0."""
    result = partition_ops(ops, var_of_read, pp_size, cfg)
    if smp_state.current().rank == 0:
        logger.info("automatic partition:\n%s", result.report)
    return result.assignment
