"""The rank API over smp.state: every rank of every small layout, before init, and group validation."""

from __future__ import annotations

import doctest
import itertools
from collections.abc import Iterator

import pytest

import smp.state
from smp.config import resolve
from smp.errors import InvalidCommGroupError, NotInitializedError
from smp.runtime import ranks
from smp.topology import GroupKind, RankMap

LAYOUTS = [(world, pp, tp, placement) for world in (1, 2, 4, 8) for pp in (1, 2, 4) for tp in (1, 2, 4)
           if world % (pp * tp) == 0 for placement in ("cluster", "spread", "PTD")]


def _every_rank(world: int, pp: int, tp: int, placement: str) -> Iterator[tuple[RankMap, int]]:
    rm = RankMap.from_world(world, pp_size=pp, tp_size=tp, placement=placement)
    for r in range(world):
        with smp.state.override(rank_map=rm, rank=r, local_rank=r % 2, local_size=2):
            yield rm, r


@pytest.mark.parametrize(("world", "pp", "tp", "placement"), LAYOUTS)
def test_ranks_and_sizes_are_the_rank_maps(world: int, pp: int, tp: int, placement: str) -> None:
    for rm, r in _every_rank(world, pp, tp, placement):
        c = rm.coord(r)
        assert (ranks.rank(), ranks.pp_rank(), ranks.tp_rank(), ranks.rdp_rank(), ranks.dp_rank(),
                ranks.mp_rank()) == (r, c.pp_rank, c.tp_rank, c.rdp_rank, c.dp_rank, c.mp_rank)
        assert (ranks.size(), ranks.pp_size(), ranks.tp_size(), ranks.rdp_size(), ranks.dp_size(),
                ranks.mp_size()) == (world, pp, tp, world // (pp * tp), rm.dp_size, rm.mp_size)
        assert (ranks.local_rank(), ranks.local_size()) == (r % 2, 2)


@pytest.mark.parametrize(("world", "pp", "tp", "placement"), LAYOUTS)
def test_groups_are_this_ranks_by_default_and_move_along_the_named_axes(world: int, pp: int, tp: int,
                                                                       placement: str) -> None:
    for rm, r in _every_rank(world, pp, tp, placement):
        c = rm.coord(r)
        assert ranks.get_pp_group() == rm.group(GroupKind.PP, r)
        assert ranks.get_tp_group() == rm.group(GroupKind.TP, r)
        assert ranks.get_rdp_group() == rm.group(GroupKind.RDP, r)
        assert ranks.get_dp_group() == rm.group(GroupKind.DP, r)
        assert ranks.get_mp_group() == rm.group(GroupKind.MP, r)
        for p, q in itertools.product(range(pp), range(rm.rdp_size)):
            assert ranks.get_tp_group(pp_rank=p, rdp_rank=q) == rm.group(GroupKind.TP, rm.rank_of(p, c.tp_rank, q))
            assert ranks.get_tp_group(pp_rank=p) == rm.group(GroupKind.TP, rm.rank_of(p, c.tp_rank, c.rdp_rank))
            assert ranks.get_mp_group(rdp_rank=q) == rm.group(GroupKind.MP, rm.rank_of(c.pp_rank, c.tp_rank, q))
            assert ranks.get_dp_group(pp_rank=p) == rm.group(GroupKind.DP, rm.rank_of(p, c.tp_rank, c.rdp_rank))
        for p, t in itertools.product(range(pp), range(tp)):
            assert ranks.get_rdp_group(pp_rank=p, tp_rank=t) == rm.group(GroupKind.RDP, rm.rank_of(p, t, c.rdp_rank))
        for k, member in enumerate(rm.group(GroupKind.DP, r)):
            # A DP rank names a member of this stage's DP group; its pipeline is returned.
            assert ranks.get_pp_group(dp_rank=k) == rm.group(GroupKind.PP, member)


def test_before_init_sizes_are_one_and_ranks_raise() -> None:
    with smp.state.override(rank_map=None, cfg=None):
        assert [f() for f in (ranks.size, ranks.pp_size, ranks.tp_size, ranks.rdp_size, ranks.dp_size,
                              ranks.mp_size, ranks.local_size, ranks.num_microbatches)] == [1] * 8
        for f in (ranks.rank, ranks.local_rank, ranks.pp_rank, ranks.tp_rank, ranks.rdp_rank, ranks.dp_rank,
                  ranks.mp_rank, ranks.get_pp_group, ranks.get_dp_group):
            with pytest.raises(NotInitializedError, match="smp.init"):
                f()


def test_num_microbatches_reads_the_config() -> None:
    with smp.state.override(cfg=resolve({"microbatches": 4})):
        assert ranks.num_microbatches() == 4


def test_groups_and_rank_types_carry_smp_v1_values_and_name_the_topology_groups() -> None:
    assert [int(g) for g in (ranks.WORLD, ranks.PP_GROUP, ranks.TP_GROUP, ranks.RDP_GROUP, ranks.DP_GROUP,
                             ranks.MP_GROUP)] == list(range(6))
    for group in ranks.CommGroup:
        assert ranks.group_kind(group) is GroupKind(int(group))
    for rank_type in ranks.RankType:
        assert ranks.group_kind(rank_type) is GroupKind(int(rank_type))
    for bad in (1, "PP_GROUP", GroupKind.PP, None):
        with pytest.raises(InvalidCommGroupError, match="smp.PP_GROUP"):
            ranks.group_kind(bad)


def test_docstring_example() -> None:
    assert doctest.testmod(ranks).failed == 0
