"""The validator: each kind of broken plan is caught, located and drawn."""

from __future__ import annotations

import pytest

from smp.errors import ScheduleError
from smp.pipeline import Action, Plan, build_plan, check_plan, format_grid, lower, validate_plan
from smp.pipeline.actions import BACKWARD, FORWARD, RECV_B, RECV_F, SEND_B, SEND_F


def plan_of(rows: dict[int, str], *, chain: tuple[int, ...] = (0, 1), m: int = 1, active: int | None = None, forward_only: bool = False) -> Plan:
    actions = {r: [Action.parse(t) for t in text.split()] for r, text in rows.items()}
    return Plan("custom", max(chain) + 1, m, chain, active or m, actions, forward_only)


def messages(plan: Plan) -> list[str]:
    return [p.message for p in check_plan(plan)]


def test_valid_plans_have_no_problems() -> None:
    assert check_plan(plan_of({0: "0F0 0B0", 1: "1F0 1B0"})) == []
    assert check_plan(plan_of({0: "0F0 0SEND_F0>1 0RECV_B0<1 0B0", 1: "1RECV_F0<0 1F0 1B0 1SEND_B0>0"})) == []


def test_backward_before_its_forward_on_the_same_rank() -> None:
    found = check_plan(plan_of({0: "0F0 0B0", 1: "1B0 1F0"}))
    on_rank_1 = [p for p in found if p.rank == 1]
    assert [(p.index, p.message) for p in on_rank_1] == [
        (0, "order error: rank 1 action #0 needs the activation of microbatch 0 in segment 1, "
            "which this rank runs later (action #1)")
    ]
    assert [p.rank for p in found] == [0, 1]  # rank 0 waits for the gradient rank 1 never sends


def test_cross_rank_cycle_is_reported_on_both_ranks() -> None:
    # rank 0 wants B0 before F1; rank 1 wants F1 before B0 (whose gradient rank 0 needs).
    plan = plan_of({0: "0F0 0B0 0F1 0B1", 1: "1F0 1F1 1B0 1B1"}, m=2)
    found = check_plan(plan)
    assert {p.rank for p in found} == {0, 1}
    assert any("blocked at 1F1" in p.message for p in found)


def test_missing_and_duplicate_actions() -> None:
    text = " ".join(messages(plan_of({0: "0F0 0F0", 1: "1F0 1B0"})))
    assert "runs twice" in text
    assert "missing actions: 0B0" in text


def test_wrong_rank_segment_and_microbatch() -> None:
    text = " ".join(messages(plan_of({0: "0F0 1F0 0B0 0F7", 1: "1B0"})))
    assert "segment 1 runs on rank 1, not here" in text
    assert "microbatch 7 is not in 0..0" in text
    assert "segment 9 is not in the chain" in " ".join(messages(plan_of({0: "0F0 0B0 9F0", 1: "1F0 1B0"})))


def test_mixed_full_and_split_backward_is_rejected() -> None:
    text = " ".join(messages(plan_of({0: "0F0 0B0 0I0 0W0", 1: "1F0 1B0"})))
    assert "both B and I/W" in text


def test_forward_only_plans_reject_backwards() -> None:
    plan = plan_of({0: "0F0", 1: "1F0 1B0"}, forward_only=True)
    assert any("forward-only" in m for m in messages(plan))
    assert check_plan(plan_of({0: "0F0", 1: "1F0"}, forward_only=True)) == []


def test_rendezvous_deadlock_in_a_lowered_plan() -> None:
    # Both ranks send first: rank 0 sends microbatch 1's activation while rank 1 sends
    # microbatch 0's gradient. Under blocking point-to-point nobody receives: a deadlock.
    rows = {
        0: "0F0 0SEND_F0>1 0F1 0SEND_F1>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1",
        1: "1RECV_F0<0 1F0 1B0 1SEND_B0>0 1RECV_F1<0 1F1 1B1 1SEND_B1>0",
    }
    found = check_plan(plan_of(rows, m=2))
    assert found and all("deadlock" in p.message for p in found)
    assert {(p.rank, p.index) for p in found} == {(0, 3), (1, 3)}
    # the same messages, receives first on rank 1: runs
    rows[1] = "1RECV_F0<0 1F0 1RECV_F1<0 1B0 1SEND_B0>0 1F1 1B1 1SEND_B1>0"
    assert check_plan(plan_of(rows, m=2)) == []


