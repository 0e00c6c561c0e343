"""Rank map: worked examples A, B, C of the reference, and exhaustive invariants up to 16 ranks."""

from __future__ import annotations

import itertools

import pytest

from smp.errors import SMPConfigError
from smp.topology import GroupKind, RankMap

# Worked example A (reference 2.3): 8 ranks, pp=2, tp=2, rdp=2; rank -> (pp, tp, rdp, dp, mp).
EXAMPLE_A = {
    "DPT": "0:(0,0,0,0,0) 1:(0,1,0,1,1) 2:(1,0,0,0,2) 3:(1,1,0,1,3) 4:(0,0,1,2,0) 5:(0,1,1,3,1) 6:(1,0,1,2,2) 7:(1,1,1,3,3)",
    "DTP": "0:(0,0,0,0,0) 1:(1,0,0,0,1) 2:(0,1,0,1,2) 3:(1,1,0,1,3) 4:(0,0,1,2,0) 5:(1,0,1,2,1) 6:(0,1,1,3,2) 7:(1,1,1,3,3)",
    "PDT": "0:(0,0,0,0,0) 1:(0,1,0,1,1) 2:(0,0,1,2,0) 3:(0,1,1,3,1) 4:(1,0,0,0,2) 5:(1,1,0,1,3) 6:(1,0,1,2,2) 7:(1,1,1,3,3)",
    "PTD": "0:(0,0,0,0,0) 1:(0,0,1,1,0) 2:(0,1,0,2,1) 3:(0,1,1,3,1) 4:(1,0,0,0,2) 5:(1,0,1,1,2) 6:(1,1,0,2,3) 7:(1,1,1,3,3)",
    "TDP": "0:(0,0,0,0,0) 1:(1,0,0,0,1) 2:(0,0,1,1,0) 3:(1,0,1,1,1) 4:(0,1,0,2,2) 5:(1,1,0,2,3) 6:(0,1,1,3,2) 7:(1,1,1,3,3)",
    "TPD": "0:(0,0,0,0,0) 1:(0,0,1,1,0) 2:(1,0,0,0,1) 3:(1,0,1,1,1) 4:(0,1,0,2,2) 5:(0,1,1,3,2) 6:(1,1,0,2,3) 7:(1,1,1,3,3)",
}
# Groups of example A as printed in the reference (set notation; '…' rows spelled out).
EXAMPLE_A_GROUPS = {
    "DPT": {"TP": [[0, 1], [2, 3], [4, 5], [6, 7]], "PP": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "RDP": [[0, 4], [1, 5], [2, 6], [3, 7]], "DP": [[0, 1, 4, 5], [2, 3, 6, 7]],
            "MP": [[0, 1, 2, 3], [4, 5, 6, 7]]},
    "DTP": {"TP": [[0, 2], [1, 3], [4, 6], [5, 7]], "PP": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "RDP": [[0, 4], [1, 5], [2, 6], [3, 7]], "DP": [[0, 2, 4, 6], [1, 3, 5, 7]],
            "MP": [[0, 1, 2, 3], [4, 5, 6, 7]]},
    "PDT": {"TP": [[0, 1], [2, 3], [4, 5], [6, 7]], "PP": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "RDP": [[0, 2], [1, 3], [4, 6], [5, 7]], "DP": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "MP": [[0, 1, 4, 5], [2, 3, 6, 7]]},
    "PTD": {"TP": [[0, 2], [1, 3], [4, 6], [5, 7]], "PP": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "RDP": [[0, 1], [2, 3], [4, 5], [6, 7]], "DP": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "MP": [[0, 2, 4, 6], [1, 3, 5, 7]]},
    "TDP": {"TP": [[0, 4], [1, 5], [2, 6], [3, 7]], "PP": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "RDP": [[0, 2], [1, 3], [4, 6], [5, 7]], "DP": [[0, 2, 4, 6], [1, 3, 5, 7]],
            "MP": [[0, 1, 4, 5], [2, 3, 6, 7]]},
    "TPD": {"TP": [[0, 4], [1, 5], [2, 6], [3, 7]], "PP": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "RDP": [[0, 1], [2, 3], [4, 5], [6, 7]], "DP": [[0, 1, 4, 5], [2, 3, 6, 7]],
            "MP": [[0, 2, 4, 6], [1, 3, 5, 7]]},
}


