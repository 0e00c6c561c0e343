"""Constraint groups, execution orders and runs of an op DAG (helpers of ``ops.py``).

- `constraint_groups`: ops reading the same variable, in the same layer scope or in the same
  colocation group must share a rank (union-find).
- `op_orders`: topological orders of the ops to cut into a chain: program order, and a
  group-affine depth-first order (stay in the group just placed, then follow the op just placed),
  which keeps layers and branches together.
- `runs`: consecutive ops of one group in an order form one work item; a group split into several
  runs (a layer called twice, a tied embedding) is glued across the chain (see ``glue.py``).
- `Connectivity`: whether a run of chain positions is a connected subgraph (``contiguous=True``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from smp.partition.opgraph import OpGraph

__all__ = ["Connectivity", "constraint_groups", "is_connected", "op_orders", "runs"]


def constraint_groups(graph: OpGraph) -> list[int]:
    """Group id of each op (in program order); ops sharing a variable, layer or colocation group match.

    A *free* op (no variable, no layer, no colocation group: a loss, a reshape between layers)
    whose inputs all come from one group joins that group, so it runs where its input is instead
    of costing a hop of its own. A free op joining several groups (a concat) stays on its own.

    Example:
        >>> from smp.partition.opgraph import OpEdge, OpNode
        >>> g = OpGraph([OpNode("a", variables={"w": 4}), OpNode("b"), OpNode("c", variables={"w": 4}),
        ...              OpNode("loss")], [OpEdge("c", "loss")])
        >>> constraint_groups(g)
        [0, 1, 0, 0]
    """
    nodes = list(graph)
    parent = list(range(len(nodes)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    first: dict[tuple[str, str], int] = {}
    for i, node in enumerate(nodes):
        keys = [("var", v) for v in node.variables]
        if node.layer is not None:
            keys.append(("layer", node.layer))
        if node.colocation is not None:
            keys.append(("coloc", node.colocation))
        for key in keys:
            if key in first:
                ra, rb = find(first[key]), find(i)
                parent[max(ra, rb)] = min(ra, rb)
            else:
                first[key] = i
    index = {n.name: i for i, n in enumerate(nodes)}
    for i in _topological(graph, index):
        node = nodes[i]
        sources = {find(index[p]) for p in graph.predecessors(node.name)}
        if len(sources) == 1 and not node.variables and node.layer is None and node.colocation is None:
            ra, rb = sources.pop(), find(i)
            parent[max(ra, rb)] = min(ra, rb)
    roots: dict[int, int] = {}
    return [roots.setdefault(find(i), len(roots)) for i in range(len(nodes))]


def _topological(graph: OpGraph, index: dict[str, int]) -> list[int]:
    indeg = {n.name: len(graph.predecessors(n.name)) for n in graph}
    ready = [n.name for n in graph if indeg[n.name] == 0]
    out: list[int] = []
    while ready:
        name = ready.pop(0)
        out.append(index[name])
        for s in graph.successors(name):
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    return out


def op_orders(graph: OpGraph, group: Sequence[int]) -> list[list[int]]:
    """Program-order and group-affine depth-first topological orders of the ops (indices)."""
    names = [n.name for n in graph]
    index = {name: i for i, name in enumerate(names)}
    succ = [[index[s] for s in graph.successors(name)] for name in names]
    n = len(names)
    orders: list[list[int]] = []
    for affine in (False, True):
        indeg = [0] * n
        for out in succ:
            for b in out:
                indeg[b] += 1
        ready: list[tuple[int, int, int]] = [(0, 0, i) for i in range(n) if indeg[i] == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            if affine and order:
                # Re-key the ready set: same group as the last op first, then most recently freed.
                last = group[order[-1]]
                ready = [(0 if group[i] == last else 1, t, i) for _, t, i in ready]
                heapq.heapify(ready)
            _, _, op = heapq.heappop(ready)
            order.append(op)
            for b in succ[op]:
                indeg[b] -= 1
                if indeg[b] == 0:
                    heapq.heappush(ready, (0, -len(order) if affine else b, b))
        orders.append(order)
    return orders if orders[0] != orders[1] else orders[:1]


def runs(order: Sequence[int], group: Sequence[int]) -> list[list[int]]:
    """Consecutive ops of one group, as lists of op indices.

    Example:
        >>> runs([0, 1, 2, 3], [5, 5, 6, 5])
        [[0, 1], [2], [3]]
    """
    out: list[list[int]] = []
    for op in order:
        if out and group[out[-1][-1]] == group[op]:
            out[-1].append(op)
        else:
            out.append([op])
    return out


class Connectivity:
    """Whether positions [i, j) form a connected subgraph (undirected), given each position's neighbours."""

    def __init__(self, neighbours: Sequence[set[int]]) -> None:
        self.nb = neighbours
        self.cache: dict[int, list[bool]] = {}  # j -> connected[j - 1 - i] for the scanned i

    def __call__(self, part: int, i: int, j: int) -> bool:
        done = self.cache.get(j)
        if done is None or len(done) < j - i:
            done = self._scan(j, i)
            self.cache[j] = done
        return done[j - 1 - i]

    def _scan(self, j: int, lowest: int) -> list[bool]:
        parent: dict[int, int] = {}

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        comps = 0
        out = []
        for i in range(j - 1, lowest - 1, -1):
            parent[i] = i
            comps += 1
            for w in self.nb[i]:
                if i < w < j:
                    ra, rb = find(i), find(w)
                    if ra != rb:
                        parent[ra] = rb
                        comps -= 1
            out.append(comps == 1)
        return out


def is_connected(graph: OpGraph) -> bool:
    """Whether the op graph is weakly connected."""
    names = [n.name for n in graph]
    if not names:
        return True
    seen = {names[0]}
    stack = [names[0]]
    while stack:
        x = stack.pop()
        for y in (*graph.successors(x), *graph.predecessors(x)):
            if y not in seen:
                seen.add(y)
                stack.append(y)
    return len(seen) == len(names)
