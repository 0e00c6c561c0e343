"""Choose a rank's executable plan: from the recorded chain and measured durations to (kind, microbatch) lists.

An executor sees a rank's plan as ``(kind, microbatch)`` pairs with kind ``"F"``, ``"B"`` or ``"W"``.
A zero-bubble plan's ``W`` actions (weight gradients, run later than the input gradient ``I``)
stay apart only in a rank's cool-down (`smp.pipeline.weights.cooldown_weights`) and only where the
executor can split a backward (``split_weights``): a rank the chain visits once and that is not the
step body's (``chain[0]``: its backward is the user's ``model.backward``). Every other ``W`` joins
its ``I`` as one ``B`` (one backward computes both). An action is named by ``(kind, ordinal)`` when the
chain visits a rank more than once: the ordinal counts earlier actions of that kind for the same
microbatch on this rank. Actions measured as *light* run beside the baton holder instead of
taking the baton.

Example:
    >>> from smp.config import PipelineSection
    >>> section = PipelineSection(num_stages=2, num_microbatches=2, active_microbatches=None,
    ...                           schedule="gpipe", virtual_stages=1)
    >>> plan = rank_plan(section, [0, 1], True, 0, light={("B", 0)}, forward_active=2)
    >>> plan.baton, plan.light
    ([('F', 0), ('F', 1)], [('B', 0), ('B', 1)])
    >>> segment_costs([0, 1, 0], [{("F", 0): 1.0, ("F", 1): 3.0, ("B", 0): 6.0, ("B", 1): 2.0},
    ...                           {("F", 0): 2.0, ("B", 0): 4.0}]).forward
    [1.0, 2.0, 3.0]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple

from smp.config import PipelineSection
from smp.errors import ScheduleError
from smp.pipeline.costs import Costs
from smp.pipeline.registry import build_plan
from smp.pipeline.simulate import simulate
from smp.pipeline.weights import cooldown_weights

__all__ = ["DEFAULT_CANDIDATES", "RankPlan", "fastest_schedule", "rank_plan", "segment_costs", "splits"]

Step = tuple[str, int]


class RankPlan(NamedTuple):
    """One rank's plan as (kind, microbatch) pairs, in order."""

    baton: list[Step]
    """The actions that take the baton."""
    every: list[Step]
    """All actions: what the rank expects its microbatches to ask for."""
    light: list[Step]
    """The light actions (run beside the baton holder)."""


def rank_plan(section: PipelineSection, chain: Sequence[int], has_backward: bool, pp_rank: int,
              light: Collection[tuple[str, int]], costs: Costs | None = None, *,
              forward_active: int, split_weights: bool = False) -> RankPlan:
    """Rank ``pp_rank``'s plan for a step whose microbatches visit ``chain``.

    Args:
        section: the pipeline section of the config (schedule, stages, microbatches, cap).
        chain: the ranks one microbatch visits in its forward (recorded on the first step).
        has_backward: whether the step calls backward; a forward-only step runs ``_only_forward``.
        pp_rank: the rank whose actions are returned.
        light: this rank's light actions as (kind, ordinal) pairs.
        costs: measured segment costs the dynamic rules are simulated with (`segment_costs`).
        forward_active: the in-flight cap of a forward-only step (the config's
            ``active_microbatches``, whatever the schedule).
        split_weights: the executor can run a backward's weight gradients as a later action; a
            zero-bubble plan then keeps this rank's cool-down ``W`` actions where `splits` allows them.

    Raises:
        ScheduleError: the schedule cannot be built for this chain (the caller falls back to
            SMP v1's dynamic order).
    """
    name = section.schedule if has_backward else "_only_forward"
    active = section.active_microbatches if has_backward else forward_active
    plan = build_plan(name, section.num_stages, section.num_microbatches, chain=chain, active_microbatches=active,
                      costs=costs)
    plan = cooldown_weights(plan, {r for r in plan.actions if split_weights and splits(chain, r)}, costs)
    baton: list[Step] = []
    every: list[Step] = []
    lights: list[Step] = []
    seen: dict[Step, int] = {}
    for a in plan.actions[pp_rank]:
        kind = str(a.kind)
        kind = "W" if kind == "W" else "B" if kind in ("B", "I") else "F"
        ordinal = seen.get((kind, a.microbatch), 0)
        seen[(kind, a.microbatch)] = ordinal + 1
        every.append((kind, a.microbatch))
        if (kind, ordinal) in light:  # light actions run beside the baton holder
            lights.append((kind, a.microbatch))
        else:
            baton.append((kind, a.microbatch))
    return RankPlan(baton, every, lights)


