"""The simulator: times, idle, bubble definitions, memory, messages, and agreement with the builder."""

from __future__ import annotations

import pytest

from smp.errors import ScheduleError
from smp.pipeline import Action, Costs, build_plan, parse_grid, simulate
from smp.pipeline.greedy import run_rule
from smp.pipeline.schedules.smp_v1 import InterleavedRule


def test_single_rank_has_no_bubble() -> None:
    result = simulate(build_plan("1f1b", 1, 4))
    assert (result.makespan, result.idle, result.bubble_fraction, result.wall_share) == (12.0, [0.0], 0.0, 0.0)


def test_bubble_and_wall_share_definitions() -> None:
    result = simulate(build_plan("gpipe", 4, 8))
    idle, busy = sum(result.idle), sum(result.busy)
    assert result.bubble_fraction == idle / busy
    assert result.wall_share == idle / (4 * result.makespan)
    assert result.wall_share == pytest.approx(result.bubble_fraction / (1 + result.bubble_fraction))


def test_per_segment_costs_move_the_bottleneck() -> None:
    costs = Costs(forward=[1, 3], backward=[2, 6], backward_weight=[1, 3])
    result = simulate(build_plan("1f1b", 2, 4), costs)
    assert result.busy == [12.0, 36.0]
    # rank 1 works back to back once F0 arrives (1 + 4 * 9), then rank 0 runs the last B (2)
    assert result.makespan == 39.0
    assert result.idle == [27.0, 3.0]


def test_message_latency_delays_cross_rank_dependencies_only() -> None:
    base = simulate(build_plan("gpipe", 2, 1)).makespan  # F0 F0 B0 B0 = 6
    assert base == 6.0
    assert simulate(build_plan("gpipe", 2, 1), Costs(latency=0.5)).makespan == 7.0  # one hop each way
    same_rank = build_plan("gpipe", 1, 1, chain=(0, 0))
    assert simulate(same_rank, Costs(latency=5)).makespan == 6.0
    sized = Costs(message_bytes=[8, 0], bandwidth=4.0, latency=0.25)  # 0.25 + 8/4
    assert simulate(build_plan("gpipe", 2, 1), sized).makespan == 6.0 + 2 * 2.25


def test_memory_counts_microbatches_and_bytes_per_segment() -> None:
    plan = build_plan("gpipe", 2, 3, chain=(0, 1, 0))
    result = simulate(plan, Costs(activation_bytes=[1.0, 10.0, 100.0]))
    assert result.peak_in_flight == [3, 3]
    assert result.peak_activation_bytes == [303.0, 30.0]


def test_split_backward_holds_until_w_and_forward_only_frees_at_once() -> None:
    plan = parse_grid("""
plan custom ranks=1 microbatches=2 active=2 chain=0
step rank0
0    0F0
1    0I0
2    0F1
3    0W0
4    0I1
5    0W1
""")
    assert simulate(plan).peak_in_flight == [2]  # microbatch 0 is held until its W
    assert simulate(build_plan("_only_forward", 2, 6)).peak_in_flight == [1, 1]


def test_frees_come_before_allocations_at_the_same_time() -> None:
    # 1F1B rank 0 of 2: F0 F1 (B0 F2) ... B0 ends exactly when F2 starts: still 2 held, not 3
    assert simulate(build_plan("1f1b", 2, 6)).peak_in_flight == [2, 1]


def test_rank_outside_the_chain_is_all_bubble() -> None:
    result = simulate(build_plan("gpipe", 3, 2, chain=(0, 1)))
    assert result.busy[2] == 0.0 and result.idle[2] == result.makespan
    assert result.bubble_fraction == sum(result.idle) / sum(result.busy)


def test_invalid_plans_are_refused() -> None:
    bad = build_plan("gpipe", 2, 1).with_actions({0: [Action.parse("0F0")], 1: [Action.parse("1F0")]})
    with pytest.raises(ScheduleError, match="missing actions"):
        simulate(bad)


def test_timeline_matches_the_builders_simulation() -> None:
    """A dynamic rule's own simulation and `simulate` of the plan it produced agree exactly."""
    costs = Costs(forward=[1.0, 1.5, 0.5], backward=[2.0, 3.0, 1.0], latency=0.25)
    chain = (0, 1, 0)
    plan = build_plan("interleaved", 2, 7, chain=chain, costs=costs)
    timeline = simulate(plan, costs).timeline
    order = run_rule(InterleavedRule(4), num_ranks=2, num_microbatches=7, chain=chain, costs=costs.resolve(3), label="x")
    assert [[str(a) for a in acts] for acts in order] == [[str(a) for a in plan.actions[r]] for r in range(2)]
    for lane in timeline.by_rank():
        for before, after in zip(lane, lane[1:], strict=False):
            assert before.end <= after.start  # one action at a time per rank
    assert timeline.makespan == simulate(plan, costs).makespan


def test_to_dict_is_json_ready() -> None:
    import json

    data = simulate(build_plan("1f1b", 4, 8)).to_dict()
    assert json.loads(json.dumps(data))["peak_in_flight"] == [4, 3, 2, 1]
    assert set(data) >= {"bubble_fraction", "wall_share", "makespan", "peak_in_flight", "peak_activation_bytes"}
