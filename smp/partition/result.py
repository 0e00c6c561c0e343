"""A partition of a module tree: every module's rank, the chain a microbatch visits, its segments.

`TreePartition` is what both the automatic partitioner and manual placement produce. It is pure
data (a tree plus ``path -> rank``): the frontend broadcasts `TreePartition.to_dict`, each rank
keeps `TreePartition.local_paths`, and the scheduler consumes `TreePartition.chain`.

The chain is derived from the work items in execution order (see ``items.py``): consecutive items
on the same rank form one *segment*, and the chain is the rank of each segment. It assumes a
module's output goes straight to the module that runs next (SMP v1 ``fast_mode``); a parent whose
forward does work between two children on other ranks adds round trips the frontend observes on
the first step. Example, embedding and tied head on rank 0, layers on rank 1::

    execution order:  embed  layer.0  layer.1  norm  head
    rank:               0       1        1      1     0
    segments:         [embed] [layer.0 layer.1 norm] [head]     chain() == (0, 1, 0)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from smp.errors import InvalidPartitionIDError, PartitionError
from smp.partition.cost import CostModel, MemoryBudget
from smp.partition.graph import ModuleTree, Totals
from smp.partition.items import WorkItem, fallback_compute, lower_assignment
from smp.partition.report import PartitionReport, RankSummary, ReportRow

__all__ = ["Segment", "TreePartition", "check_shared_groups"]


@dataclass(frozen=True)
class Segment:
    """A maximal run of consecutive work on one rank: one position of the chain.

    Attributes:
        index: position in the chain.
        rank: the pipeline rank that runs it.
        items: labels of the work items it holds, in execution order.
        totals: parameter bytes/counts, activation bytes (kept per microbatch), compute, modules.
        output_bytes: bytes it sends to the next segment (the output of its last item).
    """

    index: int
    rank: int
    items: tuple[str, ...]
    totals: Totals
    output_bytes: int


@dataclass(frozen=True, eq=False)
class TreePartition:
    """Every module of a tree mapped to a pipeline rank.

    Attributes:
        tree: the partitioned tree.
        assignment: module path -> rank, for every module.
        num_ranks: pipeline ranks (pp).
        virtual_stages: model chunks per rank the chain was built for.
        cost_model: the balancing cost used (for reports).
        budget: in-flight counts and memory cap (for reports).
        method: "auto" or "manual".
        notes: decisions worth a log line (e.g. modules opened up).
        stage_of: optional module path -> chain stage, when a rank holds several stages (virtual
            stages, the V of ``zb_v``); then segments follow stages, not just ranks.
        stage_ranks: the rank of each stage (with ``stage_of``).

    Example:
        >>> from smp.partition.graph import ModuleNode
        >>> tree = ModuleTree([
        ...     ModuleNode("", ("embed", "layer", "head")),
        ...     ModuleNode("embed", param_bytes=8, shared_groups=frozenset({"w"})),
        ...     ModuleNode("layer", param_bytes=8, compute=1.0),
        ...     ModuleNode("head", shared_groups=frozenset({"w"}), compute=1.0)])
        >>> part = TreePartition.from_assignment(tree, {"": 0, "embed": 0, "layer": 1, "head": 0}, 2)
        >>> part.chain(), part.local_paths(1)
        ((0, 1, 0), ('layer',))
    """

    tree: ModuleTree
    assignment: Mapping[str, int]
    num_ranks: int
    virtual_stages: int = 1
    cost_model: CostModel = field(default_factory=lambda: CostModel(memory_weight=0.8))
    budget: MemoryBudget | None = None
    method: str = "manual"
    notes: tuple[str, ...] = ()
    stage_of: Mapping[str, int] | None = None
    stage_ranks: tuple[int, ...] | None = None

    @staticmethod
    def from_assignment(
        tree: ModuleTree,
        assignment: Mapping[str, int],
        num_ranks: int,
        *,
        virtual_stages: int = 1,
        memory_weight: float = 0.8,
        budget: MemoryBudget | None = None,
        method: str = "manual",
        notes: Sequence[str] = (),
        stage_of: Mapping[str, int] | None = None,
        stage_ranks: Sequence[int] | None = None,
    ) -> TreePartition:
        """Check a complete assignment (every module, ranks in range, shared groups together)."""
        missing = [p for p in tree.order if p not in assignment]
        unknown = [p for p in assignment if p not in tree]
        bad = {p: r for p, r in assignment.items() if not (isinstance(r, int) and 0 <= r < num_ranks)}
        problems = []
        if missing:
            problems.append(f"modules without a rank: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if unknown:
            problems.append(f"ranks given for modules not in the tree: {unknown[:8]}")
        if problems:
            raise PartitionError("incomplete partition:\n" + "\n".join(f"  - {p}" for p in problems))
        if bad:
            path, rank = next(iter(bad.items()))
            raise InvalidPartitionIDError(
                f"module {path!r} is placed on partition {rank!r}, outside [0, {num_ranks}) for "
                f"pipeline_parallel_degree={num_ranks}; use an index in 0..{num_ranks - 1}"
            )
        check_shared_groups(tree, assignment)
        if (stage_of is None) != (stage_ranks is None):
            raise PartitionError("stage_of and stage_ranks go together: give both or neither")
        if stage_of is not None and stage_ranks is not None:
            wrong = [p for p in tree.order if not (0 <= stage_of.get(p, -1) < len(stage_ranks))
                     or stage_ranks[stage_of[p]] != assignment[p]]
            if wrong:
                raise PartitionError(f"stages disagree with ranks for modules {wrong[:8]}")
        totals = tree.totals()
        cost = CostModel(
            memory_weight=memory_weight,
            total_memory=(budget.param_memory_factor if budget else 4.0) * totals.param_bytes
            + totals.activation_bytes,
            total_compute=_total_compute(tree),
            param_memory_factor=budget.param_memory_factor if budget else 4.0,
        )
        return TreePartition(tree, dict(assignment), num_ranks, virtual_stages, cost,
                             budget or MemoryBudget.build(num_ranks), method, tuple(notes),
                             None if stage_of is None else dict(stage_of),
                             None if stage_ranks is None else tuple(stage_ranks))

    # -- placement ------------------------------------------------------------------------------
    def rank_of(self, path: str) -> int:
        """The rank of a module."""
        try:
            return self.assignment[path]
        except KeyError:
            raise PartitionError(f"no module {path!r} in this partition") from None

    def local_paths(self, rank: int) -> tuple[str, ...]:
        """Modules placed on ``rank``, in pre-order."""
        return tuple(p for p in self.tree.order if self.assignment[p] == rank)

    # -- chain ----------------------------------------------------------------------------------
    @cached_property
    def _placed(self) -> list[tuple[WorkItem, int, int]]:
        """(item, rank, stage) in execution order; stage is -1 without stages."""
        comp = fallback_compute(self.tree)
        if self.stage_of is None or self.stage_ranks is None:
            return [(it, r, -1) for it, r in lower_assignment(self.tree, self.assignment, comp)]
        ranks = self.stage_ranks
        return [(it, ranks[s], s) for it, s in lower_assignment(self.tree, self.stage_of, comp)]

    @cached_property
    def _items(self) -> list[tuple[WorkItem, int]]:
        return [(it, r) for it, r, _ in self._placed]

    @cached_property
    def _segments(self) -> tuple[Segment, ...]:
        runs: list[tuple[tuple[int, int], list[WorkItem]]] = []
        for item, rank, stage in self._placed:
            if item.is_empty:
                continue
            if runs and runs[-1][0] == (rank, stage):
                runs[-1][1].append(item)
            else:
                runs.append(((rank, stage), [item]))
        segments = []
        for index, ((rank, _), items) in enumerate(runs):
            total = Totals()
            for item in items:
                total = total + item.totals
            segments.append(Segment(index, rank, tuple(i.label for i in items), total, items[-1].output_bytes))
        return tuple(segments)

    def segments(self) -> tuple[Segment, ...]:
        """The chain's segments in execution order (one per chain position)."""
        return self._segments

    def chain(self) -> tuple[int, ...]:
        """The ranks one microbatch visits, in order (consecutive repeats merged)."""
        return tuple(s.rank for s in self._segments)

    # -- sizes and report -------------------------------------------------------------------------
    def rank_totals(self) -> list[Totals]:
        """Sums over the modules of each rank."""
        out = [Totals() for _ in range(self.num_ranks)]
        for item, rank in self._items:
            out[rank] = out[rank] + item.totals
        return out

    def memory_bytes(self) -> list[float]:
        """Peak bytes per rank: parameters with optimizer allowance + in-flight activations."""
        budget = self.budget or MemoryBudget.build(self.num_ranks)
        return [budget.rank_bytes(r, t.param_bytes, t.activation_bytes) for r, t in enumerate(self.rank_totals())]

    def report(self, title: str | None = None) -> PartitionReport:
        """The partition table, per-rank totals and imbalance."""
        rows = []
        for item, rank in self._items:
            t = item.totals
            if item.is_empty:
                continue
            rows.append(ReportRow(
                item.label, rank, t.param_count, t.param_bytes, t.compute,
                self.cost_model.memory(t.param_bytes, t.activation_bytes),
                self.cost_model.cost(t.param_bytes, t.activation_bytes, t.compute),
            ))
        budget = self.budget or MemoryBudget.build(self.num_ranks)
        ranks = tuple(
            RankSummary(r, t.param_count, t.param_bytes, t.compute, mem,
                        self.cost_model.cost(t.param_bytes, t.activation_bytes, t.compute), budget.in_flight[r])
            for r, (t, mem) in enumerate(zip(self.rank_totals(), self.memory_bytes(), strict=True))
        )
        heading = title or (f"Partition assignments ({self.method}, pp={self.num_ranks}"
                            + (f", virtual_stages={self.virtual_stages}" if self.virtual_stages > 1 else "") + ")")
        return PartitionReport(heading, tuple(rows), ranks, self.chain(), budget.cap_bytes, self.notes,
                               budget.param_memory_factor)

    def to_dict(self) -> dict[str, object]:
        """The decision as plain data, to broadcast to the other ranks."""
        return {
            "num_ranks": self.num_ranks,
            "virtual_stages": self.virtual_stages,
            "method": self.method,
            "assignment": dict(self.assignment),
            "stage_of": None if self.stage_of is None else dict(self.stage_of),
            "stage_ranks": None if self.stage_ranks is None else list(self.stage_ranks),
        }

    @staticmethod
    def from_dict(tree: ModuleTree, data: Mapping[str, object], *, budget: MemoryBudget | None = None) -> TreePartition:
        """Rebuild a partition broadcast with `to_dict` (checked like a manual assignment)."""
        assignment = data["assignment"]
        num_ranks = data["num_ranks"]
        virtual_stages = data.get("virtual_stages", 1)
        method = data.get("method", "manual")
        stage_of = data.get("stage_of")
        stage_ranks = data.get("stage_ranks")
        if not (isinstance(assignment, Mapping) and isinstance(num_ranks, int) and isinstance(virtual_stages, int)
                and isinstance(method, str) and (stage_of is None or isinstance(stage_of, Mapping))
                and (stage_ranks is None or isinstance(stage_ranks, list))):
            raise PartitionError(f"malformed partition data: {dict(data)!r}")
        return TreePartition.from_assignment(tree, assignment, num_ranks, virtual_stages=virtual_stages,
                                             budget=budget, method=method, stage_of=stage_of,
                                             stage_ranks=stage_ranks)


