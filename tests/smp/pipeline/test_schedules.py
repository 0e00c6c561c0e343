"""Each builder against its definition: SMP v1's documented order, Megatron's and torch's loops."""

from __future__ import annotations

import pytest

from smp.errors import ScheduleError
from smp.pipeline import SCHEDULES, Costs, build_plan, simulate
from smp.pipeline.chains import looped_chain, vee_chain
from smp.pipeline.schedules.template import group_size

from .references import megatron_1f1b, torch_interleaved

EXPECTED_NAMES = ["simple", "interleaved", "gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v", "_only_forward"]


def tokens(plan_actions: dict[int, list[object]]) -> list[list[str]]:
    return [[str(a) for a in plan_actions[r]] for r in sorted(plan_actions)]


def lanes(name: str, p: int, m: int, **kwargs: object) -> list[str]:
    return build_plan(name, p, m, **kwargs).orders().splitlines()  # type: ignore[arg-type]


def test_registry_names_are_the_config_values() -> None:
    assert list(SCHEDULES) == EXPECTED_NAMES


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ScheduleError) as err:
        build_plan("pipedream", 2, 2)
    assert "pipeline='pipedream'" in str(err.value)
    for name in EXPECTED_NAMES:
        assert name in str(err.value)


def test_bad_inputs_are_all_listed() -> None:
    with pytest.raises(ScheduleError) as err:
        build_plan("1f1b", 0, 0, active_microbatches=0, virtual_stages=0)
    text = str(err.value)
    for needle in ("num_ranks=0", "num_microbatches=0", "active_microbatches=0", "virtual_stages=0"):
        assert needle in text
    with pytest.raises(ScheduleError, match="outside 0..1"):
        build_plan("1f1b", 2, 2, chain=(0, 1, 2))
    with pytest.raises(ScheduleError, match="zb_v runs exactly 2 segments per rank"):
        build_plan("zb_v", 2, 2, virtual_stages=3)


@pytest.mark.parametrize("m", [6, 12])
def test_smp_interleaved_reproduces_the_documented_order(m: int) -> None:
    """smp-api.md 3.4: pp=3, active_microbatches = pp + 2, equal forward and backward times."""
    got = lanes("interleaved", 3, m)
    assert got[2].startswith("rank 2: F0 B0 F1 B1 F2 B2")
    assert got[1].startswith("rank 1: F0 F1 F2 B0 F3 B1")
    assert got[0].startswith("rank 0: F0 F1 F2 F3 F4 B0 F5 B1")
    assert build_plan("interleaved", 3, m).active_microbatches == 5
    # explicit costs with B = F give the same order
    assert lanes("interleaved", 3, m, costs=Costs(forward=2, backward=2, backward_weight=1)) == got


def test_smp_interleaved_follows_the_costs() -> None:
    """With B = 2F, rank 1 has F3 ready at 4 and B0 only at 5: the dynamic rule runs F3 first."""
    got = lanes("interleaved", 3, 8, costs=Costs(forward=1, backward=2))
    assert got[1].startswith("rank 1: F0 F1 F2 F3 B0")


def test_smp_interleaved_admission_cap() -> None:
    got = lanes("interleaved", 3, 8, active_microbatches=2)
    assert got[0] == "rank 0: F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7"
    assert build_plan("interleaved", 3, 8, active_microbatches=2).active_microbatches == 2
    assert build_plan("interleaved", 3, 4, active_microbatches=9).active_microbatches == 4  # clipped to m


def test_simple_runs_windows_of_active_microbatches() -> None:
    """smp-api.md 3.4: 'F0 F1 B0 B1 F2 F3 B2 B3 ... when admission is limited to 2'."""
    assert lanes("simple", 2, 4, active_microbatches=2) == [
        "rank 0: F0 F1 B0 B1 F2 F3 B2 B3",
        "rank 1: F0 F1 B0 B1 F2 F3 B2 B3",
    ]
    assert lanes("simple", 3, 5, active_microbatches=2)[0] == "rank 0: F0 F1 B0 B1 F2 F3 B2 B3 F4 B4"


def test_gpipe_fills_then_drains() -> None:
    assert lanes("gpipe", 3, 4) == ["rank 0: F0 F1 F2 F3 B0 B1 B2 B3"] * 1 + [
        "rank 1: F0 F1 F2 F3 B0 B1 B2 B3",
        "rank 2: F0 F1 F2 F3 B0 B1 B2 B3",
    ]