def test_lowered_plan_message_checks() -> None:
    text = " ".join(messages(plan_of({0: "0F0 0SEND_F0>0 0B0", 1: "1RECV_F0<0 1F0 1B0 1SEND_B0>0"})))
    assert "the peer of this message is rank 1" in text
    assert "missing actions: 0RECV_B0" in text
    same_rank = plan_of({0: "0F0 0SEND_F0>0 1RECV_F0<0 1F0 1B0 0B0"}, chain=(0, 0))
    assert any("same rank exchange nothing" in m for m in messages(same_rank))
    assert any("no segment on the other side" in m for m in messages(plan_of({0: "0F0 0B0 0SEND_B0>1", 1: "1F0 1B0"})))


def test_in_flight_cap() -> None:
    plan = plan_of({0: "0F0 0F1 0F2 0B0 0B1 0B2", 1: "1F0 1B0 1F1 1B1 1F2 1B2"}, m=3, active=2)
    (problem,) = check_plan(plan)
    assert (problem.rank, problem.index) == (0, 2)
    assert "3 microbatches in flight ([0, 1, 2]), above active_microbatches=2" in problem.message


def test_header_problems_stop_early() -> None:
    plan = Plan("x", 2, 0, (0, 3), 0, {5: []})
    text = " ".join(messages(plan))
    for needle in ("num_microbatches=0", "active_microbatches=0", "outside 0..1", "rank(s) [5]"):
        assert needle in text


def test_error_shows_the_grid_with_the_failing_cells_marked() -> None:
    with pytest.raises(ScheduleError) as err:
        validate_plan(plan_of({0: "0F0 0B0", 1: "1B0 1F0"}))
    text = str(err.value)
    assert "invalid plan 'custom'" in text
    assert "1B0!" in text  # the marked cell
    assert "step rank0 rank1" in text


def test_torch_1f1b_display_order_is_rejected() -> None:
    """peers.md 1.5: torch's Schedule1F1B display IR shifts the last rank's microbatches by one."""
    ours = build_plan("1f1b", 2, 4)
    last = "1F1 1B0 1F2 1B1 1F3 1B2 1F4 1B3"  # what torch 2.13 _get_pipeline_order shows for rank 1
    torch_like = ours.with_actions({0: ours.actions[0], 1: [Action.parse(t) for t in last.split()]})
    text = " ".join(p.message for p in check_plan(torch_like))
    assert "microbatch 4 is not in 0..3" in text
    assert "missing actions: 1F0" in text


def test_kinds_in_plan_of_helper() -> None:
    plan = plan_of({0: "0F0 0SEND_F0>1 0RECV_B0<1 0B0", 1: "1RECV_F0<0 1F0 1B0 1SEND_B0>0"})
    kinds = [a.kind for a in plan.actions[0]] + [a.kind for a in plan.actions[1]]
    assert kinds == [FORWARD, SEND_F, RECV_B, BACKWARD, RECV_F, FORWARD, BACKWARD, SEND_B]


def test_random_broken_plans_raise_schedule_error_and_nothing_else() -> None:
    """Shuffled, truncated and corrupted plans: always a ScheduleError with a drawn grid, never a crash."""
    import random

    rng = random.Random(7)
    kinds = ["F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B"]
    for trial in range(300):
        base = build_plan(rng.choice(["1f1b", "zb_v", "interleaved", "gpipe"]), rng.randint(1, 4), rng.randint(1, 5))
        if trial % 2:
            base = lower(base)
        actions = {r: list(a) for r, a in base.actions.items()}
        for _ in range(rng.randint(1, 4)):
            r = rng.randrange(base.num_ranks)
            what = rng.randrange(4)
            if what == 0 and actions[r]:
                actions[r].pop(rng.randrange(len(actions[r])))
            elif what == 1:
                rng.shuffle(actions[r])
            elif what == 2:
                peer = rng.randrange(base.num_ranks + 1)
                kind = rng.choice(kinds)
                token = f"{rng.randrange(base.num_segments + 1)}{kind}{rng.randrange(base.num_microbatches + 1)}"
                token += (">" if kind.startswith("SEND") else "<") + str(peer) if kind in kinds[4:] else ""
                actions[r].insert(rng.randrange(len(actions[r]) + 1), Action.parse(token))
            elif actions[r]:
                i = rng.randrange(len(actions[r]))
                actions[r].insert(i, actions[r][i])
        broken = base.with_actions(actions)
        if not check_plan(broken):
            continue  # a shuffle can leave a valid plan
        with pytest.raises(ScheduleError) as err:
            validate_plan(broken)
        assert "invalid plan" in str(err.value) and "step rank0" in str(err.value)
        assert format_grid(broken)  # drawing an invalid plan never fails
