"""Exact chain partitioning against brute force (every split of up to 12 blocks into up to 4 parts)."""

from __future__ import annotations

import random

import pytest

from smp.errors import PartitionError, PartitionMemoryError
from smp.partition import chain_bottleneck, min_bottleneck, part_costs, partition_chain, split_under
from tests.smp.partition.builders import all_splits, brute_force, loads, reference_chain


def _random_chains(seed: int, count: int, *, floats: bool) -> list[tuple[list[float], int]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        n = rng.randint(1, 12)
        p = rng.randint(1, min(4, n))
        costs = [rng.uniform(0, 10) if floats else float(rng.randint(0, 9)) for _ in range(n)]
        cases.append((costs, p))
    return cases


@pytest.mark.parametrize("floats", [False, True], ids=["int", "float"])
def test_optimal_on_every_random_chain(floats: bool) -> None:
    for costs, p in _random_chains(7 if floats else 3, 300, floats=floats):
        bounds = partition_chain(costs, p)
        assert bounds[0] == 0 and bounds[-1] == len(costs) and len(bounds) == p + 1
        assert all(a < b for a, b in zip(bounds, bounds[1:], strict=False)), "every part is non-empty"
        got = loads(costs, bounds)
        best_max, best_sq = brute_force(costs, p)
        assert max(got) == pytest.approx(best_max, rel=1e-12, abs=1e-12), (costs, p, bounds)
        # Second pass: the most even split among the optimal ones.
        assert sum(x * x for x in got) == pytest.approx(best_sq, rel=1e-9, abs=1e-9), (costs, p, bounds)
        assert min_bottleneck(costs, p) == pytest.approx(best_max, rel=1e-12, abs=1e-12)


def test_unbalanced_reconstruction_is_still_optimal() -> None:
    for costs, p in _random_chains(11, 300, floats=False):
        bounds = partition_chain(costs, p, balance=False)
        assert max(loads(costs, bounds)) == brute_force(costs, p)[0]


def test_long_chains_match_textbook_dp() -> None:
    rng = random.Random(5)
    for _ in range(20):
        n = rng.randint(20, 60)
        p = rng.randint(2, 8)
        costs = [float(rng.randint(1, 100)) for _ in range(n)]
        assert chain_bottleneck(costs, partition_chain(costs, p)) == reference_chain(costs, p)


def test_memory_check_is_honoured_and_optimal() -> None:
    """A per-part limit (rank 0 holds more in-flight activations) against brute force with the same check."""
    rng = random.Random(13)
    checked = 0
    for _ in range(200):
        n = rng.randint(3, 12)
        p = rng.randint(2, min(4, n))
        costs = [float(rng.randint(1, 9)) for _ in range(n)]
        mem = [rng.randint(1, 9) for _ in range(n)]
        in_flight = [p - k for k in range(p)]
        cap = rng.randint(8, 40)

        def fits(k: int, i: int, j: int, mem: list[int] = mem, in_flight: list[int] = in_flight,
                 cap: int = cap) -> bool:
            return in_flight[k] * sum(mem[i:j]) <= cap

        best = brute_force(costs, p, fits)
        if best[0] == float("inf"):
            with pytest.raises(PartitionMemoryError):
                partition_chain(costs, p, fits=fits)
            continue
        bounds = partition_chain(costs, p, fits=fits)
        assert all(fits(k, bounds[k], bounds[k + 1]) for k in range(p))
        assert max(loads(costs, bounds)) == best[0]
        checked += 1
    assert checked > 50


def test_docstring_example() -> None:
    assert partition_chain([4, 6, 4, 2, 1, 4], 3) == [0, 2, 4, 6]
    assert part_costs([4, 6, 4, 2, 1, 4], [0, 2, 4, 6]) == [10.0, 6.0, 5.0]


def test_split_under_penalty_against_brute_force() -> None:
    rng = random.Random(17)
    for _ in range(150):
        n = rng.randint(2, 10)
        p = rng.randint(1, min(4, n))
        costs = [float(rng.randint(1, 9)) for _ in range(n)]
        cut = [float(rng.randint(0, 20)) for _ in range(n + 1)]
        limit = min_bottleneck(costs, p) * rng.choice([1.0, 1.2, 1.5])

        def penalty(k: int, i: int, j: int, cut: list[float] = cut, n: int = n) -> float:
            return cut[j] if j < n else 0.0

        options = [b for b in all_splits(n, p) if max(loads(costs, b)) <= limit]
        want = min((sum(cut[x] for x in b[1:-1]), sum(c * c for c in loads(costs, b))) for b in options)
        got = split_under(costs, p, limit, penalty=penalty)
        assert got is not None
        assert (sum(cut[x] for x in got[1:-1]), sum(c * c for c in loads(costs, got))) == want
        assert split_under(costs, p, limit * 0.5 - 1e-9) is None or limit * 0.5 >= min_bottleneck(costs, p)


def test_zero_costs_and_single_part() -> None:
    assert partition_chain([0, 0, 0], 3) == [0, 1, 2, 3]
    assert partition_chain([5, 1], 1) == [0, 2]
    assert partition_chain([1, 1, 1, 1], 4) == [0, 1, 2, 3, 4]


def test_errors_name_the_problem() -> None:
    with pytest.raises(PartitionError, match="cannot split 2 block"):
        partition_chain([1, 2], 3)
    with pytest.raises(PartitionError, match="finite and >= 0"):
        partition_chain([1, -2, 3], 2)
    with pytest.raises(PartitionError, match="finite"):
        partition_chain([1, float("nan")], 1)
    with pytest.raises(PartitionError, match="at least 1 part"):
        partition_chain([1], 0)


def test_large_chain_is_fast_and_optimal() -> None:
    rng = random.Random(23)
    costs = [float(rng.randint(1, 1000)) for _ in range(5000)]
    bounds = partition_chain(costs, 16)
    got = chain_bottleneck(costs, bounds)
    # Optimality certificate: greedy packing under (bottleneck - 1) needs more than 16 parts.
    s, below = 0.0, 1
    for c in costs:
        if s + c > got - 0.5:
            below += 1
            s = c
        else:
            s += c
    assert below > 16, "no split can have a bottleneck below the one found"


def test_the_v_over_two_ranks_balances_the_ranks_then_its_ends() -> None:
    """Parts ``a b a``: the middle on one rank, both ends on the other. The split has the least
    estimated step, ``microbatches`` x the larger rank sum + how far apart the ends are (the fill
    and the drain); every (i, j) against it by brute force."""
    even = [1.0] * 8 + [4.0]
    bounds = partition_chain(even, 3, weights=[1, 2, 1], ranks=[0, 1, 0])
    loads = part_costs(even, bounds)
    assert loads[1] == 6.0 and loads[0] + loads[2] == 6.0
    assert bounds == [0, 2, 8, 9], bounds
    # A lopsided V: the least larger rank sum (16: ends 1 and 15) against a sum of 17 with ends 11
    # and 6; over 8 microbatches 8 * 16 + 14 = 142 > 8 * 17 + 5 = 141, over 64 the sum wins.
    lopsided = [1.0, 4.0, 6.0, 5.0, 3.0, 6.0, 6.0]
    assert partition_chain(lopsided, 3, weights=[1, 2, 1], ranks=[0, 1, 0], microbatches=8) == [0, 3, 6, 7]
    assert partition_chain(lopsided, 3, weights=[1, 2, 1], ranks=[0, 1, 0], microbatches=64) == [0, 1, 4, 7]
    rng = random.Random(7)
    for _ in range(200):
        n, m = rng.randint(3, 9), rng.choice([1, 2, 8, 32])
        costs = [float(rng.randint(0, 9)) for _ in range(n)]

        def step(i: int, j: int, costs: list[float] = costs, m: int = m) -> float:
            a, b, c = sum(costs[:i]), sum(costs[i:j]), sum(costs[j:])
            return m * max(b, a + c) + abs(a - c)

        got = partition_chain(costs, 3, weights=[1, 2, 1], ranks=[0, 1, 0], microbatches=m)
        assert step(got[1], got[2]) == min(step(i, j) for i in range(1, n - 1) for j in range(i + 1, n)), (costs, m, got)
    # Memory limits are honoured: the middle may hold at most 5 blocks.
    capped = partition_chain(even, 3, weights=[1, 2, 1], ranks=[0, 1, 0], fits=lambda k, i, j: k != 1 or j - i <= 5)
    assert capped[2] - capped[1] <= 5