def _parse(row: str) -> dict[int, tuple[int, ...]]:
    out = {}
    for cell in row.split():
        rank, coords = cell.split(":")
        out[int(rank)] = tuple(int(x) for x in coords.strip("()").split(","))
    return out


@pytest.mark.parametrize("placement", sorted(EXAMPLE_A))
def test_worked_example_a(placement: str) -> None:
    rm = RankMap(2, 2, 2, placement)
    for rank, want in _parse(EXAMPLE_A[placement]).items():
        c = rm.coord(rank)
        assert (c.pp_rank, c.tp_rank, c.rdp_rank, c.dp_rank, c.mp_rank) == want, (placement, rank)
    for kind, groups in EXAMPLE_A_GROUPS[placement].items():
        got = [sorted(g) for g in rm.groups(GroupKind[kind])]
        assert sorted(got) == sorted(groups), (placement, kind)


def test_aliases_cluster_and_spread() -> None:
    assert RankMap(2, 2, 2, "cluster") == RankMap(2, 2, 2, "DPT")
    assert RankMap(2, 2, 2, "spread") == RankMap(2, 2, 2, "TPD")


def test_worked_example_b_no_tp() -> None:
    spread = RankMap(2, 1, 4, "spread")
    assert sorted(map(sorted, spread.groups(GroupKind.MP))) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert sorted(map(sorted, spread.groups(GroupKind.DP))) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [spread.coord(r).mp_rank for r in range(4)] == [0, 0, 0, 0]
    assert spread.coord(6).dp_rank == 2
    cluster = RankMap(2, 1, 4, "cluster")
    assert sorted(map(sorted, cluster.groups(GroupKind.MP))) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert sorted(map(sorted, cluster.groups(GroupKind.DP))) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # TF docstring: 4-way MP and 2-way DP; the "replicas" are the model replicas (MP groups).
    assert sorted(map(sorted, RankMap(4, 1, 2, "spread").groups(GroupKind.MP))) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert sorted(map(sorted, RankMap(4, 1, 2, "cluster").groups(GroupKind.MP))) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_worked_example_c() -> None:
    c = RankMap(2, 4, 2, "cluster")
    assert sorted(map(sorted, c.groups(GroupKind.TP))) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert sorted(c.group(GroupKind.PP, 0)) == [0, 4] and sorted(c.group(GroupKind.PP, 8)) == [8, 12]
    assert sorted(map(sorted, c.groups(GroupKind.RDP))) == [[i, i + 8] for i in range(8)]
    assert sorted(map(sorted, c.groups(GroupKind.DP))) == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    assert sorted(map(sorted, c.groups(GroupKind.MP))) == [list(range(8)), list(range(8, 16))]
    r13 = c.coord(13)
    assert (r13.pp_rank, r13.tp_rank, r13.rdp_rank, r13.dp_rank, r13.mp_rank) == (1, 1, 1, 5, 5)
    s = RankMap(2, 4, 2, "spread")
    assert sorted(map(sorted, s.groups(GroupKind.TP)))[:2] == [[0, 4, 8, 12], [1, 5, 9, 13]]
    assert sorted(s.group(GroupKind.PP, 0)) == [0, 2] and sorted(s.group(GroupKind.PP, 4)) == [4, 6]
    assert sorted(s.group(GroupKind.RDP, 2)) == [2, 3]
    assert sorted(map(sorted, s.groups(GroupKind.DP))) == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert sorted(map(sorted, s.groups(GroupKind.MP))) == [list(range(0, 16, 2)), list(range(1, 16, 2))]
    r13 = s.coord(13)
    assert (r13.pp_rank, r13.tp_rank, r13.rdp_rank, r13.dp_rank, r13.mp_rank) == (0, 3, 1, 7, 6)


