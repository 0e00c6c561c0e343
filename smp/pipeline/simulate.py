"""Simulator: time a plan under costs, and measure its bubble and its peak activation memory.

Each rank runs its actions in plan order; an action starts when its rank is free and its inputs
exist (plus the message time when an input comes from another rank). Messages overlap with
computation and links are not contended (see `smp.pipeline.costs`).

Definitions (peers.md section 11, Megatron's convention)::

    busy[r]          sum of the durations of rank r's actions
    idle[r]          makespan - busy[r]
    bubble_fraction  sum(idle) / sum(busy)          idle time / ideal compute time
    wall_share       sum(idle) / (num_ranks * makespan) = bubble / (bubble + ideal)

With equal segments this is the textbook figure: 1F1B on p ranks and m microbatches idles
(p-1)(t_F+t_B) per rank against m(t_F+t_B) of work, so ``bubble_fraction == (p-1)/m``. With unequal
segments the idle of the lighter ranks counts too (a rank outside the chain is all bubble).

Memory: a microbatch's activations in a segment are allocated when its forward starts and freed
when its backward ends (W when split; the forward's own end for forward-only plans). At equal
times frees come first. ``peak_in_flight[r]`` counts microbatches with any activation held on rank
r; ``peak_activation_bytes[r]`` sums `Costs.activation_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

from smp.errors import ScheduleError
from smp.pipeline.actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action
from smp.pipeline.costs import Costs, SegmentCosts
from smp.pipeline.plan import Plan
from smp.pipeline.timeline import Timeline, TimelineEvent
from smp.pipeline.walk import Key, walk

__all__ = ["SimResult", "simulate", "timed_walk"]


@dataclass(frozen=True)
class SimResult:
    """What `simulate` measured. Per-rank values are lists indexed by rank."""

    makespan: float
    busy: list[float]
    idle: list[float]
    bubble_fraction: float
    wall_share: float
    peak_in_flight: list[int]
    peak_activation_bytes: list[float]
    timeline: Timeline

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready summary (without the timeline)."""
        return {
            "makespan": self.makespan,
            "bubble_fraction": self.bubble_fraction,
            "wall_share": self.wall_share,
            "busy": self.busy,
            "idle": self.idle,
            "peak_in_flight": self.peak_in_flight,
            "peak_activation_bytes": self.peak_activation_bytes,
        }


def _duration(costs: SegmentCosts, action: Action) -> float:
    s = action.segment
    kind = action.kind
    if kind is FORWARD:
        return costs.forward[s]
    if kind is BACKWARD:
        return costs.backward[s]
    if kind is BACKWARD_INPUT:
        return costs.backward_input[s]
    if kind is BACKWARD_WEIGHT:
        return costs.backward_weight[s]
    return 0.0


def timed_walk(plan: Plan, costs: SegmentCosts) -> tuple[list[list[Action]], list[list[float]], list[list[float]], list[tuple[int, int]]]:
    """Start/end times of the compute actions of ``plan`` under ``costs`` (no validation).

    Returns:
        (actions per rank, starts, ends, the (rank, index) order in which the walk ran them).

    Raises:
        ScheduleError: the order cannot run (run `validate_plan` for the full report).
    """
    lists = [[a for a in acts if a.is_compute] for acts in plan.rank_lists()]

    def delay(action: Action, key: Key) -> float:
        # key segment s-1 (activation) or s+1 (gradient): the message crosses boundary min(.)
        return costs.message[min(key[2], action.segment)]

    result = walk(lists, plan.chain, duration=lambda a: _duration(costs, a), delay=delay)
    if result.stuck:
        first = result.stuck[0]
        raise ScheduleError(
            f"plan {plan.name!r} cannot run: rank {first.rank} action #{first.index} {first.reason}"
        )
    return lists, result.start, result.end, result.order


def simulate(plan: Plan, costs: Costs | None = None, *, validate: bool = True) -> SimResult:
    """Time ``plan`` under ``costs`` (default `Costs()`: F=1, B=2, W=1, one unit of activations).

    Args:
        plan: a compute-only or lowered plan (messages are timed from ``costs``, not from the
            plan's SEND/RECV actions).
        costs: per-segment costs.
        validate: run `validate_plan` first (turn off only for plans you just validated).

    Example:
        >>> from smp.pipeline import build_plan
        >>> r = simulate(build_plan("1f1b", num_ranks=4, num_microbatches=8))
        >>> r.bubble_fraction, r.peak_in_flight
        (0.375, [4, 3, 2, 1])
    """
    if validate:
        from smp.pipeline.validate import validate_plan

        validate_plan(plan)
    resolved = (costs or Costs()).resolve(plan.num_segments)
    lists, starts, ends, _ = timed_walk(plan, resolved)
    events: list[TimelineEvent] = []
    busy = [0.0] * plan.num_ranks
    for rank, acts in enumerate(lists):
        for i, a in enumerate(acts):
            events.append(TimelineEvent(rank, a.kind.value, a.microbatch, a.segment, starts[rank][i], ends[rank][i]))
            busy[rank] += ends[rank][i] - starts[rank][i]
    makespan = max((e.end for e in events), default=0.0)
    idle = [makespan - b for b in busy]
    total_busy = sum(busy)
    bubble = sum(idle) / total_busy if total_busy > 0 else 0.0
    wall = sum(idle) / (plan.num_ranks * makespan) if makespan > 0 else 0.0
    peaks, peak_bytes = _memory(plan, lists, starts, ends, resolved)
    timeline = Timeline(num_ranks=plan.num_ranks, events=tuple(events), title=f"{plan.name}")
    return SimResult(makespan, busy, idle, bubble, wall, peaks, peak_bytes, timeline)


def _memory(
    plan: Plan,
    lists: list[list[Action]],
    starts: list[list[float]],
    ends: list[list[float]],
    costs: SegmentCosts,
) -> tuple[list[int], list[float]]:
    peaks: list[int] = []
    peak_bytes: list[float] = []
    for rank, acts in enumerate(lists):
        # (time, 0 = free / 1 = allocate, microbatch, bytes)
        changes: list[tuple[float, int, int, float]] = []
        for i, a in enumerate(acts):
            size = costs.activation_bytes[a.segment]
            if a.kind is FORWARD:
                changes.append((starts[rank][i], 1, a.microbatch, size))
                if plan.forward_only:
                    changes.append((ends[rank][i], 0, a.microbatch, size))
            elif a.kind is BACKWARD_WEIGHT or a.kind is BACKWARD:  # a B is I and W at once
                changes.append((ends[rank][i], 0, a.microbatch, size))
        changes.sort(key=lambda c: (c[0], c[1]))
        live: dict[int, int] = {}
        held = peak = 0
        total = top = 0.0
        for _, alloc, m, size in changes:
            if alloc:
                live[m] = live.get(m, 0) + 1
                total += size
                top = max(top, total)
            else:
                left = live.get(m, 0) - 1
                if left > 0:
                    live[m] = left
                else:
                    live.pop(m, None)
                total -= size
            held = len(live)
            peak = max(peak, held)
        peaks.append(peak)
        peak_bytes.append(top)
    return peaks, peak_bytes
