"""Run this rank's part of one partitioned call: its stages, and an exchange at every crossing.

Every rank walks the same stage list (`StagePlan.stages`, in run order). At stage ``s``:

- the rank of ``s``'s partition runs ``s``'s pruned function on the model inputs and on the
  tensors earlier stages produced or sent;
- right after it, the exchange of ``s``'s boundaries: its rank sends each to the consumers'
  ranks, each consumer receives (the other ranks do nothing).

After the last stage the model outputs go from the rank that computed each one to every other
rank of the pipeline group (outputs are available on all ranks). Message tags come from
`Tags`: (step trace, microbatch, call within the microbatch, message, direction), folded into
``[0, max_tag)``.

With overlap (``SMP_TF_OVERLAP=1``, or unset with each rank bound to its own cores; and a large
enough inter-op pool) the transfers leave the program order and a `schedule.StepGate` runs this
rank's stages' forward and backward in the shared scheduler's order; otherwise lockstep
(`engine.schedule`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from smp.errors import SMPError

from ..residency import is_released
from .exchange import Recv, Send, exchange
from .schedule import gate_for
from .stages import StagePlan
from .timeline import ActionLog

__all__ = ["Link", "PartitionedCall", "Tags"]

CALLS_PER_MICROBATCH = 4


@dataclass(frozen=True)
class Link:
    """This rank's view of its pipeline group: ``pp_rank``, the global rank of each pp rank, the transport."""

    pp_rank: int
    ranks: tuple[int, ...]
    transport: Any
    max_tag: int


class Tags:
    """Message tags of one plan: message ``i`` forward ``3 * i``, its gradient ``3 * i + 1``, its shape ``3 * i + 2``.

    Messages: each (boundary, destination) pair, then each (model output, receiving partition).
    One call's messages occupy ``3 * n`` tags; microbatches, calls within a microbatch
    (``CALLS_PER_MICROBATCH``) and step traces (modulo what fits) stack above them.

    Example:
        >>> t = Tags(n_messages=3, num_microbatches=4, max_tag=32767)
        >>> t.tag(step_trace=1, microbatch=2, call=0, message=1, kind=Tags.GRAD)
        220
    """

    FORWARD, GRAD, SHAPE = 0, 1, 2

    def __init__(self, n_messages: int, num_microbatches: int, max_tag: int) -> None:
        self.per_call = 3 * max(n_messages, 1)
        self.per_trace = self.per_call * CALLS_PER_MICROBATCH * num_microbatches
        self.traces = max_tag // self.per_trace
        if self.traces < 1:
            raise SMPError(
                f"a step needs {self.per_trace} message tags ({n_messages} messages x 3 kinds x "
                f"{CALLS_PER_MICROBATCH} calls x {num_microbatches} microbatches) but the transport allows "
                f"{max_tag}. Fix: fewer microbatches, or fewer crossings of the partition cut")

    def tag(self, *, step_trace: int, microbatch: int, call: int, message: int, kind: int) -> int:
        if call >= CALLS_PER_MICROBATCH:
            raise SMPError(f"the DistributedModel was called {call + 1} times in one microbatch; at most "
                           f"{CALLS_PER_MICROBATCH} calls per microbatch are supported. Fix: concatenate the "
                           "inputs and call the model once")
        slot = step_trace % self.traces
        base = slot * self.per_trace + (microbatch * CALLS_PER_MICROBATCH + call) * self.per_call
        return base + 3 * message + kind


