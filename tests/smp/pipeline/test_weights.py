"""Which W actions of a zero-bubble plan stay apart (`cooldown_weights`), and what a rank that splits is given.

Exhaustive over small grids: every zero-bubble schedule, 2-4 ranks, 1-9 microbatches, every subset
of ranks that split. The result is a valid plan; a W stays apart only on a rank that splits and only
after that rank's last forward; every other backward is one B at its I's place; the order of the
remaining actions is the schedule's. Under the theory's unit costs the plan is never slower than
1F1B and, with 2+ microbatches, strictly faster when the last rank splits.
"""

from __future__ import annotations

import itertools

import pytest

from smp.config import PipelineSection
from smp.pipeline import build_plan
from smp.pipeline.choose import rank_plan, splits
from smp.pipeline.costs import Costs
from smp.pipeline.simulate import simulate
from smp.pipeline.validate import validate_plan
from smp.pipeline.weights import cooldown_weights

GRID = [(name, p, m) for name in ("zb_h1", "zb_v") for p in (2, 3, 4) for m in range(1, 10)]


@pytest.mark.parametrize(("name", "p", "m"), GRID)
def test_cooldown_weights_keeps_only_the_cooldown_of_ranks_that_split(name: str, p: int, m: int) -> None:
    plan = build_plan(name, p, m)
    for k in range(p + 1):
        for ranks in itertools.combinations(range(p), k):
            got = cooldown_weights(plan, set(ranks))
            validate_plan(got)
            for r in range(p):
                acts = got.actions[r]
                last_f = max(i for i, a in enumerate(acts) if str(a.kind) == "F")
                for i, a in enumerate(acts):
                    if str(a.kind) in ("I", "W"):
                        assert r in ranks, (ranks, r, str(a))
                    if str(a.kind) == "W":
                        assert i > last_f, (r, [str(x) for x in acts])
                # The schedule's order, with each kept-together backward at its I's place.
                folded = [(str(a.kind).replace("I", "B"), a.microbatch, a.segment) for a in plan.actions[r]
                          if str(a.kind) != "W"]
                assert [(str(a.kind).replace("I", "B"), a.microbatch, a.segment) for a in acts
                        if str(a.kind) != "W"] == folded


@pytest.mark.parametrize("p", [2, 3, 4])
def test_cooldown_weights_beat_1f1b_under_unit_costs(p: int) -> None:
    costs = Costs()  # F = 1, B = 2 of which W = 1
    for m in range(1, 10):
        one = simulate(build_plan("1f1b", p, m), costs).makespan
        zb = simulate(cooldown_weights(build_plan("zb_h1", p, m), set(range(1, p))), costs).makespan
        assert zb <= one
        if m >= 2:
            assert zb < one, (p, m, zb, one)


def test_rank_plan_gives_w_only_to_a_rank_that_splits() -> None:
    section = PipelineSection(num_stages=2, num_microbatches=4, active_microbatches=None, schedule="zb_h1",
                              virtual_stages=1)
    plans = [rank_plan(section, [0, 1], True, r, light=set(), forward_active=4, split_weights=True) for r in (0, 1)]
    assert plans[0].every == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    assert plans[1].every == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3),
                              ("W", 2), ("W", 3)]
    # Without the executor's ability (tensor parallelism), or on a chain that visits rank 1 twice: no W.
    assert ("W", 3) not in rank_plan(section, [0, 1], True, 1, light=set(), forward_active=4).every
    assert not splits([0, 1, 0, 1], 1)
    looped = rank_plan(section, [0, 1, 0, 1], True, 1, light=set(), forward_active=4, split_weights=True)
    assert all(kind != "W" for kind, _ in looped.every)


def test_with_costs_only_the_ws_that_shorten_the_step_stay_apart() -> None:
    """A split backward costs `SPLIT_COST` times a whole one: deferring a W pays only where the ranks
    before it have that much work left to overlap it with."""
    # 2 ranks, balanced: rank 0's last backward (2.0) hides one deferred W (1.15), not two.
    even = Costs(forward=1.0, backward=2.0, backward_weight=1.0)
    got = cooldown_weights(build_plan("zb_h1", 2, 4), {1}, even)
    assert [(str(a.kind), a.microbatch) for a in got.actions[1] if str(a.kind) in ("I", "W")] == [("I", 3), ("W", 3)]
    validate_plan(got)
    # Rank 0 with almost nothing to do at the end: no W is worth its split.
    light = Costs(forward=[0.1, 1.0], backward=[0.1, 2.0], backward_weight=[0.05, 1.0])
    assert all(str(a.kind) != "W" for a in cooldown_weights(build_plan("zb_h1", 2, 4), {1}, light).actions[1])
    # Without costs every W of the cool-down stays apart (the theory's plans).
    assert [a.microbatch for a in cooldown_weights(build_plan("zb_h1", 2, 4), {1}).actions[1]
            if str(a.kind) == "W"] == [2, 3]


def test_the_merged_v_beats_1f1b_on_a_balanced_split() -> None:
    """An executor that records the V with its bottom merged (``0 1 0``): the first and the last quarter
    of the model on rank 0, the middle half on rank 1. The plan idles only for the first quarter's
    forward and backward, against half the model's in 1F1B on a 2-stage split of the same model."""
    quarter = Costs(forward=[1.0, 2.0, 1.0], backward=[2.0, 4.0, 2.0], backward_weight=[1.0, 2.0, 1.0])
    half = Costs(forward=2.0, backward=4.0, backward_weight=2.0)
    section = PipelineSection(num_stages=2, num_microbatches=8, active_microbatches=None, schedule="zb_v",
                              virtual_stages=2)
    plans = [rank_plan(section, [0, 1, 0], True, r, light=set(), costs=quarter, forward_active=4, split_weights=True)
             for r in (0, 1)]
    assert all(kind != "W" for kind, _ in plans[0].every)  # the step body's rank keeps whole backwards
    assert [a for a in plans[1].every if a[0] == "W"] == [("W", 7)]
    plan = cooldown_weights(build_plan("zb_v", 2, 8, chain=(0, 1, 0), costs=quarter), {1}, quarter)
    v = simulate(plan, quarter).makespan
    one = simulate(build_plan("1f1b", 2, 8), half).makespan
    assert one == 9 * 6.0 and v <= 8 * 6.0 + 3.0, (v, one)
    # The V's peak: 2p microbatches' first segment on rank 0 (each a quarter), p halves on rank 1.
    assert simulate(plan, quarter).peak_in_flight == [4, 3]
