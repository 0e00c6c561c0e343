"""The text grid: every plan prints and parses back exactly."""

from __future__ import annotations

import pytest

from smp.errors import ScheduleError
from smp.pipeline import SCHEDULES, build_plan, format_grid, lower, parse_grid
from smp.pipeline.chains import vee_chain

CASES = [(name, p, m) for name in SCHEDULES for p, m in ((1, 1), (2, 3), (4, 8), (3, 7))]


@pytest.mark.parametrize(("name", "p", "m"), CASES)
def test_grid_round_trips(name: str, p: int, m: int) -> None:
    plan = build_plan(name, p, m)
    assert parse_grid(format_grid(plan)) == plan
    lowered = lower(plan)
    assert parse_grid(format_grid(lowered)) == lowered


def test_round_trip_keeps_chain_name_cap_and_forward_only() -> None:
    plan = build_plan("_only_forward", 3, 5, chain=(0, 1, 2, 0), active_microbatches=2)
    back = parse_grid(format_grid(plan))
    assert (back.chain, back.name, back.active_microbatches, back.forward_only) == ((0, 1, 2, 0), "_only_forward", 2, True)


def test_grid_places_actions_in_dependency_time_steps() -> None:
    text = format_grid(build_plan("1f1b", 2, 2))
    assert text.splitlines() == [
        "plan 1f1b ranks=2 microbatches=2 active=2 chain=0,1",
        "step rank0 rank1",
        "0    0F0   .",
        "1    0F1   1F0",
        "2    .     1B0",
        "3    0B0   1F1",
        "4    .     1B1",
        "5    0B1   .",
    ]


def test_orders_show_segments_only_where_a_rank_runs_several() -> None:
    plan = build_plan("zb_v", 2, 2)
    lines = plan.orders().splitlines()
    assert lines[0].startswith("rank 0: 0F0 0F1 3F0")
    linear = build_plan("gpipe", 2, 2).orders().splitlines()
    assert linear == ["rank 0: F0 F1 B0 B1", "rank 1: F0 F1 B0 B1"]
    assert build_plan("zb_v", 2, 2).chain == vee_chain(2)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "empty"),
        ("schedule x", "expected 'plan NAME"),
        ("plan x ranks=2 microbatches=1 chain=0,1", "missing ['active']"),
        ("plan x ranks=2 microbatches=1 active=1 chain=0,1 color=red", "unknown ['color']"),
        ("plan x ranks=two microbatches=1 active=1 chain=0,1", "integers"),
        ("plan x ranks=2 microbatches=1 active=1 chain=0,1\nstep rank0", "expected columns"),
        ("plan x ranks=2 microbatches=1 active=1 chain=0,1\nrank0 rank1", "column header"),
        ("plan x ranks=2 microbatches=1 active=1 chain=0,1\nstep rank0 rank1\n0 0F0 . .", "up to 2 cells"),
        ("plan x ranks=2 microbatches=1 active=1 chain=0,1\nstep rank0 rank1\n0 0F0 1Q0", "line 3, rank 1"),
    ],
)
def test_parse_errors_name_the_line(text: str, needle: str) -> None:
    with pytest.raises(ScheduleError, match="cannot read plan") as err:
        parse_grid(text)
    assert needle in str(err.value)
