"""The SMP v1 rank API over `smp.state`: this process's ranks and sizes, and its groups as rank lists.

Every frontend exports these verbs as they are (``smp.torch.rank()``, ``smp.torch.get_dp_group()``);
only the process groups and object communication are the frontend's own. Before ``smp.init`` the
sizes are 1 and the ranks raise `NotInitializedError`.

Example (pp 2 x tp 2 x rdp 2, placement "cluster"; world rank 5 is pp 0, tp 1, rdp 1):

    >>> import smp.state
    >>> from smp.topology import RankMap
    >>> with smp.state.override(rank_map=RankMap.from_world(8, pp_size=2, tp_size=2), rank=5):
    ...     (pp_rank(), tp_rank(), rdp_rank(), dp_rank()), get_pp_group(), get_tp_group(), get_dp_group()
    ((0, 1, 1, 3), [5, 7], [4, 5], [0, 1, 4, 5])
"""

from __future__ import annotations

from enum import IntEnum

import smp.state as smp_state
from smp.errors import InvalidCommGroupError, NotInitializedError
from smp.topology import Coord, GroupKind

__all__ = [
    "DP_GROUP", "MP_GROUP", "PP_GROUP", "RDP_GROUP", "TP_GROUP", "WORLD", "CommGroup", "RankType",
    "dp_rank", "dp_size", "get_dp_group", "get_mp_group", "get_pp_group", "get_rdp_group", "get_tp_group",
    "group_kind", "local_rank", "local_size", "mp_rank", "mp_size", "num_microbatches", "pp_rank", "pp_size",
    "rank", "rdp_rank", "rdp_size", "size", "tp_rank", "tp_size",
]


class CommGroup(IntEnum):
    """Communication groups (SMP v1 values)."""

    WORLD = 0
    PP_GROUP = 1
    TP_GROUP = 2
    RDP_GROUP = 3
    DP_GROUP = 4
    MP_GROUP = 5


class RankType(IntEnum):
    """How a peer rank number is read (SMP v1 values)."""

    WORLD_RANK = 0
    PP_RANK = 1
    TP_RANK = 2
    RDP_RANK = 3
    DP_RANK = 4
    MP_RANK = 5


WORLD, PP_GROUP, TP_GROUP, RDP_GROUP, DP_GROUP, MP_GROUP = tuple(CommGroup)


def group_kind(group: object) -> GroupKind:
    """The topology group a `CommGroup` or `RankType` names; anything else is an `InvalidCommGroupError`."""
    if isinstance(group, (CommGroup, RankType)):
        return GroupKind(int(group))
    raise InvalidCommGroupError(
        f"invalid communication group {group!r}: use one of smp.WORLD, smp.PP_GROUP, smp.TP_GROUP, "
        "smp.RDP_GROUP, smp.DP_GROUP, smp.MP_GROUP")


def _coord() -> Coord:
    st = smp_state.current()
    if st.rank_map is None:
        raise NotInitializedError("smp is not initialised: call smp.init(config) first")
    return st.rank_map.coord(st.rank)


# --- ranks and sizes ----------------------------------------------------------------------------

def rank() -> int:
    """This process's rank in the world."""
    return int(_coord().rank)


def size() -> int:
    """The number of processes in the world (1 before init)."""
    rm = smp_state.current().rank_map
    return rm.world_size if rm else 1


def local_rank() -> int:
    """This process's rank on its host."""
    _coord()
    return smp_state.current().local_rank


def local_size() -> int:
    """The number of processes on this host (1 before init)."""
    return smp_state.current().local_size if smp_state.current().rank_map else 1


def pp_rank() -> int:
    """This process's pipeline rank (its stage)."""
    return int(_coord().pp_rank)


def tp_rank() -> int:
    """This process's rank in its tensor-parallel group."""
    return int(_coord().tp_rank)


def rdp_rank() -> int:
    """This process's rank among the replicas of its (pp, tp) shard."""
    return int(_coord().rdp_rank)


def dp_rank() -> int:
    """This process's rank in its data-parallel group (tp x rdp)."""
    return int(_coord().dp_rank)


def mp_rank() -> int:
    """This process's rank in its model-parallel group (pp x tp)."""
    return int(_coord().mp_rank)


def pp_size() -> int:
    """Pipeline-parallel degree (1 before init)."""
    rm = smp_state.current().rank_map
    return rm.pp_size if rm else 1


def tp_size() -> int:
    """Tensor-parallel degree (1 before init)."""
    rm = smp_state.current().rank_map
    return rm.tp_size if rm else 1


def rdp_size() -> int:
    """Reduced data-parallel degree (1 before init)."""
    rm = smp_state.current().rank_map
    return rm.rdp_size if rm else 1


def dp_size() -> int:
    """Data-parallel degree, tp x rdp (1 before init)."""
    rm = smp_state.current().rank_map
    return rm.dp_size if rm else 1


def mp_size() -> int:
    """Model-parallel degree, pp x tp (1 before init)."""
    rm = smp_state.current().rank_map
    return rm.mp_size if rm else 1


def num_microbatches() -> int:
    """Microbatches per step (1 before init)."""
    cfg = smp_state.current().cfg
    return cfg.microbatches if cfg else 1


# --- groups as rank lists ---------------------------------------------------------------------

def _group_list(kind: GroupKind, **coords: int | None) -> list[int]:
    st = smp_state.current()
    c = _coord()
    rm = st.rank_map
    assert rm is not None
    at = {"pp_rank": c.pp_rank, "tp_rank": c.tp_rank, "rdp_rank": c.rdp_rank}
    if "dp_rank" in coords and coords["dp_rank"] is not None:
        # A DP rank names a (tp, rdp) pair within this pipeline stage.
        member = rm.group(GroupKind.DP, rank())[coords.pop("dp_rank") or 0]
        mc = rm.coord(member)
        at.update(tp_rank=mc.tp_rank, rdp_rank=mc.rdp_rank)
    coords.pop("dp_rank", None)
    at.update({k: v for k, v in coords.items() if v is not None})
    return rm.group(kind, rm.rank_of(at["pp_rank"], at["tp_rank"], at["rdp_rank"]))


def get_pp_group(dp_rank: int | None = None) -> list[int]:
    """World ranks of this process's pipeline (or that of DP rank ``dp_rank`` in this stage)."""
    return _group_list(GroupKind.PP, dp_rank=dp_rank)


def get_tp_group(pp_rank: int | None = None, rdp_rank: int | None = None) -> list[int]:
    """World ranks of this process's TP group (or the one at ``pp_rank`` / ``rdp_rank``)."""
    return _group_list(GroupKind.TP, pp_rank=pp_rank, rdp_rank=rdp_rank)


def get_rdp_group(pp_rank: int | None = None, tp_rank: int | None = None) -> list[int]:
    """World ranks of this process's RDP group (or the one at ``pp_rank`` / ``tp_rank``)."""
    return _group_list(GroupKind.RDP, pp_rank=pp_rank, tp_rank=tp_rank)


def get_dp_group(pp_rank: int | None = None) -> list[int]:
    """World ranks of this process's DP group (or the one at ``pp_rank``)."""
    return _group_list(GroupKind.DP, pp_rank=pp_rank)


def get_mp_group(rdp_rank: int | None = None) -> list[int]:
    """World ranks of this process's MP group (or the one at ``rdp_rank``)."""
    return _group_list(GroupKind.MP, rdp_rank=rdp_rank)
