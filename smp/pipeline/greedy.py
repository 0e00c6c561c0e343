"""List scheduling: turn a priority rule into a static plan by simulating it with costs.

A *rule* says, for an idle rank at time ``t``, which ready action it runs next (or that it waits).
The engine keeps time: it runs the chosen action for its cost, makes the actions that depended on
it ready (after the message delay when they run on another rank), and asks idle ranks again. The
order in which each rank started its actions is the plan. This is how the dynamic rules (SMP v1's
`interleaved` and `simple`, GPipe, forward-only) become static plans, on any chain.

Ties are decided the same way every time: all completions at time ``t`` are seen before any rank
chooses at ``t`` (so a backward that finishes at ``t`` on the next rank is ready at ``t``), and
ranks choose in rank order.

New microbatches enter at segment 0 on the leader (``chain[0]``) in index order; the engine offers
only the next one, and `RuleState` counts the microbatches in flight.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from smp.errors import ScheduleError
from smp.pipeline.actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action, ActionKind
from smp.pipeline.costs import SegmentCosts

__all__ = ["Unit", "Ready", "RuleState", "Rule", "run_rule"]

# (kind, microbatch, segment)
Unit = tuple[ActionKind, int, int]
Priority = Callable[[ActionKind, int, int], tuple[int, ...]]


class Ready:
    """The actions one rank could start now, per kind, in the rule's priority order."""

    def __init__(self, priority: Priority) -> None:
        self._priority = priority
        self._heaps: dict[ActionKind, list[tuple[tuple[int, ...], int, int]]] = {}

    def add(self, kind: ActionKind, m: int, s: int) -> None:
        heapq.heappush(self._heaps.setdefault(kind, []), (self._priority(kind, m, s), m, s))

    def head(self, kind: ActionKind) -> tuple[int, int] | None:
        """(microbatch, segment) of the highest-priority ready action of ``kind``."""
        heap = self._heaps.get(kind)
        return (heap[0][1], heap[0][2]) if heap else None

    def in_order(self, kind: ActionKind) -> list[tuple[int, int]]:
        """Every ready action of ``kind`` as (microbatch, segment), highest priority first."""
        return [(m, s) for _, m, s in sorted(self._heaps.get(kind, []))]

    def take(self, kind: ActionKind, m: int, s: int) -> None:
        heap = self._heaps[kind]
        if heap[0][1:] == (m, s):
            heapq.heappop(heap)
        else:
            heap.remove((self._priority(kind, m, s), m, s))
            heapq.heapify(heap)


@dataclass
class RuleState:
    """Bookkeeping the rules read: how many microbatches are in flight.

    A microbatch is in flight from the start of its forward in segment 0 (its admission by the
    leader) to the end of its last backward in segment 0 (of its last forward, for forward-only
    plans).
    """

    num_segments: int
    forward_only: bool
    in_flight: int = 0
    finished: int = 0

    def started(self, kind: ActionKind, s: int) -> None:
        if kind is FORWARD and s == 0:
            self.in_flight += 1

    def ended(self, kind: ActionKind, s: int) -> None:
        if self.forward_only:
            last = kind is FORWARD and s == self.num_segments - 1
        else:
            last = s == 0 and kind in (BACKWARD, BACKWARD_WEIGHT)
        if last:
            self.in_flight -= 1
            self.finished += 1


class Rule:
    """Base of every scheduling rule. Subclasses set the flags and implement `choose`.

    Attributes:
        split_backward: backwards are I then W.
        forward_only: no backwards at all.
    """

    split_backward: bool = False
    forward_only: bool = False

    def priority(self, kind: ActionKind, m: int, s: int) -> tuple[int, ...]:
        """Order among ready actions of one kind (smallest first). Default: lowest microbatch."""
        return (m, -s) if kind.is_backward else (m, s)

    def bind(self, state: RuleState) -> None:
        """Called once before the simulation starts."""
        self.state = state

    def choose(self, rank: int, ready: Ready, now: float) -> Unit | None:
        """The action ``rank`` starts now, or None to wait for the next event."""
        raise NotImplementedError

    def on_start(self, rank: int, unit: Unit, now: float) -> None:
        """Hook: ``unit`` started on ``rank``."""

    def on_end(self, rank: int, unit: Unit, now: float) -> None:
        """Hook: ``unit`` ended on ``rank``."""


