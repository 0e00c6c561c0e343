"""Automatic partitioning of a module tree: exact on chains, opening modules only where it pays.

The algorithm (`partition_tree`):

1. **Lower bound.** Open every module that has children with parameters and solve the resulting
   chain of work items exactly (`partition_chain`): no split that keeps modules whole can beat
   this bottleneck ``B_fine``.
2. **Coarse first.** Start with the root opened and its children whole. While the best split of
   the current items is worse than ``(1 + tolerance) * B_fine``, open the whole item whose opening
   helps most (among the costliest few; if none helps on its own, the costliest). So a module is
   descended into only when keeping it whole would unbalance the split.
3. **Constraints.** Modules sharing a parameter are glued: all their items go to the rank of one
   *anchor* item, which carries the cost of the group; each member is tried as the anchor
   (coordinate descent over groups, see ``glue.py``). Parameter-less subtrees are folded into their parent's own
   work. Items with no cost ride with the next item. A memory cap becomes a per-part check
   ``param_memory_factor * params + in_flight[rank] * activations <= cap`` (with ``v`` virtual
   stages each chunk gets ``cap / v``, a conservative split of the rank's memory).
4. **Virtual stages.** The chain is cut into ``num_ranks * virtual_stages`` parts and part ``k``
   goes to rank ``k % num_ranks``, so the chain loops over the ranks ``v`` times. ``stage_ranks``
   gives any other placement of the parts, e.g. the V ``0 1 2 3 3 2 1 0`` of zero-bubble V.

Worked example, 2 ranks, costs in brackets::

    root
    |- embed [1]
    |- layers            open? whole layers [8] vs embed [1] + head [1]: bottleneck 8 vs fine 5
    |  |- 0 [2]  |- 1 [2]  |- 2 [2]  |- 3 [2]
    |- head [1]

    coarse items  [embed 1] [layers 8] [head 1]            best split 9 | 1 or 1 | 9: bottleneck 9
    open layers   [embed 1] [0 2] [1 2] [2 2] [3 2] [head 1]   best split 5 | 5  (= B_fine): stop
    result        rank 0: embed, layers.0, layers.1      rank 1: layers.2, layers.3, head
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Sequence
from typing import NoReturn

from smp.errors import PartitionError, PartitionMemoryError
from smp.partition.chain import SegmentCheck
from smp.partition.cost import CostModel, MemoryBudget
from smp.partition.glue import GluedSplit, Reduction, split_glued
from smp.partition.graph import ModuleTree
from smp.partition.items import WorkItem, expandable, fallback_compute, lower
from smp.partition.report import format_bytes
from smp.partition.result import TreePartition

__all__ = ["partition_tree"]

_CANDIDATES = 6  # modules tried per opening step (the costliest whole items)
_EPS = 1e-12


class _Solver:
    """Solves one item sequence: glued groups, anchors, memory checks, exact chain DP."""

    def __init__(self, cost: CostModel, budget: MemoryBudget, stage_ranks: Sequence[int], tree: ModuleTree,
                 microbatches: int) -> None:
        self.tree = tree
        self.microbatches = microbatches
        self.cost = cost
        self.budget = budget
        self.stage_ranks = tuple(stage_ranks)
        # Consecutive stages on one rank (the bottom of a V) are one part of that much weight: the
        # rank runs them back to back, so only their sum matters, not how it divides between them.
        runs: list[list[int]] = []  # [rank, first stage, stages]
        for stage, rank in enumerate(self.stage_ranks):
            if runs and runs[-1][0] == rank:
                runs[-1][2] += 1
            else:
                runs.append([rank, stage, 1])
        self.part_ranks = tuple(r for r, _, _ in runs)
        self.part_stage = tuple(first for _, first, _ in runs)
        self.weights = None if all(n == 1 for *_, n in runs) else tuple(float(n) for *_, n in runs)
        self.parts = len(runs)

    def item_cost(self, item: WorkItem) -> float:
        t = item.totals
        return self.cost.cost(t.param_bytes, t.activation_bytes, t.compute)

    def solve(self, items: Sequence[WorkItem], *, capped: bool = True) -> GluedSplit | None:
        """The best split of ``items``; every part owns parameters where the model has enough.

        A part of glue code alone (the root's and a model body's own work, parameter-free modules)
        holds none of the model, so it divides no memory. It came from a measured time that was
        off: a container's own time caught in a hiccup of the machine outweighed all the layers
        in one trace of a 4-layer Llama and left pipeline rank 0 nothing but the root.
        """
        costs = [self.item_cost(it) for it in items]
        keys: list[frozenset[Hashable]] = [frozenset(it.groups) for it in items]
        make_fits = self._fits_factory(items) if capped and self.budget.cap_bytes is not None else None
        if self.part_ranks[:1] == self.part_ranks[-1:] and len(self.part_ranks) > 1:
            make_fits = self._way_back(items, make_fits)
        solve = functools.partial(split_glued, costs, keys, self.parts, weights=self.weights,
                                  ranks=self.part_ranks if self.weights is not None else None,
                                  microbatches=self.microbatches)
        if sum(1 for it in items if it.totals.param_bytes > 0) >= self.parts:
            split = solve(make_fits=self._owning(items, make_fits))
            if split is not None:
                return split
        return solve(make_fits=make_fits)  # too few parameterised pieces (or glued together)

    @staticmethod
    def _owning(items: Sequence[WorkItem], inner: Callable[[Reduction], SegmentCheck | None] | None
                ) -> Callable[[Reduction], SegmentCheck]:
        """``inner``'s check, and every part holding at least one parameter byte."""

        def make(reduction: Reduction) -> SegmentCheck:
            check = inner(reduction) if inner is not None else None
            owned = [0]  # per position of the reduced sequence: how many carry parameters, cumulative
            for carried in reduction.carried:
                owned.append(owned[-1] + any(items[i].totals.param_bytes > 0 for i in carried))

            def fits(part: int, start: int, stop: int) -> bool:
                return owned[stop] > owned[start] and (check is None or check(part, start, stop))

            return fits

        return make

    def _way_back(self, items: Sequence[WorkItem], inner: Callable[[Reduction], SegmentCheck | None] | None
                  ) -> Callable[[Reduction], SegmentCheck]:
        """``inner``'s check, and the last part (the way back to the first rank) never starting
        inside a module marked ``no_return_cut``."""
        tree = self.tree
        ok = []
        for it in items:
            up, clean = tree.parent(it.path), True
            while up is not None:
                clean = clean and not tree.node(up).no_return_cut
                up = tree.parent(up)
            ok.append(clean)
        last = self.parts - 1

        def make(reduction: Reduction) -> SegmentCheck:
            check = inner(reduction) if inner is not None else None

            def fits(part: int, start: int, stop: int) -> bool:
                if part == last and not ok[reduction.placed[start][0]]:
                    return False
                return check is None or check(part, start, stop)

            return fits

        return make

    def _fits_factory(self, items: Sequence[WorkItem]) -> Callable[[Reduction], SegmentCheck]:
        ranks = self.part_ranks
        share = [1.0 / ranks.count(r) for r in ranks]  # a rank's memory is shared by its parts

        def make(reduction: Reduction) -> SegmentCheck:
            sp, sa = [0.0], [0.0]
            for carried in reduction.carried:
                sp.append(sp[-1] + sum(items[i].totals.param_bytes for i in carried))
                sa.append(sa[-1] + sum(items[i].totals.activation_bytes for i in carried))

            def fits(part: int, start: int, stop: int) -> bool:
                return self.budget.fits(ranks[part], sp[stop] - sp[start], sa[stop] - sa[start], share[part])

            return fits

        return make