def _factorisations(world: int) -> list[tuple[int, int, int]]:
    return [(pp, tp, world // (pp * tp)) for pp in range(1, world + 1) for tp in range(1, world + 1)
            if world % (pp * tp) == 0]


PLACEMENTS = ["".join(p) for p in itertools.permutations("DPT")]


@pytest.mark.parametrize("world", range(1, 17))
def test_every_factorisation_and_placement(world: int) -> None:
    for pp, tp, rdp in _factorisations(world):
        for placement in PLACEMENTS:
            rm = RankMap(pp, tp, rdp, placement)
            coords = [rm.coord(r) for r in range(world)]
            # The map is a bijection onto the pp x tp x rdp grid, and rank_of inverts it.
            assert len({(c.pp_rank, c.tp_rank, c.rdp_rank) for c in coords}) == world
            for c in coords:
                assert rm.rank_of(c.pp_rank, c.tp_rank, c.rdp_rank) == c.rank
                assert 0 <= c.dp_rank < rm.dp_size and 0 <= c.mp_rank < rm.mp_size
            # The rightmost letter varies fastest over consecutive ranks.
            fast = {"D": "rdp_rank", "P": "pp_rank", "T": "tp_rank"}[placement[-1]]
            fast_size = {"D": rdp, "P": pp, "T": tp}[placement[-1]]
            assert [getattr(coords[r], fast) for r in range(world)] == [r % fast_size for r in range(world)]
            sizes = {GroupKind.PP: pp, GroupKind.TP: tp, GroupKind.RDP: rdp, GroupKind.DP: tp * rdp,
                     GroupKind.MP: pp * tp}
            for kind, n in sizes.items():
                groups = rm.groups(kind)
                # Groups partition the world, each of the right size...
                assert sorted(r for g in groups for r in g) == list(range(world))
                assert all(len(g) == n for g in groups)
                for g in groups:
                    # ...ordered by group rank, which is also ascending global rank (torch orders that way).
                    assert [rm.group_rank(kind, r) for r in g] == list(range(n))
                    assert g == sorted(g)
                    cs = [rm.coord(r) for r in g]
                    # Members share the coordinates the group holds fixed.
                    if kind == GroupKind.PP:
                        assert len({(c.tp_rank, c.rdp_rank) for c in cs}) == 1
                        assert [c.pp_rank for c in cs] == list(range(n))
                    if kind == GroupKind.TP:
                        assert len({(c.pp_rank, c.rdp_rank) for c in cs}) == 1
                        assert [c.tp_rank for c in cs] == list(range(n))
                    if kind == GroupKind.RDP:
                        assert len({(c.pp_rank, c.tp_rank) for c in cs}) == 1
                    if kind == GroupKind.DP:
                        assert len({c.pp_rank for c in cs}) == 1
                        assert [c.dp_rank for c in cs] == list(range(n))
                    if kind == GroupKind.MP:
                        assert len({c.rdp_rank for c in cs}) == 1
                        assert [c.mp_rank for c in cs] == list(range(n))
            # Identities of reference 2.1; the TP group is inside both the DP and the MP group.
            assert rm.mp_size * rm.rdp_size == world and pp * rm.dp_size == world
            for r in range(world):
                tp_g = set(rm.group(GroupKind.TP, r))
                assert tp_g <= set(rm.group(GroupKind.DP, r)) and tp_g <= set(rm.group(GroupKind.MP, r))


def test_bad_placement_names_the_key() -> None:
    with pytest.raises(SMPConfigError, match="placement_strategy"):
        RankMap(2, 1, 1, "DPX")
    with pytest.raises(SMPConfigError, match="world size 6"):
        RankMap.from_world(6, 4, 1)
