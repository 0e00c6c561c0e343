"""Exact pipeline split of a small DAG by dynamic programming over its ideals.

A split of a DAG into ``P`` pieces where every edge goes to the same or a later piece is a chain
of *ideals* (sets closed under predecessors) ``{} = I0 < I1 < ... < IP = V``; piece ``k`` is
``Ik - I(k-1)``. When the DAG is narrow (few parallel branches) it has few ideals, and the least
bottleneck over *all* such splits is found exactly by a DP over pairs of ideals; a second pass
takes, among splits within the allowed slack, the one sending the fewest bytes. Topological-order
heuristics miss the best split of a branchy block by up to a third; this does not.

Example, two branches ``a -> b1 -> b2 -> d`` and ``a -> c1 -> c2 -> d`` with costs
``a=0 b1=3 b2=3 c1=1 c2=5 d=0``, 2 pieces (total 12, ideal 6)::

    program order  a b1 c1 b2 c2 d   best cut: [a b1 c1 b2 | c2 d]   7 | 5
    ideals         {a, b1, b2} | {c1, c2, d}                          6 | 6   (exact)
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ideal_split"]

# Past this many ideals the DP (quadratic in their number) is left to the heuristics.
MAX_IDEALS = 600


def _ideals(preds: Sequence[int], costs: Sequence[float], limit: int) -> dict[int, float] | None:
    """Every ideal as a bitmask -> its cost, or None when there are more than ``limit``."""
    n = len(preds)
    found = {0: 0.0}
    frontier = [0]
    while frontier:
        nxt = []
        for ideal in frontier:
            for g in range(n):
                bit = 1 << g
                if not ideal & bit and preds[g] & ideal == preds[g]:
                    grown = ideal | bit
                    if grown not in found:
                        found[grown] = found[ideal] + costs[g]
                        nxt.append(grown)
                        if len(found) > limit:
                            return None
        frontier = nxt
    return found


def ideal_split(
    preds: Sequence[int],
    costs: Sequence[float],
    num_parts: int,
    *,
    slack: float,
    neighbours: Sequence[int] | None = None,
    tensors: Sequence[tuple[int, int, int]] = (),
    max_ideals: int = MAX_IDEALS,
) -> tuple[list[int], float] | None:
    """The exact least-bottleneck split of a DAG into ordered pieces, then the fewest bytes sent.

    Args:
        preds: per node, the bitmask of its direct predecessors.
        costs: per node, its cost.
        num_parts: number of pieces (each non-empty).
        slack: pieces may cost up to ``(1 + slack)`` times the least bottleneck to send fewer bytes.
        neighbours: per node, the bitmask of its neighbours (either direction); when given every
            piece must be connected.
        tensors: ``(producer node, consumer mask, bytes)``; a tensor costs its bytes once when its
            piece ends before one of its consumers.
        max_ideals: give up (return None) past this many ideals.

    Returns:
        ``(piece of each node, least bottleneck)``, or None when the DAG has too many ideals or no
        split exists.

    Example:
        >>> # diamond a -> b, a -> c, b -> d, c -> d
        >>> ideal_split([0b0000, 0b0001, 0b0001, 0b0110], [1.0, 4.0, 1.0, 4.0], 2, slack=0.0)
        ([0, 0, 1, 1], 5.0)
    """
    n = len(costs)
    if num_parts < 1 or num_parts > n:
        return None
    found = _ideals(preds, costs, max_ideals)
    if found is None:
        return None
    full = (1 << n) - 1
    order = sorted(found, key=lambda m: (bin(m).count("1"), m))
    connected: dict[int, bool] = {}

    def piece_ok(piece: int) -> bool:
        if neighbours is None:
            return True
        hit = connected.get(piece)
        if hit is None:
            start = piece & -piece
            seen, stack = start, [start.bit_length() - 1]
            while stack:
                g = stack.pop()
                fresh = neighbours[g] & piece & ~seen
                seen |= fresh
                while fresh:
                    low = fresh & -fresh
                    stack.append(low.bit_length() - 1)
                    fresh ^= low
            hit = connected[piece] = seen == piece
        return hit

    inf = float("inf")
    # Pass 1: least bottleneck.
    prev: dict[int, float] = {0: 0.0}
    for _ in range(num_parts):
        cur: dict[int, float] = {}
        for j in order:
            cj, best = found[j], inf
            for i, bi in prev.items():
                if i == j or i & j != i:
                    continue
                seg = cj - found[i]
                val = max(bi, seg)
                if val < best and piece_ok(j & ~i):
                    best = val
            if best < inf:
                cur[j] = best
        prev = cur
    if full not in prev:
        return None
    bottleneck = prev[full]
    limit = (1.0 + slack) * bottleneck + 1e-12 * max(1.0, bottleneck)
    # Pass 2: fewest bytes, then most even, with every piece under the limit.
    leaving: dict[tuple[int, int], float] = {}

    def sent(i: int, j: int) -> float:
        key = (i, j)
        if key not in leaving:
            piece = j & ~i
            leaving[key] = float(sum(b for p, cons, b in tensors if piece >> p & 1 and cons & ~j))
        return leaving[key]

    table: list[dict[int, tuple[float, float, int]]] = [{0: (0.0, 0.0, -1)}]
    for _ in range(num_parts):
        row: dict[int, tuple[float, float, int]] = {}
        for j in order:
            cj = found[j]
            best_t: tuple[float, float, int] | None = None
            for i, (pen, sq, _) in table[-1].items():
                if i == j or i & j != i:
                    continue
                seg = cj - found[i]
                if seg > limit or not piece_ok(j & ~i):
                    continue
                cand = (pen + sent(i, j), sq + seg * seg, i)
                if best_t is None or cand[:2] < best_t[:2]:
                    best_t = cand
            if best_t is not None:
                row[j] = best_t
        table.append(row)
    if full not in table[-1]:
        return None
    piece_of = [0] * n
    j = full
    for k in range(num_parts, 0, -1):
        i = table[k][j][2]
        for g in range(n):
            if (j & ~i) >> g & 1:
                piece_of[g] = k - 1
        j = i
    return piece_of, bottleneck
