"""Choosing a rank's executable plan: (kind, microbatch) lists from a schedule, and costs from durations."""

from __future__ import annotations

import itertools

import pytest

from smp.config import PipelineSection
from smp.errors import ScheduleError
from smp.pipeline import SCHEDULES, build_plan
from smp.pipeline.choose import RankPlan, rank_plan, segment_costs

CHAINS = {2: [[0, 1], [0, 1, 0], [0, 1, 1, 0]], 3: [[0, 1, 2], [0, 1, 2, 1, 0]]}


def _section(schedule: str, p: int, m: int, active: int | None = None) -> PipelineSection:
    return PipelineSection(num_stages=p, num_microbatches=m, active_microbatches=active, schedule=schedule,
                           virtual_stages=1)


def _buildable(schedule: str, p: int, m: int, chain: list[int]) -> bool:
    try:
        build_plan(schedule, p, m, chain=chain)
    except ScheduleError:
        return False
    return True


CASES = [(name, p, m, chain) for name in SCHEDULES if name != "_only_forward" for p, chains in CHAINS.items()
         for m in (1, 2, 5) for chain in chains if _buildable(name, p, m, chain)]


@pytest.mark.parametrize(("name", "p", "m", "chain"), CASES)
def test_every_rank_gets_each_visit_once_as_f_and_b_in_the_schedules_order(name: str, p: int, m: int,
                                                                          chain: list[int]) -> None:
    plan = build_plan(name, p, m, chain=chain)
    for rank in range(p):
        got = rank_plan(_section(name, p, m), chain, True, rank, light=set(), forward_active=m)
        expected = [("B" if str(a.kind) in ("B", "I") else "F", a.microbatch) for a in plan.actions[rank]
                    if str(a.kind) != "W"]
        assert got == RankPlan(expected, expected, [])
        visits = chain.count(rank)
        for kind, mb in itertools.product("FB", range(m)):
            assert got.every.count((kind, mb)) == visits


@pytest.mark.parametrize(("name", "p", "m", "chain"), CASES)
def test_light_actions_are_named_by_kind_and_ordinal_and_leave_the_baton_plan(name: str, p: int, m: int,
                                                                             chain: list[int]) -> None:
    light = {("F", 1), ("B", 0)}
    for rank in range(p):
        every = rank_plan(_section(name, p, m), chain, True, rank, light=set(), forward_active=m).every
        got = rank_plan(_section(name, p, m), chain, True, rank, light=light, forward_active=m)
        assert got.every == every
        seen: dict[tuple[str, int], int] = {}
        baton, lights = [], []
        for kind, mb in every:
            ordinal = seen.get((kind, mb), 0)
            seen[(kind, mb)] = ordinal + 1
            (lights if (kind, ordinal) in light else baton).append((kind, mb))
        assert (got.baton, got.light) == (baton, lights)


def test_weight_gradients_vanish_and_input_gradients_become_backwards() -> None:
    plan = build_plan("zb_h1", 3, 4)
    assert {str(a.kind) for a in plan.actions[0]} >= {"I", "W"}
    got = rank_plan(_section("zb_h1", 3, 4), [0, 1, 2], True, 0, light=set(), forward_active=4)
    assert got.every == [("B" if str(a.kind) == "I" else "F", a.microbatch) for a in plan.actions[0]
                         if str(a.kind) != "W"]


def test_a_forward_only_step_runs_only_forward_with_the_configs_cap_whatever_the_schedule() -> None:
    section = _section("1f1b", 2, 6, active=None)
    got = rank_plan(section, [0, 1], False, 1, light=set(), forward_active=2)
    plan = build_plan("_only_forward", 2, 6, chain=[0, 1], active_microbatches=2)
    assert got.every == [("F", a.microbatch) for a in plan.actions[1]]
    assert all(kind == "F" for kind, _ in got.every) and len(got.every) == 6


def test_the_sections_cap_reaches_the_schedule() -> None:
    capped = rank_plan(_section("interleaved", 2, 6, active=2), [0, 1], True, 0, light=set(), forward_active=6)
    plan = build_plan("interleaved", 2, 6, chain=[0, 1], active_microbatches=2)
    assert capped.every == [(str(a.kind), a.microbatch) for a in plan.actions[0]]


def test_measured_costs_reach_the_dynamic_rules() -> None:
    costs = segment_costs([0, 1], [{("F", 0): 1.0, ("B", 0): 2.0}, {("F", 0): 5.0, ("B", 0): 10.0}])
    section = _section("interleaved", 2, 4)
    got = rank_plan(section, [0, 1], True, 0, light=set(), costs=costs, forward_active=4)
    plan = build_plan("interleaved", 2, 4, chain=[0, 1], active_microbatches=section.active_microbatches,
                      costs=costs)
    assert got.every == [(str(a.kind), a.microbatch) for a in plan.actions[0]]


def test_an_unbuildable_chain_raises_the_schedule_error() -> None:
    with pytest.raises(ScheduleError):
        rank_plan(_section("1f1b", 2, 2), [0, 2], True, 0, light=set(), forward_active=2)


def test_segment_costs_take_the_rank_and_ordinal_of_each_segment() -> None:
    per_rank = [{("F", 0): 1.0, ("F", 1): 3.0, ("B", 0): 6.0, ("B", 1): 2.0}, {("F", 0): 2.0, ("B", 0): 4.0}]
    costs = segment_costs([0, 1, 0], per_rank)
    assert costs is not None
    assert costs.forward == [1.0, 2.0, 3.0]
    assert costs.backward == [2.0, 4.0, 6.0]  # segment 0's backward is rank 0's second (one later visit)
    assert costs.backward_weight == [1.0, 2.0, 3.0]


def test_segment_costs_floor_at_a_microsecond_and_are_none_when_a_duration_is_missing() -> None:
    costs = segment_costs([0, 1], [{("F", 0): 0.0, ("B", 0): 0.0}, {("F", 0): 1.0, ("B", 0): 1.0}])
    assert costs is not None and costs.forward == [1e-6, 1.0] and costs.backward == [1e-6, 1.0]
    assert segment_costs([0, 1], [{("F", 0): 1.0, ("B", 0): 1.0}, {("F", 0): 1.0}]) is None
    assert segment_costs([0, 1, 0], [{("F", 0): 1.0, ("B", 0): 1.0, ("B", 1): 1.0}, {("F", 0): 1.0, ("B", 0): 1.0}]) \
        is None