def _total_compute(tree: ModuleTree) -> float:
    comp = fallback_compute(tree)
    return sum(comp(p) for p in tree.order)


def check_shared_groups(tree: ModuleTree, assignment: Mapping[str, int]) -> None:
    """Raise when modules that share a parameter are on different ranks, naming both modules.

    Example:
        >>> from smp.partition.graph import ModuleNode
        >>> tree = ModuleTree([ModuleNode("", ("wte", "lm_head")),
        ...     ModuleNode("wte", param_bytes=4, shared_groups=frozenset({"tied"})),
        ...     ModuleNode("lm_head", shared_groups=frozenset({"tied"}))])
        >>> check_shared_groups(tree, {"": 0, "wte": 0, "lm_head": 1})
        Traceback (most recent call last):
        ...
        smp.errors.PartitionError: modules 'wte' (partition 0) and 'lm_head' (partition 1) share a parameter ...
    """
    for gid, members in tree.groups().items():
        first = members[0]
        for other in members[1:]:
            if assignment[other] != assignment[first]:
                raise PartitionError(
                    f"modules {first!r} (partition {assignment[first]}) and {other!r} (partition "
                    f"{assignment[other]}) share a parameter (group {gid!r}) but are placed on different "
                    f"partitions. Fix: place both on one partition, e.g. smp.set_partition(<{other}>, "
                    f"{assignment[first]}) or create them in the same `with smp.partition(i):` block"
                )