def splits(chain: Sequence[int], pp_rank: int) -> bool:
    """Whether rank ``pp_rank`` may run a zero-bubble plan's ``W`` actions apart from their ``I``.

    Only a rank whose one backward per microbatch is a request from another rank: it runs the W
    of a microbatch after that request's reply, and a second visit's I could be planned before
    it. The step body's rank (``chain[0]``) runs ``model.backward`` as a whole.

    Example:
        >>> splits([0, 1], 1), splits([0, 1], 0), splits([0, 1, 0, 1], 1)
        (True, False, False)
    """
    return bool(chain) and pp_rank != chain[0] and list(chain).count(pp_rank) == 1


def segment_costs(chain: Sequence[int], per_rank: Sequence[Mapping[tuple[str, int], float]]) -> Costs | None:
    """Per-segment costs from every rank's measured (kind, ordinal) durations, or None if one is missing.

    Segment s runs on rank chain[s]; its forward is that rank's ``ordinal``-th forward of a
    microbatch (ordinal = earlier visits to the rank), its backward the rank's k-th backward with
    k = later visits (backward walks the chain in reverse). The weight-gradient part is taken as
    half the backward. Durations are floored at 1 µs.
    """
    chain = list(chain)
    forward, backward = [], []
    for s, rank in enumerate(chain):
        times = per_rank[rank]
        f = times.get(("F", chain[:s].count(rank)))
        b = times.get(("B", chain[s + 1:].count(rank)))
        if f is None or b is None:
            return None
        forward.append(max(f, 1e-6))
        backward.append(max(b, 1e-6))
    return Costs(forward=forward, backward=backward, backward_weight=[b / 2 for b in backward])


# The schedules smp may pick when the user sets no ``pipeline``: SMP v1's default and the two whose
# activations in flight never exceed it (1F1B and ZB-H1 hold at most p microbatches, interleaved up
# to p + 2), so the choice never costs memory the partition did not plan for.
DEFAULT_CANDIDATES = ("interleaved", "1f1b", "zb_h1")
_SMP_V1 = ("simple", "interleaved", "_only_forward")


def fastest_schedule(section: PipelineSection, chain: Sequence[int], costs: Costs,
                     candidates: Sequence[str] = DEFAULT_CANDIDATES, *,
                     split_weights: bool = False) -> tuple[PipelineSection, dict[str, float]]:
    """The section of the candidate schedule whose plan the simulator finishes first, and every makespan.

    Every candidate is planned for ``chain`` and simulated with the measured ``costs``, as the
    executor will run it (`cooldown_weights` where ``split_weights``); the first of the fastest
    wins a tie (the order of ``candidates``), and a schedule that cannot be built for the chain
    (a V chain for 1F1B) is left out. The costs are the same on every pipeline rank, so every
    rank picks the same schedule.

    Example:
        >>> from smp.config import PipelineSection
        >>> section = PipelineSection(2, 8, 4, "interleaved", 1)
        >>> costs = Costs(forward=[1.0, 1.0], backward=[2.0, 2.0], backward_weight=[1.0, 1.0])
        >>> best, times = fastest_schedule(section, [0, 1], costs, split_weights=True)
        >>> best.schedule, sorted(times)
        ('zb_h1', ['1f1b', 'interleaved', 'zb_h1'])
    """
    makespans: dict[str, float] = {}
    sections: dict[str, PipelineSection] = {}
    for name in candidates:
        active = section.active_microbatches if name in _SMP_V1 else None
        candidate = dataclasses.replace(section, schedule=name, active_microbatches=active)
        try:
            plan = build_plan(name, section.num_stages, section.num_microbatches, chain=chain,
                              active_microbatches=active, costs=costs)
            plan = cooldown_weights(plan, {r for r in plan.actions if split_weights and splits(chain, r)}, costs)
            makespans[name] = simulate(plan, costs).makespan
        except ScheduleError:
            continue
        sections[name] = candidate
    if not makespans:
        return section, makespans
    best = min(makespans, key=lambda n: (makespans[n], list(candidates).index(n)))
    return sections[best], makespans
