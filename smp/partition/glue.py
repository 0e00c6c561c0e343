"""Chain splits with glued items: pieces that must share a rank although they are far apart.

Modules (or ops) that share a parameter must live on one rank, yet they run at different points
of the chain: a tied embedding runs first, the tied head last. Such items are *glued*. One of them,
the *anchor*, stays in the sequence and carries the cost of the whole glued set; the others leave
the sequence and run, at their own position, on the anchor's rank. The chain then revisits that
rank (``0 -> 1 -> 0``), which is still acyclic in chain order because the sequence is in
execution order. Each member is tried as the anchor (coordinate descent over glued sets).

Zero-cost items ride with the next item so that no rank is handed a piece with nothing in it.

Example: items ``E L L L L H`` with E and H glued, 2 parts::

    anchor E:  sequence [E+H] L L L L   -> [E+H L] [L L L]    chain 0 -> 1 -> 0
    anchor H:  sequence L L L L [E+H]   -> [L L L] [L E+H]    chain 1 -> 0 -> 1
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from smp.errors import PartitionMemoryError
from smp.partition.chain import (
    SegmentCheck,
    SegmentPenalty,
    part_costs,
    partition_chain,
    split_under,
    two_rank_vee,
    vee_ends,
)

__all__ = ["GluedSplit", "Reduction", "resplit", "split_glued"]

_ROUNDS = 3
_MAX_SETS_FOR_DESCENT = 8


@dataclass(frozen=True)
class Reduction:
    """The sequence the chain DP sees.

    Attributes:
        carried: per position, the items whose cost it carries (its own and its glued ones).
        placed: per position, the items that actually run there (its own block).
    """

    carried: tuple[tuple[int, ...], ...]
    placed: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class GluedSplit:
    """A split of the reduced sequence and the part of every original item."""

    bottleneck: float
    spread: float
    part_of_item: tuple[int, ...]
    reduction: Reduction
    bounds: tuple[int, ...]

    @property
    def visits(self) -> int:
        """Chain positions: how many times the part changes along the items in execution order."""
        parts = self.part_of_item
        return 1 + sum(1 for a, b in zip(parts, parts[1:], strict=False) if a != b)

    def key(self) -> tuple[float, int, float]:
        """Comparison key: bottleneck, then fewer chain positions, then evenness.

        Floats are rounded to 9 significant digits so that splits equal up to rounding compare
        on the next criterion.
        """
        return (_q(self.bottleneck), self.visits, _q(self.spread))


def _q(x: float) -> float:
    return float(f"{x:.9g}")


FitsFactory = Callable[[Reduction], SegmentCheck | None]
PenaltyFactory = Callable[[Reduction], SegmentPenalty | None]


def _blocks(costs: Sequence[float]) -> list[list[int]]:
    blocks: list[list[int]] = []
    pending: list[int] = []
    for i, c in enumerate(costs):
        pending.append(i)
        if c > 0:
            blocks.append(pending)
            pending = []
    if pending:
        if blocks:
            blocks[-1].extend(pending)
        else:
            blocks.append(pending)
    return blocks


def _glued_sets(blocks: Sequence[Sequence[int]], keys: Sequence[frozenset[Hashable]]) -> list[list[int]]:
    parent = list(range(len(blocks)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    owner: dict[Hashable, int] = {}
    for b, members in enumerate(blocks):
        for i in members:
            for key in keys[i]:
                if key in owner:
                    ra, rb = find(b), find(owner[key])
                    parent[max(ra, rb)] = min(ra, rb)
                else:
                    owner[key] = b
    comps: dict[int, list[int]] = {}
    for b in range(len(blocks)):
        comps.setdefault(find(b), []).append(b)
    return [bs for bs in comps.values() if len(bs) > 1]


def _reduce(blocks: Sequence[Sequence[int]], glued: Sequence[Sequence[int]], anchors: Sequence[int]) -> Reduction:
    anchor_of: dict[int, int] = {}
    for group, anchor in zip(glued, anchors, strict=True):
        for b in group:
            anchor_of[b] = anchor
    carried: dict[int, list[int]] = {}
    for b, members in enumerate(blocks):
        carried.setdefault(anchor_of.get(b, b), []).extend(members)
    kept = sorted(carried)
    return Reduction(tuple(tuple(sorted(carried[b])) for b in kept), tuple(tuple(blocks[b]) for b in kept))


def _finish(costs: Sequence[float], reduction: Reduction, bounds: Sequence[int], n_items: int,
            weights: Sequence[float] | None = None, ranks: Sequence[int] | None = None,
            microbatches: int = 1) -> GluedSplit:
    seq_costs = [sum(costs[i] for i in carried) for carried in reduction.carried]
    loads = part_costs(seq_costs, bounds)
    # The V over 2 ranks also pays for the difference of its ends (`partition_chain`), counted
    # per unit of weight as the bottleneck is.
    ends = 0.0
    if weights is not None and ranks is not None and two_rank_vee(ranks):
        ends = vee_ends(loads[0], loads[2], microbatches) / (weights[0] + weights[2])
    if weights is not None:
        if ranks is not None:  # what each rank runs, per unit of its weight
            loads = [sum(x for x, r in zip(loads, ranks, strict=True) if r == rank)
                     / sum(w for w, r in zip(weights, ranks, strict=True) if r == rank) for rank in sorted(set(ranks))]
        else:
            loads = [load / w for load, w in zip(loads, weights, strict=True)]
    part_of_item = [0] * n_items
    for k, (a, z) in enumerate(zip(bounds, bounds[1:], strict=False)):
        for pos in range(a, z):
            for i in reduction.carried[pos]:
                part_of_item[i] = k
    return GluedSplit(max(loads) + ends, sum(x * x for x in loads), tuple(part_of_item), reduction, tuple(bounds))


def _solve(costs: Sequence[float], reduction: Reduction, num_parts: int, make_fits: FitsFactory | None,
           weights: Sequence[float] | None, ranks: Sequence[int] | None, microbatches: int) -> GluedSplit | None:
    if len(reduction.carried) < num_parts:
        return None
    seq_costs = [sum(costs[i] for i in carried) for carried in reduction.carried]
    fits = make_fits(reduction) if make_fits is not None else None
    try:
        bounds = partition_chain(seq_costs, num_parts, fits=fits, weights=weights, ranks=ranks,
                                 microbatches=microbatches)
    except PartitionMemoryError:
        return None
    return _finish(costs, reduction, bounds, len(costs), weights, ranks, microbatches)


def split_glued(
    costs: Sequence[float],
    keys: Sequence[frozenset[Hashable]],
    num_parts: int,
    *,
    make_fits: FitsFactory | None = None,
    weights: Sequence[float] | None = None,
    ranks: Sequence[int] | None = None,
    microbatches: int = 8,
) -> GluedSplit | None:
    """The least-bottleneck split of items into ``num_parts`` parts, items sharing a key glued.

    Args:
        costs: cost of each item, in execution order.
        keys: per item, the keys that glue it to other items (shared parameter ids, variables).
        num_parts: number of parts (chain positions before revisits).
        make_fits: builds the per-part check for a given reduction (memory limits).
        weights: each part's share of the work (`partition_chain`); the bottleneck is per weight.
        ranks: each part's rank, with ``weights``: the bottleneck is per rank (`partition_chain`).
        microbatches: microbatches per step (`partition_chain`: the V over 2 ranks).

    Returns:
        The best split found, or None when there are too few pieces or nothing fits.

    Example:
        >>> split = split_glued([1, 2, 2, 2, 2, 1], [frozenset({"w"}), *[frozenset()] * 4, frozenset({"w"})], 2)
        >>> split.part_of_item, split.bottleneck
        ((0, 0, 1, 1, 1, 0), 6.0)
    """
    blocks = _blocks(costs)
    glued = _glued_sets(blocks, keys)
    anchors = [g[0] for g in glued]
    best = _solve(costs, _reduce(blocks, glued, anchors), num_parts, make_fits, weights, ranks, microbatches)
    if len(glued) > _MAX_SETS_FOR_DESCENT:
        return best
    for _ in range(_ROUNDS):
        changed = False
        for gi, group in enumerate(glued):
            for cand in group:
                if cand == anchors[gi]:
                    continue
                trial = [*anchors[:gi], cand, *anchors[gi + 1:]]
                sol = _solve(costs, _reduce(blocks, glued, trial), num_parts, make_fits, weights, ranks, microbatches)
                if sol is not None and (best is None or sol.key() < best.key()):
                    best, anchors, changed = sol, trial, True
        if not changed:
            break
    return best


def resplit(
    split: GluedSplit,
    costs: Sequence[float],
    num_parts: int,
    limit: float,
    *,
    make_fits: FitsFactory | None = None,
    make_penalty: PenaltyFactory | None = None,
) -> GluedSplit | None:
    """Keep ``split``'s anchors; among splits with every part <= ``limit``, take the least penalty."""
    reduction = split.reduction
    seq_costs = [sum(costs[i] for i in carried) for carried in reduction.carried]
    fits = make_fits(reduction) if make_fits is not None else None
    penalty = make_penalty(reduction) if make_penalty is not None else None
    bounds = split_under(seq_costs, num_parts, limit if math.isfinite(limit) else math.inf,
                         fits=fits, penalty=penalty)
    if bounds is None:
        return None
    return _finish(costs, reduction, bounds, len(costs))
