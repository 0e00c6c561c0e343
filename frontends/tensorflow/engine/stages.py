"""Cut a placed trace into stages: ordered runs of one partition's ops, with the tensors between them.

A stage is the ops of one partition between two crossings of the cut. Each op gets a *level*: the
largest level of its producers, plus one when the producer is on another partition; then each op
with consumers moves as late as they allow (a variable read joins the stage that uses it). Ops of one
partition at one level form a stage; the stages run in (level, partition) order, which every rank
computes alike. A partition-level cycle is thereby cut into several stages of the same partition:

    ops (program order)     partition  level         stages in order
    a = emb(x)                  0        0           s0 = (level 0, partition 0): a
    b = d1(a)                   1        1           s1 = (level 1, partition 1): b
    c = d2(b) + a               0        2           s2 = (level 2, partition 0): c
    y = head(c)                 1        3           s3 = (level 3, partition 1): y

A tensor produced by one stage and consumed by another is a stage input of the consumer; when
the two stages are on different partitions it is a `Boundary` (sent by the producer's rank to each
consumer's rank). Const and Placeholder ops belong to no stage: every stage recomputes or feeds
them, so they are never sent. Each stage fetches its side effects too (BatchNorm moving-stat
assigns, dropout seed updates): ``wrap_function`` graphs have no automatic control dependencies,
and a pruned function drops every op its fetches do not need (tf_plan.md risk 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import tensorflow as tf

from smp.errors import PartitionError

from ..partitioning.decide import Placement
from ..partitioning.trace import FREE_TYPES, TracedCall

__all__ = ["Boundary", "Stage", "StagePlan", "plan_stages"]


@dataclass
class Boundary:
    """A tensor one stage sends to the ranks of other partitions.

    Attributes:
        index: position in `StagePlan.boundaries` (part of the message tag).
        tensor: the graph tensor.
        stage: the producing stage's index; ``partition`` its partition.
        dests: the consuming partitions (not ``partition``), sorted.
    """

    index: int
    tensor: tf.Tensor
    stage: int
    partition: int
    dests: list[int]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape.as_list())

    @property
    def dtype(self) -> tf.DType:
        return self.tensor.dtype

    @property
    def differentiable(self) -> bool:
        return self.tensor.dtype.is_floating or self.tensor.dtype.is_complex


@dataclass
class Stage:
    """One partition's ops between two crossings of the cut.

    Attributes:
        index: position in the run order; ``partition`` and ``level`` as described above.
        ops: the op names, in program order.
        feeds: what the stage function takes: model inputs and tensors of earlier stages.
        fetches: tensors the stage produces for later stages or as model outputs.
        effects: stateful ops with no consumer (variable assigns) the function must still run.
        sends: the boundaries this stage produces.
    """

    index: int
    partition: int
    level: int
    ops: list[str]
    feeds: list[tf.Tensor] = field(default_factory=list)
    fetches: list[tf.Tensor] = field(default_factory=list)
    effects: list[tf.Operation] = field(default_factory=list)
    sends: list[Boundary] = field(default_factory=list)


@dataclass
class StagePlan:
    """The stages of one trace and what crosses between them.

    Attributes:
        stages: in run order.
        boundaries: every tensor sent between partitions.
        output_source: for each flat model output, the partition that computes it (None when
            the output is a model input, which every rank has).
    """

    traced: TracedCall
    stages: list[Stage]
    boundaries: list[Boundary]
    output_source: list[int | None]
    pp_size: int
    _functions: dict[int, Any] = field(default_factory=dict)

    def function(self, stage: Stage) -> Any:
        """The function of ``stage``: feeds in, ``fetches`` (then effects' None) out.

        Without data parallelism it is the stage pruned from the trace. With it
        (`data_parallel.dp_enabled`: ``horovod``/``ddp`` and more than one replica) the stage is
        pruned with its trainable variable reads among the feeds too, and the function passes
        ``average_many`` of those variables for them: forward values unchanged, and in the
        backward the gradients of all of the stage's reads averaged over the DP group in one
        bucketed allreduce per stage and microbatch. The gradients a step returns are then
        already DP averages (issue 11); each replica's loss stays its own.
        """
        if stage.index not in self._functions:
            self._functions[stage.index] = self._build_function(stage)
        return self._functions[stage.index]

    def _build_function(self, stage: Stage) -> Any:
        from ..data_parallel import average_many, dp_enabled

        fetches = [*stage.fetches, *stage.effects]
        reads = self.trainable_reads(stage) if dp_enabled() else []
        if not reads:
            return self.traced.wrapped.prune(feeds=list(stage.feeds), fetches=fetches)
        graph = self.traced.wrapped.graph
        fed = {t.name for t in stage.feeds}
        reads = [r for r in reads if graph.get_operation_by_name(r).outputs[0].name not in fed]
        pruned = self.traced.wrapped.prune(
            feeds=[*stage.feeds, *[graph.get_operation_by_name(r).outputs[0] for r in reads]], fetches=fetches)
        variables = [self.traced.var_of_read[r] for r in reads]
        what = f"stage{stage.index}_p{stage.partition}"

        def run(*feeds: tf.Tensor) -> Any:
            return pruned(*feeds, *average_many(variables, what))

        return run

    def trainable_reads(self, stage: Stage) -> list[str]:
        """The ``ReadVariableOp`` names of ``stage`` that read a trainable variable, in program order."""
        return [n for n in stage.ops if n in self.traced.var_of_read and self.traced.var_of_read[n].trainable]

    def describe(self) -> str:
        """One line per stage (partition, level, op count, boundaries sent), for logs and errors."""
        lines = []
        for s in self.stages:
            sent = ", ".join(f"{b.tensor.name}{list(b.shape)}->{b.dests}" for b in s.sends) or "-"
            lines.append(f"stage {s.index}: partition {s.partition}, level {s.level}, {len(s.ops)} ops, sends {sent}")
        return "\n".join(lines)


def _order_variable_effects(traced: TracedCall, stage_of: dict[str, int]) -> None:
    """Within a stage, make the ops on one variable run in program order when one of them writes.

    A ``wrap_function`` graph has no automatic control dependencies, so in a pruned function a
    dropout layer's seed read and the seed update after it (or a BatchNorm stat read and its
    assign) may run in either order; the update must not overtake the read. Ops on one variable
    all sit on its owner, and two stages of one rank run one after the other, so only pairs inside
    a stage need an edge.
    """
    by_var: dict[int, list[tf.Operation]] = {}
    for op in traced.ops:
        var = traced.var_of_op.get(op.name)
        if var is not None:
            by_var.setdefault(var, []).append(op)
    for ops in by_var.values():
        for i, op in enumerate(ops):
            for prev in ops[:i]:
                writes = op.type != "ReadVariableOp" or prev.type != "ReadVariableOp"
                if writes and stage_of[prev.name] == stage_of[op.name] and prev not in op.control_inputs:
                    op._add_control_input(prev)  # noqa: SLF001 - TF's only way to add an edge after tracing


def plan_stages(traced: TracedCall, placement: Placement, pp_size: int) -> StagePlan:
    """Cut ``traced`` into stages by ``placement`` (see the module docstring).

    Raises:
        PartitionError: a boundary tensor has an unknown rank, an op has a control
            input on another stage, or a model output is a constant.
    """
    part = placement.op_partition
    level: dict[str, int] = {}
    for op in traced.ops:
        lv = 0
        for t in op.inputs:
            src = t.op
            if src.type in FREE_TYPES:
                continue
            lv = max(lv, level[src.name] + (part[src.name] != part[op.name]))
        level[op.name] = lv
    # As late as possible: an op moves up to its consumers' level (a variable read or a shape op
    # joins the stage that uses it instead of opening a stage of its own).
    users: dict[str, list[str]] = {}
    for op in traced.ops:
        for t in op.inputs:
            if t.op.type not in FREE_TYPES:
                users.setdefault(t.op.name, []).append(op.name)
    for op in reversed(traced.ops):
        if op.name in users:
            level[op.name] = min(level[c] - (part[c] != part[op.name]) for c in users[op.name])
    keys = sorted({(level[op.name], part[op.name]) for op in traced.ops})
    index_of = {k: i for i, k in enumerate(keys)}
    stages = [Stage(index=i, partition=p, level=lv, ops=[]) for i, (lv, p) in enumerate(keys)]
    stage_of: dict[str, int] = {}
    for op in traced.ops:
        s = index_of[(level[op.name], part[op.name])]
        stage_of[op.name] = s
        stages[s].ops.append(op.name)

    model_inputs = {t.name for t in traced.inputs}
    consumers: dict[str, set[int]] = {}
    fed: list[set[str]] = [set() for _ in stages]

    def feed(s: int, t: tf.Tensor) -> None:
        if t.name not in fed[s]:
            fed[s].add(t.name)
            stages[s].feeds.append(t)

    for op in traced.ops:
        s = stage_of[op.name]
        for c in op.control_inputs:
            if c.type not in FREE_TYPES and stage_of.get(c.name) != s:
                raise PartitionError(
                    f"op {op.name} (partition {part[op.name]}) has a control dependency on {c.name} "
                    f"(partition {part.get(c.name)}), which runs in another stage. Fix: keep ops tied by "
                    "tf.control_dependencies inside one smp.partition block")
        for t in op.inputs:
            src = t.op
            if src.type in FREE_TYPES:
                if t.name in model_inputs:
                    feed(s, t)
                continue
            if stage_of[src.name] != s:
                consumers.setdefault(t.name, set()).add(s)
                feed(s, t)

    _order_variable_effects(traced, stage_of)

    output_source: list[int | None] = []
    out_names = set()
    for t in traced.outputs:
        if t.name in model_inputs:
            output_source.append(None)
            continue
        if t.op.type in FREE_TYPES:
            raise PartitionError(f"DistributedModel.call returns the constant {t.name}; return tensors computed "
                                 "from the inputs (a constant needs no model)")
        output_source.append(part[t.op.name])
        out_names.add(t.name)

    boundaries: list[Boundary] = []
    for op in traced.ops:
        s = stages[stage_of[op.name]]
        for t in op.outputs:
            used_by = consumers.get(t.name, set())
            if used_by or t.name in out_names:
                s.fetches.append(t)
            dests = sorted({stages[c].partition for c in used_by} - {s.partition})
            if dests:
                if t.shape.rank is None:
                    raise PartitionError(
                        f"tensor {t.name} crosses from partition {s.partition} to {dests} but even its rank is "
                        "unknown when call() is traced. Fix: give the step inputs shapes of known rank")
                b = Boundary(index=len(boundaries), tensor=t, stage=s.index, partition=s.partition, dests=dests)
                boundaries.append(b)
                s.sends.append(b)
        if op.op_def.is_stateful and op.type != "ReadVariableOp" and not any(o.consumers() for o in op.outputs):
            s.effects.append(op)
    return StagePlan(traced=traced, stages=stages, boundaries=boundaries, output_source=output_source,
                     pp_size=pp_size)
