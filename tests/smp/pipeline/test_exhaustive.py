"""Every builder, every rank count 1-8, every microbatch count 1-32, every chain family: valid plans.

The chains generalise the issue's examples to p ranks: ``0 -> 1 -> ... -> p-1`` (linear),
``0 -> 1 -> 0`` (tied embedding and head on rank 0: ``0..p-1, 0``), ``0 -> 1 -> 0 -> 1 -> 0``
(``0..p-1, 0..p-1, 0``), virtual stages ``0..p-1, 0..p-1`` and the zero-bubble V.
"""

from __future__ import annotations

import pytest

from smp.pipeline import SCHEDULES, Costs, Plan, check_plan, lower, simulate
from smp.pipeline.chains import linear_chain, looped_chain, vee_chain
from smp.pipeline.schedules.request import BuildRequest

RANKS = range(1, 9)
MICROBATCHES = range(1, 33)
LOWERED_MICROBATCHES = (1, 2, 3, 7, 16)


def chains(p: int) -> dict[str, tuple[int, ...]]:
    return {
        "linear": linear_chain(p),
        "tied": linear_chain(p) + (0,),
        "ping-pong": looped_chain(p, 2) + (0,),
        "looped": looped_chain(p, 2),
        "vee": vee_chain(p),
    }


def build(name: str, p: int, m: int, chain: tuple[int, ...]) -> Plan:
    schedule = SCHEDULES[name]
    cap = min(p + 2, m) if schedule.smp_default_cap else m
    request = BuildRequest(name, p, m, chain, cap, schedule.smp_default_cap, None)
    lists = schedule(request)
    return Plan(name, p, m, chain, cap, dict(enumerate(lists)), schedule.forward_only)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_builder_output_passes_the_validator(name: str) -> None:
    failures = []
    count = 0
    for p in RANKS:
        for chain_name, chain in chains(p).items():
            for m in MICROBATCHES:
                plan = build(name, p, m, chain)
                problems = check_plan(plan)
                count += 1
                if problems:
                    failures.append(f"{name} p={p} m={m} {chain_name}: {problems[0]}")
                if m in LOWERED_MICROBATCHES:
                    lowered = lower(plan)
                    problems = check_plan(lowered)
                    if problems:
                        failures.append(f"{name} p={p} m={m} {chain_name} lowered: {problems[0]}")
                    assert lowered.compute_only() == plan
    assert count == 8 * 32 * 5
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("name", ["interleaved", "simple", "gpipe", "_only_forward"])
def test_dynamic_rules_under_uneven_costs_and_latency(name: str) -> None:
    """A dynamic rule simulated with real costs must still give valid plans."""
    from smp.pipeline import build_plan

    for p in (2, 3, 5):
        for chain in chains(p).values():
            n = len(chain)
            costs = Costs(forward=[1 + (s % 3) for s in range(n)], backward=[2 + (s % 2) for s in range(n)], latency=0.3)
            for m in (1, 4, 9):
                plan = build_plan(name, p, m, chain=chain, costs=costs)  # raises if invalid
                assert check_plan(plan) == []
                assert simulate(plan, costs).makespan > 0
