"""Lowering: explicit sends and receives in an order that cannot deadlock under blocking P2P."""

from __future__ import annotations

import pytest

from smp.pipeline import SCHEDULES, Costs, build_plan, check_plan, lower, parse_grid, simulate
from smp.pipeline.actions import COMM_KINDS
from smp.pipeline.chains import vee_chain


def test_1f1b_two_ranks() -> None:
    lowered = lower(build_plan("1f1b", 2, 2))
    assert [" ".join(map(str, lowered.actions[r])) for r in range(2)] == [
        "0F0 0SEND_F0>1 0F1 0SEND_F1>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1",
        "1RECV_F0<0 1F0 1RECV_F1<0 1B0 1SEND_B0>0 1F1 1B1 1SEND_B1>0",
    ]


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_lowered_plans_validate_and_keep_the_compute_order(name: str) -> None:
    for chain in [(0, 1, 2, 3), (0, 1, 2, 3, 0), vee_chain(4)]:
        plan = build_plan(name, 4, 9, chain=chain)
        lowered = lower(plan, Costs(forward=[1, 2, 1, 3, 1, 1, 2, 1][: len(chain)], latency=0.5))
        assert check_plan(lowered) == []
        assert lowered.compute_only() == plan
        sends = sum(1 for acts in lowered.actions.values() for a in acts if a.kind.value.startswith("SEND"))
        crossings = sum(1 for s in range(len(chain) - 1) if chain[s] != chain[s + 1])
        assert sends == 9 * crossings * (1 if plan.forward_only else 2)
        # messages do not change the simulated timing
        assert simulate(lowered).makespan == simulate(plan).makespan


def test_same_rank_neighbours_exchange_nothing() -> None:
    lowered = lower(build_plan("zb_v", 2, 3))  # chain 0 1 1 0: segments 1 and 2 share rank 1
    comms = [a for acts in lowered.actions.values() for a in acts if a.kind in COMM_KINDS]
    assert all({a.segment, a.segment + (1 if a.kind.value in ("SEND_F", "RECV_B") else -1)} != {1, 2} for a in comms)


def test_lowering_an_invalid_plan_is_refused() -> None:
    from smp.errors import ScheduleError

    plan = parse_grid("plan x ranks=2 microbatches=1 active=1 chain=0,1\nstep rank0 rank1\n0 0F0 1B0\n1 0B0 1F0")
    with pytest.raises(ScheduleError, match="invalid plan"):
        lower(plan)