class PartitionedCall:
    """This rank's runner of one `StagePlan`.

    Args:
        plan: the stages of the trace.
        link: the pipeline group.
        anchors: the trainable variables this rank does not own (their reads join the first
            exchange), or ``[one owned variable]`` when it owns them all, so the first exchange
            is always on the tape's path.
        log: where forward/backward actions are recorded.
    """

    def __init__(self, plan: StagePlan, link: Link, anchors: Sequence[Any], log: ActionLog) -> None:
        self.plan = plan
        self.link = link
        self.anchors = list(anchors)
        self.log = log
        self._messages: dict[tuple[str, int, int], int] = {}
        for b in plan.boundaries:
            for q in b.dests:
                self._messages[("b", b.index, q)] = len(self._messages)
        for i, src in enumerate(plan.output_source):
            for q in range(plan.pp_size):
                if src is not None and q != src:
                    self._messages[("o", i, q)] = len(self._messages)
        self._tags: dict[int, Tags] = {}
        self._num_microbatches = 1
        self._chain = [s.partition for s in plan.stages]
        self._local_stages = sum(s.partition == link.pp_rank for s in plan.stages)
        # Receive streams of this rank (with overlap each holds at most one waiting pool thread):
        # every message it receives, and the gradient of every differentiable message it sends.
        me = link.pp_rank
        self._receive_streams = sum(1 for _, _, q in self._messages if q == me) + sum(
            len(b.dests) for s in plan.stages if s.partition == me for b in s.sends if b.differentiable)

    def _tag(self, key: tuple[str, int, int], ctx: tuple[int, int, int], kind: int) -> int:
        step_trace, mb, call = ctx
        m = self._num_microbatches
        if m not in self._tags:
            self._tags[m] = Tags(len(self._messages), m, self.link.max_tag)
        return self._tags[m].tag(step_trace=step_trace, microbatch=mb, call=call, message=self._messages[key],
                                 kind=kind)

    def _send(self, key: tuple[str, int, int], ctx: tuple[int, int, int], dest: int, grad: bool, static: bool,
              what: str) -> Send:
        return Send(dest, self._tag(key, ctx, Tags.FORWARD), self._tag(key, ctx, Tags.GRAD) if grad else None, what,
                    None if static else self._tag(key, ctx, Tags.SHAPE), stream=(key, ctx[2]))

    def _recv(self, key: tuple[str, int, int], ctx: tuple[int, int, int], t: tf.Tensor, src: int, grad: bool,
              what: str) -> Recv:
        static = t.shape.is_fully_defined()
        return Recv(tuple(t.shape.as_list()), t.dtype, src, self._tag(key, ctx, Tags.FORWARD),
                    self._tag(key, ctx, Tags.GRAD) if grad else None, what,
                    None if static else self._tag(key, ctx, Tags.SHAPE), stream=(key, ctx[2]))

    def __call__(self, inputs: Sequence[tf.Tensor], *, step_trace: int, microbatch: int, call: int,
                 num_microbatches: int) -> list[tf.Tensor]:
        """The flat model outputs for ``inputs`` (the flat tensor leaves of the call's arguments)."""
        self._num_microbatches = max(int(num_microbatches), microbatch + 1)
        plan, me, ranks = self.plan, self.link.pp_rank, self.link.ranks
        ctx = (step_trace, microbatch, call)
        values: dict[str, tf.Tensor] = {t.name: tf.convert_to_tensor(x) for t, x in zip(plan.traced.inputs, inputs)}
        gate = None
        if plan.pp_size > 1:
            gate = gate_for(step_trace, self._num_microbatches, me, self._chain, self._local_stages, self.log,
                            self._receive_streams)
        keep = gate.keep if gate is not None else None
        streams = gate.streams if gate is not None else None
        chain: tf.Tensor | None = _first_chain(list(values.values())) if gate is not None else None
        anchors_left = True
        started: list[tf.Tensor] = []  # this call's forward markers (with overlap)

        def crossing(sends: list[tuple[tf.Tensor, list[Send]]], recvs: list[Recv],
                     passthrough: Sequence[tf.Tensor] = ()) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
            nonlocal chain, anchors_left
            # With overlap the reads wait for this call's latest forward marker, if any: ready at the step's
            # start, every microbatch's reads queued ahead of the first action (with the zero gradients of
            # `exchange`, 2 ms of the 5 ms before it, measured at 16 rows).
            with tf.control_dependencies([started[-1]] if started and anchors_left else []):
                anchors = [tf.identity(v.value) for v in self.anchors] if anchors_left else []
            released = [is_released(v) for v in self.anchors] if anchors_left else []
            anchors_left = False
            chain, got, passed = exchange(self.link.transport, chain if chain is not None else tf.zeros(()),
                                          sends, recvs, passthrough, anchors, keep=keep, streams=streams,
                                          released=released)
            return got, passed

        for stage in plan.stages:
            if stage.partition == me:
                token = self.log.mark(microbatch, "F", stage.index, gate, chain)
                if gate is not None:
                    started.append(token)
                fn = plan.function(stage)
                feeds = [values[t.name] for t in stage.feeds]
                if gate is not None:
                    # The feeds pass an identity after the marker: Grappler inlines the stage call, and
                    # a control edge on the call op alone would not hold its body back.
                    with tf.control_dependencies([token]):
                        feeds = [tf.identity(f) for f in feeds]
                result = fn(*feeds)
                result = list(result)[: len(stage.fetches)] if isinstance(result, (list, tuple)) else [result]
                if gate is not None:
                    gate.end_forward(token, [r for r in result if isinstance(r, tf.Tensor)])
                outs = self.log.on_backward(microbatch, stage.index, result, gate)
                for t, v in zip(stage.fetches, outs):
                    values[t.name] = v
            sends: list[tuple[tf.Tensor, list[Send]]] = []
            recvs: list[Recv] = []
            for b in stage.sends:
                grad_ok = b.differentiable
                what = f"{b.tensor.name} (stage {stage.index}, microbatch {microbatch})"
                static = b.tensor.shape.is_fully_defined()
                if stage.partition == me:
                    sends.append((values[b.tensor.name], [
                        self._send(("b", b.index, q), ctx, ranks[q], grad_ok, static, what) for q in b.dests]))
                elif me in b.dests:
                    recvs.append(self._recv(("b", b.index, me), ctx, b.tensor, ranks[stage.partition], grad_ok, what))
            if sends or recvs:
                got, _ = crossing(sends, recvs)
                for r_spec, v in zip([b for b in stage.sends if me in b.dests], got):
                    values[r_spec.tensor.name] = v
        return self._deliver(values, crossing, ctx)

    def _deliver(self, values: dict[str, tf.Tensor], crossing: Any, ctx: tuple[int, int, int]) -> list[tf.Tensor]:
        """Send each model output from its rank to the others; every rank returns all outputs."""
        plan, me, ranks = self.plan, self.link.pp_rank, self.link.ranks
        outputs = plan.traced.outputs
        if plan.pp_size == 1:
            return [values[t.name] for t in outputs]
        sends, recvs, local = [], [], []
        for i, (t, src) in enumerate(zip(outputs, plan.output_source)):
            what = f"model output {i} ({t.name}, microbatch {ctx[1]})"
            if src is None:
                continue
            if src == me:
                local.append(i)
                static = t.shape.is_fully_defined()
                sends.append((values[t.name], [self._send(("o", i, q), ctx, ranks[q], False, static, what)
                                               for q in range(plan.pp_size) if q != me]))
            else:
                recvs.append((i, self._recv(("o", i, me), ctx, t, ranks[src], False, what)))
        # The sends carry the local outputs, which also pass through so the loss uses them.
        got, passed = crossing(sends, [r for _, r in recvs], [values[outputs[i].name] for i in local])
        result: list[tf.Tensor] = []
        by_index = dict(zip(local, passed)) | dict(zip([i for i, _ in recvs], got))
        for i, (t, src) in enumerate(zip(outputs, plan.output_source)):
            result.append(values[t.name] if src is None else by_index[i])
        return result


def _first_chain(inputs: Sequence[tf.Tensor]) -> tf.Tensor:
    """The first chain value with overlap: a scalar read from the inputs, so no transfer hangs off a constant.

    Grappler may evaluate a stateless op whose inputs are all constants at optimisation time; a
    receive must never run there.
    """
    for x in inputs:
        if x.dtype.is_floating or x.dtype.is_integer or x.dtype == tf.bool:
            return tf.reduce_sum(tf.cast(tf.reshape(x, [-1])[:1], tf.float32))
    return tf.zeros(())
