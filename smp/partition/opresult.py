"""The result of op-graph partitioning: op groups, their ranks, the chain, the report."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from smp.errors import PartitionError
from smp.partition.opgraph import OpEdge, OpGraph
from smp.partition.report import PartitionReport, RankSummary, ReportRow

__all__ = ["OpGroup", "OpPartition"]


@dataclass(frozen=True)
class OpGroup:
    """One run: consecutive ops of one constraint group, with their sizes."""

    ops: tuple[str, ...]
    label: str
    variables: tuple[str, ...]
    var_bytes: int
    params: int
    compute: float
    cost: float


@dataclass(frozen=True, eq=False)
class OpPartition:
    """Every op of a graph mapped to a pipeline rank.

    Attributes:
        graph: the partitioned graph.
        assignment: op name -> rank.
        num_ranks: pipeline ranks.
        groups: the runs in chain order, with ``group_ranks`` their ranks.
        cut_bytes: bytes sent between ranks per microbatch (a tensor once per receiving rank).
        notes: decisions worth a log line.
    """

    graph: OpGraph
    assignment: Mapping[str, int]
    num_ranks: int
    groups: tuple[OpGroup, ...]
    group_ranks: tuple[int, ...]
    cut_bytes: int
    param_memory_factor: float = 4.0
    notes: tuple[str, ...] = ()

    def rank_of(self, op: str) -> int:
        """The rank of an op."""
        try:
            return self.assignment[op]
        except KeyError:
            raise PartitionError(f"no op {op!r} in this partition") from None

    def _positions(self) -> list[int]:
        pos, out = -1, []
        for k, rank in enumerate(self.group_ranks):
            if k == 0 or rank != self.group_ranks[k - 1]:
                pos += 1
            out.append(pos)
        return out

    def position_of(self, op: str) -> int:
        """The chain position (index into `chain`) where ``op`` runs."""
        positions = self._positions()
        for g, pos in zip(self.groups, positions, strict=True):
            if op in g.ops:
                return pos
        raise PartitionError(f"no op {op!r} in this partition")

    def chain(self) -> tuple[int, ...]:
        """Ranks one microbatch visits in order; every edge goes forward along it."""
        out: list[int] = []
        for rank in self.group_ranks:
            if not out or out[-1] != rank:
                out.append(rank)
        return tuple(out)

    def variable_ranks(self) -> dict[str, int]:
        """Variable name -> the rank that holds it."""
        out: dict[str, int] = {}
        for group, rank in zip(self.groups, self.group_ranks, strict=True):
            for var in group.variables:
                out[var] = rank
        return out

    def crossing_edges(self) -> list[OpEdge]:
        """Edges whose endpoints are on different ranks."""
        return [e for e in self.graph.edges if self.assignment[e.src] != self.assignment[e.dst]]

    def report(self, title: str | None = None) -> PartitionReport:
        """The partition table (one row per run), per-rank totals and imbalance."""
        rows = tuple(
            ReportRow(g.label, r, g.params, g.var_bytes, g.compute, self.param_memory_factor * g.var_bytes, g.cost)
            for g, r in zip(self.groups, self.group_ranks, strict=True)
        )
        ranks = tuple(
            RankSummary(
                rank,
                sum(x.params for x in rows if x.rank == rank),
                sum(x.param_bytes for x in rows if x.rank == rank),
                sum(x.compute for x in rows if x.rank == rank),
                sum(x.memory_bytes for x in rows if x.rank == rank),
                sum(x.cost for x in rows if x.rank == rank),
            )
            for rank in range(self.num_ranks)
        )
        notes = (f"bytes crossing ranks per microbatch: {self.cut_bytes}", *self.notes)
        return PartitionReport(title or f"Op partition (pp={self.num_ranks})", rows, ranks, self.chain(), None, notes)
