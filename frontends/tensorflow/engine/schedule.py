"""Plan-ordered overlap of microbatches: this rank's forward/backward actions run in the shared scheduler's order.

Two modes, agreed by every rank at ``smp.init`` (`runtime.init.overlap_requested`):

- Overlap: ``SMP_TF_OVERLAP=1``, or unset when each rank is bound to its own cores (``mpiexec
  -bind-to core``; Open MPI binds 1-2 ranks per node by default). One graph, the order given by
  the plan (tf_plan.md 2.5 option B).
- Lockstep: ``SMP_TF_OVERLAP=0``, or unset when the ranks share every core. Every exchange op is
  a stateful ``numpy_function``; a ``tf.function`` runs stateful ops in creation order, so each
  rank does F0 B0 F1 B1 ... and its peers idle (each microbatch's backward compute still overlaps
  the next microbatch's forward a little: TensorFlow runs stateless ops as their inputs arrive).

With overlap, the exchange ops and the action markers are stateful ``numpy_function``s taken out
of the program-order chain (`exchange.independent`), so only their data and control edges order
them and TensorFlow's executor may run microbatch 1's forward while microbatch 0's gradient is
still on its way. What keeps that in the plan's order is a `StepGate` per traced step: a marker
before each action (a stage's forward call, or the gradient into a stage's outputs) takes the
core's `smp.pipeline.baton.Baton` in plan order (`smp.pipeline.choose.rank_plan` for the config's
``pipeline``, the chain being the partitions of the stages in run order), and a marker after it
(with a data edge from every output of the stage call, or of the gradient calls that consume the
stage's output gradients) gives it back. So one action computes at a time on a rank, in the
order of the plan:

    pp=2, 4 microbatches, interleaved      rank 0:  F0 F1 F2 B0 F3 B1 B2 B3
                                           rank 1:  F0 B0 F1 B1 F2 B2 F3 B3

Nothing else changes: the same ops, the same values (the losses and variables of lockstep).

Deadlock freedom: a valid plan completes when each rank runs its actions one after another in
plan order (the scheduler checks that); the gate only adds that order, sends never block, and a
receive only waits for data. Two things could still stall, and both are guarded:

- TensorFlow's inter-op pool: a receive or a marker waiting for the baton holds a pool thread.
  The markers of one stage and direction follow each other and the receives of one stream too,
  so `min_inter_op_threads` (local stages and receive streams) bounds what waits at once; a step
  whose need ``tf.config.threading.get_inter_op_parallelism_threads()`` does not meet runs
  lockstep and says so once. ``smp.init`` sizes the pool (`runtime.init.INTER_OP_POOL`) when it
  runs before TensorFlow's first op.
- An action set that differs from the plan (a model called twice per microbatch, a step without
  backward for some microbatches): the trace is checked against the plan when it ends and runs
  ungated (dataflow order, recorded all the same) if they differ. Every baton wait has the
  config's ``comm_timeout``.

Details the measurements forced (``benchmarks/tf_pipeline.py``, ranks bound to a core each):

- receives of one stream (a message over the microbatches) start one after another
  (`exchange.exchange` ``streams``): every waiting receive polls MPI and takes the GIL;
- the feeds of a gated stage pass an identity after its marker, and the end marker reads a
  one-element slice of every output: Grappler inlines the stage call, and a control edge on the
  call op then waits for the body's side effects only. Without the data edges the baton went
  back while the action still computed, every later action shared the core with it, and the
  gradient the peer waited for left 30 ms late (the measured timeline showed it); with them the
  recorded actions tile each rank's step;
- a small pool: 88 threads on a rank bound to one core cost 10-30 % against 12-32.

Independent ops run before the function returns but in no fixed place, so one stateful barrier
at the step's end waits for every op the gate or the exchange made (a ``finish_step`` callback
that runs before the model's flush of pending sends, which program order puts after it).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf

import smp.state as smp_state
from smp.errors import ScheduleError
from smp.pipeline.baton import Baton
from smp.pipeline.choose import rank_plan

from ..runtime.init import runtime
from ..state import TFState, tf_state
from .exchange import independent

__all__ = ["StepGate", "gate_for", "min_inter_op_threads"]

logger = logging.getLogger("smp.tensorflow")

_CALL_OPS = ("PartitionedCall", "StatefulPartitionedCall")


def min_inter_op_threads(local_stages: int, receive_streams: int) -> int:
    """The inter-op pool overlap needs: one thread per op that may wait at once, and some for compute.

    What may wait together: one start marker per local stage and direction (the markers of one
    stage and direction follow each other, `StepGate.mark`), one receive per stream (a message over
    the microbatches, `exchange.exchange`), and up to 4 ops computing or ending.

    Example:
        >>> min_inter_op_threads(local_stages=1, receive_streams=2)
        8
    """
    return 2 * max(local_stages, 1) + receive_streams + 4


def _chain(partitions: Sequence[int]) -> list[int]:
    out: list[int] = []
    for p in partitions:
        if not out or out[-1] != p:
            out.append(p)
    return out


@dataclass
class _Action:
    microbatch: int
    kind: str
    stage: int
    token: tf.Tensor
    grads: list[tf.Tensor] = field(default_factory=list)  # B: the marked upstream gradients
    released: bool = False  # an end marker exists


class StepGate:
    """The gate of one traced step on this rank (see the module docstring).

    Args:
        pp_rank: this rank's pipeline rank.
        num_microbatches: of the traced step.
        chain: the partitions of the model's stages in run order.
        local_stages: how many of the stages are this rank's.
        log: the model's `ActionLog` (what ran, with times).
    """

    def __init__(self, pp_rank: int, num_microbatches: int, chain: Sequence[int], local_stages: int,
                 log: Any, receive_streams: int = 0) -> None:
        self.pp_rank = pp_rank
        self.num_microbatches = num_microbatches
        self.chain = _chain(chain)
        self.local_stages = local_stages
        self.log = log
        self.keep: list[Any] = []
        self.streams: dict[Any, tf.Tensor] = {}  # the last receive of each stream (`exchange.exchange`)
        self.actions: list[_Action] = []
        self.plan: list[tuple[str, int]] | None = None
        self.held_at_start: set[tuple[int, str, int]] = set()
        self._last_mark: dict[tuple[str, int], tf.Tensor] = {}
        self._baton: Baton | None = None
        self._lock = threading.Lock()
        self._timeout_s = float(getattr(smp_state.current().cfg, "comm_timeout", 300.0) or 300.0)
        threads = tf.config.threading.get_inter_op_parallelism_threads()
        need = min_inter_op_threads(local_stages, receive_streams)
        self.overlap = threads >= need
        if not self.overlap:
            _warn_once(f"smp.tensorflow: overlapped microbatches need TensorFlow's inter-op pool to have at least "
                       f"{need} threads ({local_stages} local stage(s), {receive_streams} receive stream(s)), and it has "
                       f"{threads or 'the default number of'}; this step runs lockstep. Fix: call "
                       f"tf.config.threading.set_inter_op_parallelism_threads({need}) before TensorFlow's first op")

    # -- trace time -----------------------------------------------------------------------------
    def mark(self, microbatch: int, kind: str, stage: int, probe: tf.Tensor) -> tf.Tensor:
        """A stateless marker that waits for the baton (``probe``: a tensor it waits for; never a constant)."""

        def start(*_: Any) -> np.int32:
            self._start(microbatch, kind, stage)
            return np.int32(0)

        # After the previous marker of this stage and direction (every plan keeps their microbatch
        # order): at most one marker per stage and direction waits for the baton, holding a pool thread.
        previous = self._last_mark.get((kind, stage))
        inputs = [probe] if previous is None else [probe, previous]
        token = independent(tf.numpy_function(start, inputs, tf.int32, stateful=True, name=f"smp_gate_{kind}"),
                            self.keep)
        self._last_mark[(kind, stage)] = token
        self.actions.append(_Action(microbatch, kind, stage, token))
        return token

    def end_after(self, action: _Action, ops: Sequence[tf.Operation], live: Any = None) -> None:
        """Give the baton back once ``ops`` have run (their outputs for which ``live`` is true, if given)."""

        def end(*_: Any) -> np.int32:
            self._end(action.microbatch, action.kind, action.stage)
            return np.int32(0)

        # A data edge from every output: Grappler inlines the stage (or gradient) call, and a control
        # edge on the call op then waits only for the body's side effects, not for its compute; the
        # baton went back while the action still ran, and the next ones shared the core with it
        # (measured: a gradient the peer waits for left 30 ms late behind later microbatches' work).
        outputs = [t for op in ops for t in op.outputs if t.dtype not in (tf.resource, tf.variant)]
        probes = [_probe(t) for t in ([t for t in outputs if live(t)] or outputs if live else outputs)]
        with tf.control_dependencies([op for op in ops
                                      if all(t.dtype in (tf.resource, tf.variant) for t in op.outputs)]):
            independent(tf.numpy_function(end, [action.token, *probes], tf.int32, stateful=True,
                                          name=f"smp_gate_end_{action.kind}"), self.keep)
        action.released = True

    def end_forward(self, token: tf.Tensor, outputs: Sequence[tf.Tensor]) -> None:
        """The forward action of ``token`` ends when the stage call producing ``outputs`` has run."""
        action = next(a for a in reversed(self.actions) if a.token is token)
        ops = list({id(t.op): t.op for t in outputs}.values())
        if ops:
            self.end_after(action, ops)

    def note_backward(self, token: tf.Tensor, grads: Sequence[tf.Tensor]) -> None:
        """The gradients the backward action of ``token`` lets through (its end is found at `finish`)."""
        next(a for a in reversed(self.actions) if a.token is token).grads = list(grads)

    def finish(self, outputs: list[Any]) -> list[Any]:
        """Close the trace: plan, backward ends, and the barrier keeping every gate and exchange op alive."""
        # A gradient call's output nobody reads (that of a model input) is pruned unless a probe reads
        # it: probing it would compute it (measured: a MatMul per microbatch on pp rank 0, 8 % of its step).
        returned = {o.ref() for o in outputs if isinstance(o, tf.Tensor)}

        def live(t: tf.Tensor) -> bool:
            return bool(t.consumers()) or t.ref() in returned

        for a in self.actions:
            if a.kind == "B" and not a.released:
                ends = _consumers(a.grads)
                if ends:
                    self.end_after(a, ends, live)
        self.held_at_start = {(a.microbatch, a.kind, a.stage) for a in self.actions if not a.released}
        self.plan = self._plan()

        def barrier() -> np.int32:
            return np.int32(0)

        with tf.control_dependencies([k for k in self.keep if k is not None]):
            tf.numpy_function(barrier, [], tf.int32, stateful=True, name="smp_gate_barrier")
        return outputs

    def _plan(self) -> list[tuple[str, int]] | None:
        cfg = smp_state.current().cfg
        made = sorted((a.kind, a.microbatch) for a in self.actions)
        has_backward = any(a.kind == "B" for a in self.actions)
        try:
            section = dataclasses.replace(cfg.pipeline_section(),  # type: ignore[union-attr]
                                          num_microbatches=self.num_microbatches)
            forward_active = int(cfg.active_microbatches or self.num_microbatches)  # type: ignore[union-attr]
            planned = rank_plan(section, self.chain, has_backward, self.pp_rank, light=set(),
                                forward_active=forward_active)
        except (ScheduleError, ValueError) as e:
            _warn_once(f"smp.tensorflow: no plan for the chain {self.chain} ({e}); microbatches run in dataflow order")
            return None
        if sorted(planned.baton) != made:
            _warn_once(f"smp.tensorflow: this step's actions on pp rank {self.pp_rank} ({len(made)}) differ from the "
                       f"plan's ({len(planned.baton)}) for the chain {self.chain}; they run in dataflow order")
            return None
        return list(planned.baton)

    # -- run time ---------------------------------------------------------------------------------
    def _start(self, microbatch: int, kind: str, stage: int) -> None:
        if self.plan is not None:
            with self._lock:
                if self._baton is None:
                    self._baton = Baton(self.plan, "interleaved", self.num_microbatches, self._timeout_s)
                baton = self._baton
            baton.acquire(kind, microbatch)
        self.log.started(microbatch, kind, stage)
        if (microbatch, kind, stage) in self.held_at_start:
            self._end(microbatch, kind, stage)

    def _end(self, microbatch: int, kind: str, stage: int) -> None:
        self.log.ended(microbatch, kind, stage)
        if self.plan is None:
            return
        with self._lock:
            baton = self._baton
            if baton is not None and baton.cursor >= len(self.plan):
                self._baton = None  # the step's last action: the next run starts a fresh plan
        if baton is not None:
            baton.release()


def _probe(t: tf.Tensor) -> tf.Tensor:
    """A one-element slice of ``t`` (a data edge that waits for ``t`` without copying it)."""
    return tf.reshape(t, [-1])[:1]


def _consumers(tensors: Sequence[tf.Tensor]) -> list[tf.Operation]:
    """The ops that do a stage's backward with ``tensors`` (its output gradients): the gradient function calls.

    Looks a few ops downstream for the call of the stage's gradient function; falls back to the
    direct consumers.
    """
    direct: dict[int, tf.Operation] = {}
    calls: dict[int, tf.Operation] = {}
    frontier = [t for t in tensors]
    for depth in range(4):
        nxt = []
        for t in frontier:
            for op in t.consumers():
                if depth == 0:
                    direct[id(op)] = op
                if op.type in _CALL_OPS:
                    calls[id(op)] = op
                else:
                    nxt.extend(op.outputs)
        frontier = nxt
        if calls:
            break
    return list(calls.values()) or list(direct.values())


# -- one gate per traced step ---------------------------------------------------------------------
_GATES: dict[int, StepGate] = {}
_REGISTERED: set[int] = set()
_WARNED: set[str] = set()


def _warn_once(text: str) -> None:
    if text not in _WARNED:
        _WARNED.add(text)
        logger.warning("%s", text)


def _finish_step(outputs: list[Any]) -> list[Any]:
    gate = _GATES.pop(tf_state().step_traces, None)
    return outputs if gate is None or not gate.overlap else gate.finish(outputs)


def gate_for(step_trace: int, num_microbatches: int, pp_rank: int, chain: Sequence[int], local_stages: int,
             log: Any, receive_streams: int = 0) -> StepGate | None:
    """The `StepGate` of step trace ``step_trace``, or None when overlap is off (not requested, or no pool)."""
    if not runtime().overlap:
        return None
    state: TFState = tf_state()
    if id(state) not in _REGISTERED:
        _REGISTERED.add(id(state))
        # First, so the barrier exists before the model's flush of pending sends (stateful ops run in order).
        state.finish_step.insert(0, _finish_step)
        state.close_hooks.append(lambda: (_REGISTERED.discard(id(state)), _GATES.clear()))
    gate = _GATES.get(step_trace)
    if gate is None:
        for old in [k for k in _GATES if k != step_trace]:
            del _GATES[old]  # a trace that never reached finish_step (it raised)
        gate = StepGate(pp_rank, num_microbatches, chain, local_stages, log, receive_streams)
        _GATES[step_trace] = gate
    return gate if gate.overlap else None