def partition_tree(
    tree: ModuleTree,
    num_ranks: int,
    *,
    memory_weight: float,
    virtual_stages: int = 1,
    stage_ranks: Sequence[int] | None = None,
    memory_cap_bytes: float | None = None,
    in_flight: int | Sequence[int] | None = None,
    param_memory_factor: float = 4.0,
    tolerance: float = 0.05,
    microbatches: int = 8,
) -> TreePartition:
    """Assign every module of ``tree`` to one of ``num_ranks`` pipeline ranks.

    Args:
        tree: the module tree (see `ModuleTree`).
        num_ranks: pipeline ranks (``pipeline_parallel_degree``).
        memory_weight: weight of memory against compute in the balancing cost (config key of the
            same name; `memory_weight_for` gives the SMP default for an ``optimize`` value).
        virtual_stages: model chunks per rank; the chain loops over the ranks this many times.
        stage_ranks: the rank of each part in chain order, when not the loop (e.g. the scheduler's
            chain for ``zb_v``); its length is the number of parts and overrides ``virtual_stages``.
        memory_cap_bytes: device memory per rank for the model, or None for no limit.
        in_flight: microbatches whose activations each rank holds at its peak (one int for all
            ranks or one per rank, e.g. the scheduler's ``peak_in_flight``); None means 1.
        param_memory_factor: bytes held per parameter byte (weights + grads + optimizer state).
        tolerance: how far above the finest achievable bottleneck a coarser split may stay
            before a module is opened (0.05 = 5 %).
        microbatches: microbatches per step; a V over 2 ranks weighs its fill and drain by it
            (`smp.partition.chain.partition_chain`).

    Returns:
        A `TreePartition` (``method == "auto"``) with every module's rank and the chain.

    Raises:
        PartitionError: bad arguments, or fewer indivisible pieces than parts.
        PartitionMemoryError: no split fits ``memory_cap_bytes``; the message shows the best
            split without the cap and every rank's memory.

    Example:
        >>> from smp.partition.graph import ModuleNode
        >>> nodes = [ModuleNode("", ("embed", "layers", "head")),
        ...          ModuleNode("embed", param_bytes=1, compute=1.0),
        ...          ModuleNode("layers", tuple(f"layers.{i}" for i in range(4))),
        ...          *[ModuleNode(f"layers.{i}", param_bytes=1, compute=2.0) for i in range(4)],
        ...          ModuleNode("head", param_bytes=1, compute=1.0)]
        >>> part = partition_tree(ModuleTree(nodes), 2, memory_weight=0.0)
        >>> part.local_paths(0), part.chain()
        (('', 'embed', 'layers', 'layers.0', 'layers.1'), (0, 1))
    """
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise PartitionError(f"num_ranks={num_ranks!r} must be an int >= 1 (pipeline_parallel_degree)")
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise PartitionError(f"virtual_stages={virtual_stages!r} must be an int >= 1")
    ranks = tuple(range(num_ranks)) * virtual_stages if stage_ranks is None else tuple(stage_ranks)
    if not ranks or any(not (isinstance(r, int) and 0 <= r < num_ranks) for r in ranks):
        raise PartitionError(f"stage_ranks={list(ranks)} must be a non-empty list of ranks in [0, {num_ranks})")
    virtual_stages = max(ranks.count(r) for r in range(num_ranks))
    if tolerance < 0:
        raise PartitionError(f"tolerance={tolerance!r} must be >= 0")
    budget = MemoryBudget.build(num_ranks, in_flight, memory_cap_bytes, param_memory_factor)
    compute = fallback_compute(tree)
    totals = tree.totals()
    cost = CostModel(
        memory_weight=memory_weight,
        total_memory=param_memory_factor * totals.param_bytes + totals.activation_bytes,
        total_compute=sum(compute(p) for p in tree.order),
        param_memory_factor=param_memory_factor,
    )
    if not isinstance(microbatches, int) or microbatches < 1:
        raise PartitionError(f"microbatches={microbatches!r} must be an int >= 1")
    solver = _Solver(cost, budget, ranks, tree, microbatches)
    openable = {p for p in tree.order if expandable(tree, p)}
    finest_items = lower(tree, openable, compute)
    finest = solver.solve(finest_items)
    if finest is None:
        _raise_no_split(tree, solver, finest_items, num_ranks, memory_weight, budget)
    limit = (1.0 + tolerance) * finest.bottleneck + _EPS
    opened: set[str] = {tree.root} if tree.root in openable else set()
    items = lower(tree, opened, compute)
    current = solver.solve(items)
    while current is None or current.bottleneck > limit:
        whole = sorted((it for it in items if it.whole and it.path in openable),
                       key=lambda it: -solver.item_cost(it))[:_CANDIDATES]
        if not whole:
            break
        trials = []
        for it in whole:
            trial_items = lower(tree, opened | {it.path}, compute)
            trials.append((it, trial_items, solver.solve(trial_items)))
        it, trial_items, sol = min(
            trials, key=lambda t: (math.inf, 0, math.inf) if t[2] is None else t[2].key())
        if sol is None or (current is not None and sol.key() >= current.key()):
            it, trial_items, sol = trials[0]  # nothing helps alone: open the costliest and go on
        opened.add(it.path)
        items, current = trial_items, sol
    if current is None:  # everything opened: the items are the finest ones
        items, current = finest_items, finest
    assignment: dict[str, int] = {}
    stage_of: dict[str, int] = {}
    for item, part in zip(items, current.part_of_item, strict=True):
        for path in item.members:
            assignment[path] = solver.part_ranks[part]
            stage_of[path] = solver.part_stage[part]
    notes = (
        f"auto-partition: {len(items)} work items after opening {len(opened)} module(s); bottleneck "
        f"{current.bottleneck:.4f} of the model vs {finest.bottleneck:.4f} for the finest split "
        f"(ideal {1 / len(ranks):.4f})",
    )
    return TreePartition.from_assignment(tree, assignment, num_ranks, virtual_stages=virtual_stages,
                                         memory_weight=memory_weight, budget=budget, method="auto", notes=notes,
                                         stage_of=stage_of, stage_ranks=ranks)