def run_rule(
    rule: Rule,
    *,
    num_ranks: int,
    num_microbatches: int,
    chain: Sequence[int],
    costs: SegmentCosts,
    label: str,
) -> list[list[Action]]:
    """Simulate ``rule`` and return each rank's actions in the order they started.

    Raises:
        ScheduleError: the rule stopped with work left (every rank waiting): a bug in the rule
            for this chain, reported with the partial orders.
    """
    chain = tuple(chain)
    S, M = len(chain), num_microbatches
    split, fwd_only = rule.split_backward, rule.forward_only
    back = BACKWARD_INPUT if split else BACKWARD
    state = RuleState(S, fwd_only)
    rule.bind(state)
    ready = [Ready(rule.priority) for _ in range(num_ranks)]
    durations = {
        FORWARD: costs.forward, BACKWARD: costs.backward,
        BACKWARD_INPUT: costs.backward_input, BACKWARD_WEIGHT: costs.backward_weight,
    }
    pending: dict[Unit, int] = {}
    ready_at: dict[Unit, float] = {}
    events: list[tuple[float, int, int, Unit]] = []  # (time, seq, rank or -1 for an arrival, unit)
    seq = 0
    running: list[Unit | None] = [None] * num_ranks
    order: list[list[Action]] = [[] for _ in range(num_ranks)]
    next_new = 0

    def successors(u: Unit) -> list[tuple[Unit, float]]:
        kind, m, s = u
        out: list[tuple[Unit, float]] = []
        if kind is FORWARD:
            if s + 1 < S:
                out.append(((FORWARD, m, s + 1), costs.message[s] if chain[s] != chain[s + 1] else 0.0))
            if not fwd_only:
                out.append(((back, m, s), 0.0))
        elif kind is back:
            if s > 0:
                out.append(((back, m, s - 1), costs.message[s - 1] if chain[s] != chain[s - 1] else 0.0))
            if split:
                out.append(((BACKWARD_WEIGHT, m, s), 0.0))
        return out

    def needs(u: Unit) -> int:
        kind, _, s = u
        if kind is FORWARD:
            return 1 if s > 0 else 0
        if kind is BACKWARD_WEIGHT:
            return 1
        return 2 if s < S - 1 else 1

    total = M * S * (1 if fwd_only else (3 if split else 2))
    done = 0
    now = 0.0
    if M:
        ready[chain[0]].add(FORWARD, 0, 0)
    while True:
        # One pass suffices: a start at time `now` makes nothing new ready at `now` (a zero-cost
        # action's completion is an event at `now` and brings us back here).
        for r in range(num_ranks):
            if running[r] is None:
                unit = rule.choose(r, ready[r], now)
                if unit is None:
                    continue
                kind, m, s = unit
                ready[r].take(kind, m, s)
                if kind is FORWARD and s == 0:
                    next_new += 1
                    if next_new < M:
                        ready[chain[0]].add(FORWARD, next_new, 0)
                running[r] = unit
                order[r].append(Action(kind, m, s))
                state.started(kind, s)
                rule.on_start(r, unit, now)
                heapq.heappush(events, (now + durations[kind][s], seq, r, unit))
                seq += 1
        if not events:
            break
        now = events[0][0]
        while events and events[0][0] <= now:
            _, _, r, unit = heapq.heappop(events)
            if r < 0:
                ready[chain[unit[2]]].add(*unit)
                continue
            running[r] = None
            done += 1
            state.ended(unit[0], unit[2])
            rule.on_end(r, unit, now)
            for succ, delay in successors(unit):
                left = pending.get(succ, needs(succ)) - 1
                pending[succ] = left
                at = max(ready_at.get(succ, 0.0), now + delay)
                ready_at[succ] = at
                if left == 0:
                    if at <= now:
                        ready[chain[succ[2]]].add(*succ)
                    else:
                        heapq.heappush(events, (at, seq, -1, succ))
                        seq += 1
    if done < total:
        partial = "\n".join(f"  rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(order))
        raise ScheduleError(
            f"schedule {label!r} stalled after {done} of {total} actions on chain "
            f"{','.join(map(str, chain))} with {M} microbatches (a bug in the rule; please report it):\n"
            + partial
        )
    return order
