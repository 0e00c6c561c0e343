"""Lowering: add the sends and receives a compute-only plan implies, in a deadlock-free order.

Rule: simulate the plan (`timed_walk`), which yields one global order of all compute actions that
respects every dependency and every rank's own order (by start time, ties by the order the walk
ran them). Each message joins that order at the moment its value exists (the producer's end).
Walk the merged order; a message emits the send on the producer's rank and the matching receive
on the consumer's rank *at the same point*.

Why it cannot deadlock, even when a send blocks until its receive is posted: each rank's list is
the projection of one global sequence in which every send is immediately followed by its receive.
Executing that sequence step by step, when a send/receive pair comes up both ranks have finished
everything before it, so both are at the pair. The validator re-checks this with a rendezvous walk.

Example, 1F1B on 2 ranks and 2 microbatches (unit costs)::

    rank 0: 0F0 0SEND_F0>1 0F1 0SEND_F1>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1
    rank 1: 1RECV_F0<0 1F0 1RECV_F1<0 1B0 1SEND_B0>0 1F1 1B1 1SEND_B1>0
"""

from __future__ import annotations

from smp.pipeline.actions import BACKWARD, BACKWARD_INPUT, FORWARD, RECV_B, RECV_F, SEND_B, SEND_F, Action
from smp.pipeline.costs import Costs
from smp.pipeline.plan import Plan
from smp.pipeline.simulate import timed_walk

__all__ = ["lower"]


def _message(a: Action, rank: int, chain: tuple[int, ...]) -> tuple[Action, tuple[int, Action]] | None:
    """The (send, (peer, receive)) pair that carries ``a``'s result to another rank, if any."""
    m, s = a.microbatch, a.segment
    if a.kind is FORWARD and s + 1 < len(chain) and chain[s + 1] != rank:
        peer = chain[s + 1]
        return Action(SEND_F, m, s, peer), (peer, Action(RECV_F, m, s + 1, rank))
    if a.kind in (BACKWARD, BACKWARD_INPUT) and s > 0 and chain[s - 1] != rank:
        peer = chain[s - 1]
        return Action(SEND_B, m, s, peer), (peer, Action(RECV_B, m, s - 1, rank))
    return None


def lower(plan: Plan, costs: Costs | None = None) -> Plan:
    """Return ``plan`` with explicit messages (see the module docstring).

    Args:
        plan: a valid plan; existing messages are dropped and re-derived.
        costs: used only to pick a good global order (default unit costs).

    Raises:
        ScheduleError: ``plan`` is invalid.
    """
    from smp.pipeline.validate import validate_plan

    base = plan.compute_only()
    validate_plan(base)
    resolved = (costs or Costs()).resolve(base.num_segments)
    lists, starts, ends, walk_order = timed_walk(base, resolved)
    chain = base.chain
    # Global sequence: each compute at its start; each message right when its value exists (the
    # producer's end), after the producer and before any consumer (ties by walk order).
    items: list[tuple[float, float, int, list[tuple[int, Action]]]] = []
    for seq, (rank, i) in enumerate(walk_order):
        a = lists[rank][i]
        items.append((starts[rank][i], float(seq), rank, [(rank, a)]))
        pair = _message(a, rank, chain)
        if pair is not None:
            items.append((ends[rank][i], seq + 0.5, rank, [(rank, pair[0]), pair[1]]))
    items.sort(key=lambda item: (item[0], item[1]))
    out: dict[int, list[Action]] = {r: [] for r in range(base.num_ranks)}
    for _, _, _, emitted in items:
        for rank, action in emitted:
            out[rank].append(action)
    return base.with_actions(out)
