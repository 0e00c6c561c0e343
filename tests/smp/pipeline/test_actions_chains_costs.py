"""Actions, chains and costs: the small value types."""

from __future__ import annotations

import math

import pytest

from smp.errors import ScheduleError
from smp.pipeline import Action, ActionKind, Costs, parse_chain, vee_chain
from smp.pipeline.actions import COMM_KINDS, COMPUTE_KINDS
from smp.pipeline.chains import check_chain, looped_chain, segments_by_rank


@pytest.mark.parametrize("kind", list(ActionKind))
def test_every_kind_round_trips_through_text(kind: ActionKind) -> None:
    peer = 3 if kind in COMM_KINDS else None
    action = Action(kind, microbatch=12, segment=7, peer=peer)
    assert Action.parse(str(action)) == action


def test_text_form_matches_torch_ir_for_compute_actions() -> None:
    assert str(Action(ActionKind.FORWARD, 0, 2)) == "2F0"
    assert str(Action(ActionKind.BACKWARD_WEIGHT, 5, 1)) == "1W5"
    assert str(Action(ActionKind.SEND_F, 3, 1, 2)) == "1SEND_F3>2"
    assert str(Action(ActionKind.RECV_B, 3, 1, 2)) == "1RECV_B3<2"
    assert COMPUTE_KINDS.isdisjoint(COMM_KINDS) and len(COMPUTE_KINDS | COMM_KINDS) == len(ActionKind)


@pytest.mark.parametrize("token", ["F0", "2X0", "1SEND_F3", "1SEND_F3<2", "1F3>2", "", "a1F2"])
def test_bad_tokens_are_rejected_with_the_expected_form(token: str) -> None:
    with pytest.raises(ScheduleError, match="cannot read action"):
        Action.parse(token)


def test_chains() -> None:
    assert looped_chain(3, 2) == (0, 1, 2, 0, 1, 2)
    assert vee_chain(3) == (0, 1, 2, 2, 1, 0)
    assert vee_chain(2, legs=3) == (0, 1, 1, 0, 0, 1)
    assert parse_chain("0,1,0") == (0, 1, 0)
    assert parse_chain("0 -> 1 -> 2") == (0, 1, 2)
    assert segments_by_rank((0, 1, 0, 2), 3) == [[0, 2], [1], [3]]
    assert check_chain((0, 1, 0), 2) == []
    assert any("outside 0..1" in p for p in check_chain((0, 2), 2))
    assert any("empty" in p for p in check_chain((), 2))
    with pytest.raises(ScheduleError, match="rank numbers"):
        parse_chain("0,x")


def test_costs_broadcast_and_split() -> None:
    resolved = Costs(forward=[1, 2, 3], backward=4, backward_weight=1.5, latency=0.5, message_bytes=10, bandwidth=5).resolve(3)
    assert resolved.forward == (1.0, 2.0, 3.0)
    assert resolved.backward_input == (2.5, 2.5, 2.5)
    assert resolved.backward_weight == (1.5, 1.5, 1.5)
    assert resolved.message == (2.5, 2.5, 2.5)  # 0.5 + 10 / 5
    assert Costs().resolve(1).message == (0.0,)
    assert Costs(bandwidth=math.inf, message_bytes=1e9).resolve(1).message == (0.0,)


def test_costs_report_every_problem_at_once() -> None:
    with pytest.raises(ScheduleError) as err:
        Costs(forward=[1, 2], backward=-1, backward_weight=5, latency=-1, bandwidth=0).resolve(3)
    text = str(err.value)
    for needle in ("costs.forward has 2 values", "costs.backward=", "must not exceed", "costs.latency", "costs.bandwidth"):
        assert needle in text


def test_costs_parse() -> None:
    assert Costs.parse("1,2,1") == Costs(1.0, 2.0, 1.0)
    assert Costs.parse("1,3") == Costs(1.0, 3.0, 1.5)
    for bad in ("1", "a,b,c", "1,2,3,4", "1,1,2"):
        with pytest.raises(ScheduleError):
            Costs.parse(bad)
