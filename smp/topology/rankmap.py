"""The rank map: pp x tp x rdp coordinates of every rank from a placement string, and the groups.

Pure integer arithmetic (reference section 2.3). The placement string orders the axes D (rdp),
P (pp) and T (tp) from slowest- to fastest-varying over consecutive global ranks; ``cluster`` is
``DPT`` and ``spread`` is ``TPD``. For axis X: ``stride(X)`` = product of the sizes of the axes to
its right, and ``X_rank(r) = (r // stride(X)) % size(X)``.

Worked example (8 ranks, pp=2, tp=2, rdp=2, ``cluster`` = DPT; entries are (pp, tp, rdp))::

    rank:  0        1        2        3        4        5        6        7
          (0,0,0)  (0,1,0)  (1,0,0)  (1,1,0)  (0,0,1)  (0,1,1)  (1,0,1)  (1,1,1)
    TP groups  {0,1} {2,3} {4,5} {6,7}       PP groups  {0,2} {1,3} {4,6} {5,7}
    RDP groups {0,4} {1,5} {2,6} {3,7}       DP groups  {0,1,4,5} {2,3,6,7}
    MP groups  {0,1,2,3} {4,5,6,7}

Derived ranks: ``dp_rank = rdp + rdp_size*tp`` when T is left of D, else ``tp + tp_size*rdp``;
``mp_rank = pp + pp_size*tp`` when T is left of P, else ``tp + tp_size*pp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property

from smp.errors import ConfigProblem, SMPConfigError

PLACEMENT_ALIASES = {"cluster": "DPT", "spread": "TPD"}


class GroupKind(IntEnum):
    """The communication groups, with SMP v1's ``CommGroup`` values."""

    WORLD = 0
    PP = 1
    TP = 2
    RDP = 3
    DP = 4
    MP = 5


@dataclass(frozen=True)
class Coord:
    """The coordinates of one rank."""

    rank: int
    pp_rank: int
    tp_rank: int
    rdp_rank: int
    dp_rank: int
    mp_rank: int


def normalize_placement(placement: str) -> str:
    """``cluster``/``spread`` or a permutation of D, P, T -> the three-letter form."""
    order = PLACEMENT_ALIASES.get(placement, placement)
    if sorted(order) != ["D", "P", "T"]:
        raise SMPConfigError([ConfigProblem(
            "placement_strategy", placement, "must be 'cluster', 'spread' or an order of the letters D, P, T",
            "use e.g. 'cluster' (DPT) or 'spread' (TPD)")])
    return order