def _raise_no_split(
    tree: ModuleTree,
    solver: _Solver,
    items: Sequence[WorkItem],
    num_ranks: int,
    memory_weight: float,
    budget: MemoryBudget,
) -> NoReturn:
    """Explain why no split exists: too few pieces, or memory (with the best uncapped split)."""
    ranks = solver.stage_ranks
    parts = len(ranks)
    virtual_stages = max(ranks.count(r) for r in range(num_ranks))
    free = solver.solve(items, capped=False)
    if free is None:
        raise PartitionError(
            f"the model has too few indivisible pieces ({len(items)} work items, modules sharing parameters "
            f"count as one) for {parts} chain parts over {num_ranks} rank(s). Fix: "
            "lower pipeline_parallel_degree or virtual_stages, or split large modules into children"
        )
    assignment = {p: solver.part_ranks[part] for it, part in zip(items, free.part_of_item, strict=True)
                  for p in it.members}
    best = TreePartition.from_assignment(tree, assignment, num_ranks, virtual_stages=virtual_stages,
                                         memory_weight=memory_weight, budget=budget, method="auto")
    cap = budget.cap_bytes or 0.0
    over = [r for r, m in enumerate(best.memory_bytes()) if m > cap]
    where = (f"the most balanced split without the cap overflows on rank(s) {over}" if over else
             "each of a rank's chunks must fit in its share of the cap (cap / chunks on that rank)")
    raise PartitionMemoryError(
        f"no partition over {num_ranks} rank(s) keeps every rank under memory_cap_bytes="
        f"{format_bytes(cap)} with in-flight microbatches {list(budget.in_flight)}; {where}. "
        "Fix: raise pipeline_parallel_degree or "
        "tensor_parallel_degree, lower microbatch size or active_microbatches, or checkpoint activations.\n"
        + best.report("Best split without the memory cap").render()
    )