def test_only_forward_has_no_backward() -> None:
    plan = build_plan("_only_forward", 3, 6)
    assert plan.forward_only
    assert all(a.kind.value == "F" for acts in plan.actions.values() for a in acts)
    assert plan.active_microbatches == 5


@pytest.mark.parametrize("p", range(1, 9))
def test_1f1b_is_megatrons_order(p: int) -> None:
    for m in range(1, 33):
        assert tokens(build_plan("1f1b", p, m).actions) == megatron_1f1b(p, m), (p, m)


@pytest.mark.parametrize(("p", "v"), [(2, 2), (3, 2), (4, 2), (4, 3), (4, 4), (8, 2)])
def test_interleaved_1f1b_is_torch_interleaved1f1b(p: int, v: int) -> None:
    for m in range(1, 33):
        if m % max(1, m // p):
            continue  # torch refuses these microbatch counts
        plan = build_plan("interleaved_1f1b", p, m, virtual_stages=v)
        assert plan.chain == looped_chain(p, v)
        assert tokens(plan.actions) == torch_interleaved(p, v, m), (p, v, m)


@pytest.mark.parametrize(("p", "v"), [(2, 2), (3, 2), (4, 2), (4, 4), (8, 2)])
def test_zb_h1_on_loops_is_torch_interleaved_zero_bubble(p: int, v: int) -> None:
    for m in range(1, 33):
        if m % max(1, m // p):
            continue
        plan = build_plan("zb_h1", p, m, virtual_stages=v)
        assert tokens(plan.actions) == torch_interleaved(p, v, m, zero_bubble=True), (p, v, m)


def test_zb_v_uses_the_v_and_falls_back_elsewhere() -> None:
    plan = build_plan("zb_v", 4, 8)
    assert plan.chain == vee_chain(4)
    assert plan.split_backward
    # rank r warms up with 2(p - r) - 1 forwards of its first segment
    for r in range(4):
        kinds = [str(a) for a in plan.actions[r]]
        assert kinds[: 2 * (4 - r) - 1] == [f"{r}F{i}" for i in range(2 * (4 - r) - 1)]
    other = build_plan("zb_v", 2, 4, chain=(0, 1))
    assert tokens(other.actions) == tokens(build_plan("zb_h1", 2, 4).actions)


def test_group_size_is_torchs_rounds_rule() -> None:
    assert [group_size(4, m) for m in (1, 3, 4, 6, 8, 10, 12, 9)] == [1, 3, 4, 6, 4, 5, 4, 5]


@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b", "zb_h1", "zb_v"])
def test_static_schedules_ignore_costs(name: str) -> None:
    heavy = Costs(forward=[1, 5, 1, 2, 1, 1, 3, 1], backward=7, backward_weight=2, latency=3)
    chain = (0, 1, 2, 3, 3, 2, 1, 0)
    assert build_plan(name, 4, 8, chain=chain, costs=heavy) == build_plan(name, 4, 8, chain=chain)


@pytest.mark.parametrize("name", EXPECTED_NAMES)
@pytest.mark.parametrize("cap", [1, 2, 3, 6])
def test_every_schedule_honours_active_microbatches(name: str, cap: int) -> None:
    for chain in [(0, 1, 2, 3), (0, 1, 2, 3, 0), looped_chain(4, 2), vee_chain(4)]:
        plan = build_plan(name, 4, 8, chain=chain, active_microbatches=cap)
        assert plan.active_microbatches == cap
        assert max(simulate(plan).peak_in_flight) <= cap


def test_zb_v_keeps_its_order_when_the_cap_allows_it() -> None:
    natural = build_plan("zb_v", 4, 8)
    same = build_plan("zb_v", 4, 8, active_microbatches=natural.active_microbatches)
    assert same.actions == natural.actions
    capped = build_plan("zb_v", 4, 8, active_microbatches=natural.active_microbatches - 1)
    assert capped.chain == natural.chain and capped.actions != natural.actions


def test_smp_rules_honour_every_cap_on_every_chain() -> None:
    for name in ("interleaved", "simple", "_only_forward"):
        for cap in range(1, 7):
            for chain in [(0, 1, 0), (0, 1, 0, 1, 0), vee_chain(3), looped_chain(3, 2)]:
                plan = build_plan(name, 3, 6, chain=chain, active_microbatches=cap)
                assert plan.active_microbatches == cap