@dataclass(frozen=True)
class RankMap:
    """Coordinates and groups of a pp x tp x rdp layout.

    Example:
        >>> rm = RankMap(pp_size=2, tp_size=2, rdp_size=2, placement="cluster")
        >>> rm.coord(5)
        Coord(rank=5, pp_rank=0, tp_rank=1, rdp_rank=1, dp_rank=3, mp_rank=1)
        >>> rm.group(GroupKind.DP, 5)
        [0, 1, 4, 5]
    """

    pp_size: int
    tp_size: int
    rdp_size: int
    placement: str = "cluster"

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement", normalize_placement(self.placement))
        for name in ("pp_size", "tp_size", "rdp_size"):
            if getattr(self, name) < 1:
                raise SMPConfigError([ConfigProblem(name, getattr(self, name), "must be >= 1", "use 1 or more")])

    @classmethod
    def from_world(cls, world_size: int, pp_size: int, tp_size: int, placement: str = "cluster") -> RankMap:
        if world_size % (pp_size * tp_size):
            raise SMPConfigError([ConfigProblem(
                "pipeline_parallel_degree", pp_size,
                f"world size {world_size} is not a multiple of pp x tp = {pp_size * tp_size}",
                "launch a multiple of pp x tp processes")])
        return cls(pp_size, tp_size, world_size // (pp_size * tp_size), placement)

    @property
    def world_size(self) -> int:
        return self.pp_size * self.tp_size * self.rdp_size

    @property
    def dp_size(self) -> int:
        return self.tp_size * self.rdp_size

    @property
    def mp_size(self) -> int:
        return self.pp_size * self.tp_size

    def _size(self, axis: str) -> int:
        return {"D": self.rdp_size, "P": self.pp_size, "T": self.tp_size}[axis]

    @cached_property
    def strides(self) -> dict[str, int]:
        strides: dict[str, int] = {}
        stride = 1
        for axis in reversed(self.placement):
            strides[axis] = stride
            stride *= self._size(axis)
        return strides

    def _left_of(self, a: str, b: str) -> bool:
        return self.placement.index(a) < self.placement.index(b)

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of size {self.world_size}")
        pp, tp, rdp = ((rank // self.strides[a]) % self._size(a) for a in "PTD")
        dp = rdp + self.rdp_size * tp if self._left_of("T", "D") else tp + self.tp_size * rdp
        mp = pp + self.pp_size * tp if self._left_of("T", "P") else tp + self.tp_size * pp
        return Coord(rank, pp, tp, rdp, dp, mp)

    def rank_of(self, pp_rank: int, tp_rank: int, rdp_rank: int) -> int:
        """The global rank at the given coordinates."""
        return pp_rank * self.strides["P"] + tp_rank * self.strides["T"] + rdp_rank * self.strides["D"]

    def group(self, kind: GroupKind, rank: int) -> list[int]:
        """The global ranks of the group of ``kind`` that contains ``rank``, ordered by group rank."""
        c = self.coord(rank)
        if kind == GroupKind.WORLD:
            return list(range(self.world_size))
        if kind == GroupKind.PP:
            members = [(p, self.rank_of(p, c.tp_rank, c.rdp_rank)) for p in range(self.pp_size)]
        elif kind == GroupKind.TP:
            members = [(t, self.rank_of(c.pp_rank, t, c.rdp_rank)) for t in range(self.tp_size)]
        elif kind == GroupKind.RDP:
            members = [(d, self.rank_of(c.pp_rank, c.tp_rank, d)) for d in range(self.rdp_size)]
        elif kind == GroupKind.DP:
            ranks = [self.rank_of(c.pp_rank, t, d) for t in range(self.tp_size) for d in range(self.rdp_size)]
            members = [(self.coord(r).dp_rank, r) for r in ranks]
        elif kind == GroupKind.MP:
            ranks = [self.rank_of(p, t, c.rdp_rank) for p in range(self.pp_size) for t in range(self.tp_size)]
            members = [(self.coord(r).mp_rank, r) for r in ranks]
        else:
            raise ValueError(f"unknown group kind {kind!r}")
        return [r for _, r in sorted(members)]

    def groups(self, kind: GroupKind) -> list[list[int]]:
        """Every group of ``kind``, each ordered by group rank, in order of their smallest member."""
        seen: dict[tuple[int, ...], None] = {}
        for rank in range(self.world_size):
            seen.setdefault(tuple(self.group(kind, rank)), None)
        return sorted((list(g) for g in seen), key=min)

    def group_rank(self, kind: GroupKind, rank: int) -> int:
        """The rank of ``rank`` inside its group of ``kind``."""
        return self.group(kind, rank).index(rank)

    def grid(self) -> str:
        """A text table: one row per rank with its coordinates."""
        lines = [f"placement {self.placement}: pp={self.pp_size} tp={self.tp_size} rdp={self.rdp_size}",
                 "rank  pp  tp  rdp  dp  mp"]
        for r in range(self.world_size):
            c = self.coord(r)
            lines.append(f"{r:>4} {c.pp_rank:>3} {c.tp_rank:>3} {c.rdp_rank:>4} {c.dp_rank:>3} {c.mp_rank:>3}")
        return "\n".join(lines)
