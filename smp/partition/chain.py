"""Exact min-bottleneck split of a chain (a sequence of blocks) into contiguous parts.

The throughput of a pipeline is set by its slowest stage, so the quantity to minimise is the
largest part cost (the bottleneck). On a chain that optimum is cheap to compute exactly; there is
no reason to approximate it (torchgpipe's block partition and DeepSpeed's max-min objective do).

Two passes (see `partition_chain`):

1. The optimal bottleneck ``B*`` by dynamic programming over prefix sums. Without a feasibility
   check the previous row of the table is non-decreasing, so each cell is found by bisection:
   O(P * n * log n). With a check (memory limits) every candidate is scanned: O(P * n^2) at worst,
   pruned as soon as the segment alone exceeds the best value.
2. Among all splits whose parts stay within ``B*``, the one with the smallest sum of squared part
   costs, which spreads the slack evenly instead of leaving it all to the last part (a second DP,
   restricted to segments that fit under ``B*``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from smp.errors import PartitionError, PartitionMemoryError

__all__ = [
    "SegmentCheck",
    "SegmentPenalty",
    "chain_bottleneck",
    "min_bottleneck",
    "part_costs",
    "partition_chain",
    "split_under",
    "two_rank_vee",
    "vee_ends",
]

# fits(part, start, stop) -> whether items[start:stop] may form part `part` (e.g. memory limits).
# It must not depend on anything but its arguments; it may be called many times.
SegmentCheck = Callable[[int, int, int], bool]
# penalty(part, start, stop) -> extra cost of making items[start:stop] part `part` (e.g. bytes sent).
SegmentPenalty = Callable[[int, int, int], float]

# The refinement pass costs about P * n * window steps; past this it is skipped (B* stays optimal).
_REFINE_BUDGET = 4_000_000
_INF = math.inf


def _prefix(costs: Sequence[float]) -> list[float]:
    out = [0.0]
    for c in costs:
        out.append(out[-1] + float(c))
    return out


def _check_inputs(costs: Sequence[float], num_parts: int) -> None:
    if num_parts < 1:
        raise PartitionError(f"num_parts={num_parts}: a chain needs at least 1 part")
    bad = [i for i, c in enumerate(costs) if not (c >= 0.0 and math.isfinite(c))]
    if bad:
        raise PartitionError(
            f"block costs must be finite and >= 0; blocks {bad[:5]} are {[costs[i] for i in bad[:5]]}"
        )
    if len(costs) < num_parts:
        raise PartitionError(
            f"cannot split {len(costs)} block(s) into {num_parts} non-empty parts: every rank needs at least "
            f"one block. Fix: lower the number of pipeline stages to <= {len(costs)} or split the model finer"
        )


def _weights(weights: Sequence[float] | None, parts: int) -> list[float]:
    if weights is None:
        return [1.0] * parts
    w = [float(x) for x in weights]
    if len(w) != parts or any(not (x > 0 and math.isfinite(x)) for x in w):
        raise PartitionError(f"weights={list(weights)}: need {parts} finite positive numbers, one per part")
    return w


def _bottleneck_bisect(s: list[float], n: int, parts: int, w: Sequence[float]) -> float:
    """Optimal bottleneck without constraints; row k-1 is non-decreasing so bisect the crossing."""
    prev = [_INF] + [x / w[0] for x in s[1:]]  # one part: the prefix sum
    for k in range(2, parts + 1):
        cur = [_INF] * (n + 1)
        wk = w[k - 1]
        for j in range(k, n - (parts - k) + 1):
            lo, hi = k - 1, j - 1  # candidate starts of the last part
            while lo < hi:  # first i with prev[i] >= (s[j] - s[i]) / wk
                mid = (lo + hi) // 2
                if prev[mid] >= (s[j] - s[mid]) / wk:
                    hi = mid
                else:
                    lo = mid + 1
            best = max(prev[lo], (s[j] - s[lo]) / wk)
            if lo > k - 1:
                best = min(best, max(prev[lo - 1], (s[j] - s[lo - 1]) / wk))
            cur[j] = best
        prev = cur
    return prev[n]


def _bottleneck_scan(s: list[float], n: int, parts: int, fits: SegmentCheck, w: Sequence[float]) -> float:
    """Optimal bottleneck when segments must pass ``fits``; exhaustive over starts, pruned."""
    prev = [_INF] * (n + 1)
    for j in range(1, n - parts + 2):
        if fits(0, 0, j):
            prev[j] = s[j] / w[0]
    for k in range(2, parts + 1):
        cur = [_INF] * (n + 1)
        for j in range(k, n - (parts - k) + 1):
            best = _INF
            for i in range(j - 1, k - 2, -1):
                seg = (s[j] - s[i]) / w[k - 1]
                if seg >= best:
                    break
                if prev[i] < best and fits(k - 1, i, j):
                    best = min(best, max(prev[i], seg))
            cur[j] = best
        prev = cur
    return prev[n]


def _greedy_under(s: list[float], n: int, parts: int, limit: float, w: Sequence[float]) -> list[int] | None:
    """Greedy from the right: each part takes as many blocks as fit under ``limit`` (times its weight).

    Exact for the unconstrained problem (a split under the limit exists iff this one is under it).
    """
    bounds = [n]
    for k in range(parts - 1, 0, -1):
        j = bounds[-1]
        i = j - 1
        while i - 1 >= k and (s[j] - s[i - 1]) / w[k] <= limit:
            i -= 1
        bounds.append(i)
    bounds.append(0)
    bounds.reverse()
    if any((s[b] - s[a]) / w[k] > limit for k, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))):
        return None
    return bounds


def _dp_under(
    s: list[float], n: int, parts: int, limit: float, fits: SegmentCheck | None, penalty: SegmentPenalty | None,
    w: Sequence[float],
) -> list[int] | None:
    """Least (total penalty, sum of squared part costs), lexicographically, with parts <= limit
    (costs and the limit per unit of each part's weight)."""
    # dp[k][j]: best (penalty, squares) splitting the first j blocks into k parts under the limit.
    # Both components add up over parts, so lexicographic order is preserved by the recursion.
    none = (_INF, _INF)
    dp = [[none] * (n + 1) for _ in range(parts + 1)]
    arg = [[-1] * (n + 1) for _ in range(parts + 1)]
    dp[0][0] = (0.0, 0.0)
    for k in range(1, parts + 1):
        row, prev = dp[k], dp[k - 1]
        wk = w[k - 1]
        lo = 0
        for j in range(k, n - (parts - k) + 1):
            while (s[j] - s[lo]) / wk > limit:
                lo += 1
            for i in range(max(lo, k - 1), j):
                base = prev[i]
                if base[0] == _INF:
                    continue
                seg = (s[j] - s[i]) / wk
                pen = base[0] + (penalty(k - 1, i, j) if penalty is not None else 0.0)
                val = (pen, base[1] + seg * seg)
                if val < row[j] and (fits is None or fits(k - 1, i, j)):
                    row[j], arg[k][j] = val, i
    if dp[parts][n][0] == _INF:
        return None
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(arg[k][bounds[-1]])
    bounds.reverse()
    return bounds


def split_under(
    costs: Sequence[float],
    num_parts: int,
    limit: float,
    *,
    fits: SegmentCheck | None = None,
    penalty: SegmentPenalty | None = None,
    weights: Sequence[float] | None = None,
) -> list[int] | None:
    """Among splits whose parts all cost at most ``limit`` (and pass ``fits``), the one with the
    least total ``penalty(part, start, stop)``, then the least sum of squared part costs. With
    ``weights``, part ``k`` may cost ``limit * weights[k]`` and counts as its cost per weight.

    Returns boundaries, or None when no split stays under the limit. O(P * n * w) where w is the
    number of starts whose segment fits under the limit.

    Example:
        A penalty for cutting after block 1 (say a large tensor crosses there) moves the cut:

        >>> split_under([1, 1, 1, 1], 2, 3.0)
        [0, 2, 4]
        >>> split_under([1, 1, 1, 1], 2, 3.0, penalty=lambda k, i, j: 10.0 if (k, j) == (0, 2) else 0.0)
        [0, 1, 4]
    """
    _check_inputs(costs, num_parts)
    return _dp_under(_prefix(costs), len(costs), num_parts, limit, fits, penalty, _weights(weights, num_parts))


def min_bottleneck(costs: Sequence[float], num_parts: int, *, fits: SegmentCheck | None = None,
                   weights: Sequence[float] | None = None) -> float:
    """The least possible largest part cost (``math.inf`` when no split passes ``fits``).

    Example:
        >>> min_bottleneck([4, 6, 4, 2, 1, 4], 3)
        10.0
    """
    _check_inputs(costs, num_parts)
    s = _prefix(costs)
    n = len(costs)
    w = _weights(weights, num_parts)
    return _bottleneck_bisect(s, n, num_parts, w) if fits is None else _bottleneck_scan(s, n, num_parts, fits, w)


def _window_steps(s: list[float], n: int, limit: float) -> int:
    """How many (start, stop) pairs have a segment sum <= limit: the refinement's work per part."""
    steps, lo = 0, 0
    for j in range(1, n + 1):
        while s[j] - s[lo] > limit:
            lo += 1
        steps += j - lo
    return steps


def partition_chain(
    costs: Sequence[float],
    num_parts: int,
    *,
    fits: SegmentCheck | None = None,
    balance: bool = True,
    weights: Sequence[float] | None = None,
    ranks: Sequence[int] | None = None,
    microbatches: int = 8,
) -> list[int]:
    """Split ``costs`` into ``num_parts`` contiguous non-empty parts with the least bottleneck.

    Args:
        costs: the cost of each block, in execution order (any unit, >= 0).
        num_parts: how many parts (pipeline stages, or stages x virtual stages).
        fits: optional ``fits(part, start, stop)``: whether ``costs[start:stop]`` may be part
            ``part`` (memory limits, connectivity).
        balance: among optimal splits, return the one with the least sum of squared part costs
            (skipped on very large inputs, where the bottleneck is still optimal).
        weights: part ``k``'s share of the work (default 1 each): the bottleneck is the largest
            ``cost / weight``. A rank that runs two consecutive chain parts (the bottom of a V)
            is one part of weight 2.
        ranks: the rank of each part, when a rank runs several. For the V over 2 ranks
            (``a b a``) the split is exact for the step it estimates: ``microbatches`` times the
            larger of the two ranks' sums plus how far apart its first and last part are (the
            pipeline's fill and drain, `_two_rank_vee`); other placements use the per-part
            bottleneck.
        microbatches: microbatches per step (only the V over 2 ranks uses it).

    Returns:
        Boundaries ``[0, b1, ..., n]``: part ``k`` is ``costs[b[k]:b[k+1]]``.

    Raises:
        PartitionError: fewer blocks than parts, or a negative cost.
        PartitionMemoryError: no split passes ``fits``.

    Example:
        Blocks ``4 6 4 2 1 4`` over 3 parts. No split beats a bottleneck of 10: either the 6
        shares a part with a neighbouring 4, or it sits alone and the last part holds
        ``4 2 1 4`` = 11. Four splits reach 10; the second pass keeps the most even one:

        ====================  ===========  ===============
        split                 part costs   sum of squares
        ====================  ===========  ===============
        ``[4 6] [4 2] [1 4]``  10  6  5     161  (chosen)
        ``[4] [6 4] [2 1 4]``   4 10  7     165
        ``[4 6] [4] [2 1 4]``  10  4  7     165
        ``[4 6] [4 2 1] [4]``  10  7  4     165
        ====================  ===========  ===============

        >>> partition_chain([4, 6, 4, 2, 1, 4], 3)
        [0, 2, 4, 6]
        >>> part_costs([4, 6, 4, 2, 1, 4], [0, 2, 4, 6])
        [10.0, 6.0, 5.0]
    """
    _check_inputs(costs, num_parts)
    n = len(costs)
    s = _prefix(costs)
    w = _weights(weights, num_parts)
    if ranks is not None and two_rank_vee(ranks):
        bounds = _two_rank_vee(s, n, fits, microbatches)
        if bounds is None:
            raise PartitionMemoryError(f"no split of {n} blocks into a V over 2 ranks satisfies the segment limits")
        return bounds
    best = _bottleneck_bisect(s, n, num_parts, w) if fits is None else _bottleneck_scan(s, n, num_parts, fits, w)
    if best == _INF:
        raise PartitionMemoryError(
            f"no split of {n} blocks into {num_parts} parts satisfies the segment limits (memory); "
            "the caller's error names the ranks and sizes"
        )
    # Segment sums are recomputed from the same prefix array, so comparing against `best` is exact.
    refine = fits is not None  # the greedy reconstruction ignores `fits`; the DP honours it
    if balance and not refine:
        refine = num_parts * _window_steps(s, n, best * max(w)) <= _REFINE_BUDGET
    bounds = _dp_under(s, n, num_parts, best, fits, None, w) if refine else _greedy_under(s, n, num_parts, best, w)
    if bounds is None:  # cannot happen: pass 1 proved a split under `best` exists
        raise PartitionError(f"internal error: no split under the optimal bottleneck {best}")
    return bounds


def two_rank_vee(ranks: Sequence[int]) -> bool:
    """Whether parts on ``ranks`` are the V over 2 ranks, ``a b a`` (the bottom merged)."""
    return len(ranks) == 3 and ranks[0] == ranks[2] != ranks[1]


def vee_ends(first: float, last: float, microbatches: int) -> float:
    """What the V over 2 ranks pays per microbatch for ends of unequal cost (`_two_rank_vee`)."""
    return abs(first - last) / microbatches


def _two_rank_vee(s: list[float], n: int, fits: SegmentCheck | None, microbatches: int) -> list[int] | None:
    """Boundaries ``[0, i, j, n]`` of the V ``a b a``: the middle part ``[i, j)`` on one rank, both
    ends on the other. Every (i, j) is tried (O(n^2)) for the least estimated step, per microbatch

        max(middle, ends) + |first - last| / microbatches

    The first term is the steady state: each rank's work per microbatch, the larger one paced. The
    second is the fill and the drain: before the other rank starts, the first microbatch runs the
    first part alone, and after its last backward the last one runs the first part's backward
    alone; the last part does the same at the bottom of the V, so what a lopsided pair of ends
    costs over an even one is about their difference. Simulated with measured costs of the HF
    Llama of benchmarks/bench_pipeline.py (4.5 layers in the middle, 8 microbatches, zb_v's plan):
    ends of 3.5 layers and the head 689 ms, 2.5 and 1 + head 650, 1.5 and 2 + head 659; the
    estimate orders them the same (x 8 microbatches: 676 / 643 / 664). A least-max rule with a
    1 % tie band picked among the three by the noise of the traced layer times."""
    total = s[n]
    found = [(max(s[j] - s[i], total - s[j] + s[i]) + vee_ends(s[i], total - s[j], microbatches), i, j)
             for i in range(1, n - 1) if fits is None or fits(0, 0, i)
             for j in range(i + 1, n) if fits is None or (fits(1, i, j) and fits(2, j, n))]
    if not found:
        return None
    _, i, j = min(found)
    return [0, i, j, n]


def part_costs(costs: Sequence[float], boundaries: Sequence[int]) -> list[float]:
    """The cost of each part of a split given by its boundaries.

    Example:
        >>> part_costs([4, 2, 3, 1, 5], [0, 2, 4, 5])
        [6.0, 4.0, 5.0]
    """
    s = _prefix(costs)
    return [s[b] - s[a] for a, b in zip(boundaries, boundaries[1:], strict=False)]


def chain_bottleneck(costs: Sequence[float], boundaries: Sequence[int]) -> float:
    """The largest part cost of a split (what the pipeline waits on)."""
    return max(part_costs(costs, boundaries))
