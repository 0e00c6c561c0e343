"""Automatic partitioning of an op DAG (the TensorFlow frontend's unit is the op).

Algorithm (`partition_op_graph`):

1. **Groups.** Ops that read the same variable, belong to the same layer scope or share a
   colocation group must share a rank (union-find, ``opgroups.py``).
2. **Exact when cheap.** When the graph of groups is acyclic and narrow (at most a few hundred
   ideals), the best split over *all* pipeline-ordered splits is found by a DP over ideals
   (``ideals.py``), and steps 3-4 are skipped.
3. **Orders.** Two topological orders of the ops are tried: program order, and a group-affine
   depth-first order that keeps layers and branches together. In an order, consecutive ops of one
   group form a *run*, the unit of work.
4. **Split.** The runs are cut into ``num_ranks`` pieces in chain order; piece ``k`` runs on rank
   ``k``. A group split into several runs (a layer called twice, an embedding table also read by
   the output layer) is glued: all its runs go to one rank and the chain revisits that rank
   (``0 -> 1 -> 0``). Every edge goes from a chain position to the same or a later one, so the
   result is acyclic in pipeline order by construction. First the least bottleneck ``B*`` is
   found exactly, then, among splits whose pieces stay within ``(1 + balance_slack) * B*``, the
   one sending the fewest bytes: a tensor counts once when its piece ends before its last consumer.
5. **Contiguity.** With ``contiguous=True`` every piece is a connected subgraph (SMP v1), unless
   the graph itself is disconnected, in which case the rule is relaxed and the report says so.

Balance: ``optimize="memory"`` balances variable bytes, ``"speed"`` op cost (op count when no
costs are known); ``memory_weight`` blends the two instead.

Example, a two-branch block (``a`` feeds ``b1`` and ``c1``, which meet in ``d``)::

    a -> b1 -> b2 --\\          program order   a b1 c1 b2 c2 d   interleaves the branches
     \\-> c1 -> c2 --> d       depth-first     a b1 b2 c1 c2 d   keeps each branch whole
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence

from smp.errors import PartitionError
from smp.partition.chain import SegmentCheck, SegmentPenalty
from smp.partition.cost import OPTIMIZE_CHOICES, CostModel
from smp.partition.glue import GluedSplit, Reduction, resplit, split_glued
from smp.partition.ideals import ideal_split
from smp.partition.opgraph import OpGraph
from smp.partition.opgroups import Connectivity, constraint_groups, is_connected, op_orders, runs
from smp.partition.opresult import OpGroup, OpPartition

__all__ = ["partition_op_graph"]

_FitsFactory = Callable[[Reduction], SegmentCheck]
_PenaltyFactory = Callable[[Reduction], SegmentPenalty]


def partition_op_graph(
    graph: OpGraph,
    num_ranks: int,
    *,
    optimize: str = "speed",
    contiguous: bool = True,
    memory_weight: float | None = None,
    balance_slack: float = 0.05,
    param_memory_factor: float = 4.0,
) -> OpPartition:
    """Assign every op of ``graph`` to one of ``num_ranks`` pipeline ranks.

    Args:
        graph: the op DAG (see `OpGraph`).
        num_ranks: pipeline ranks (``partitions`` / ``pipeline_parallel_degree``).
        optimize: ``"speed"`` balances op cost, ``"memory"`` variable bytes.
        contiguous: each piece of the chain is a connected subgraph (relaxed if the graph is not).
        memory_weight: if given, balance ``w * memory + (1 - w) * compute`` instead.
        balance_slack: how far above the least bottleneck a split may go to send fewer bytes.
        param_memory_factor: bytes held per variable byte (for the report).

    Returns:
        An `OpPartition`; every edge goes to the same or a later position of its chain.

    Raises:
        PartitionError: bad arguments, fewer indivisible groups than ranks, or no connected split.

    Example:
        >>> from smp.partition.opgraph import OpEdge, OpNode
        >>> ops = [OpNode(f"l{i}/op", cost=1.0, variables={f"l{i}/w": 16}, layer=f"l{i}") for i in range(4)]
        >>> edges = [OpEdge(f"l{i}/op", f"l{i + 1}/op", 8) for i in range(3)]
        >>> part = partition_op_graph(OpGraph(ops, edges), 2)
        >>> [part.rank_of(f"l{i}/op") for i in range(4)], part.cut_bytes, part.chain()
        ([0, 0, 1, 1], 8, (0, 1))
    """
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise PartitionError(f"num_ranks={num_ranks!r} must be an int >= 1 (pipeline_parallel_degree)")
    if optimize not in OPTIMIZE_CHOICES:
        raise PartitionError(f"optimize={optimize!r} is not one of {OPTIMIZE_CHOICES}")
    if balance_slack < 0:
        raise PartitionError(f"balance_slack={balance_slack!r} must be >= 0")
    nodes = list(graph)
    names = [n.name for n in nodes]
    index = {name: i for i, name in enumerate(names)}
    group = constraint_groups(graph)
    if len(set(group)) < num_ranks:
        raise PartitionError(
            f"the op graph has only {len(set(group))} indivisible group(s) (ops sharing a variable, a layer or a "
            f"colocation group stay together) for {num_ranks} rank(s). Fix: lower the number of partitions "
            "or split large layers"
        )
    weight = memory_weight if memory_weight is not None else (1.0 if optimize == "memory" else 0.0)
    notes: list[str] = []
    check_connected = contiguous and is_connected(graph)
    if contiguous and not check_connected:
        notes.append("contiguous=True relaxed: the op graph itself is not connected")
    exact = _exact(graph, group, weight, num_ranks, balance_slack, check_connected)
    if exact is not None:
        described, ranks = exact
        assignment = {op: r for g, r in zip(described, ranks, strict=True) for op in g.ops}
        notes.append(f"exact split over all {len(described)} op groups (ideal DP)")
        return OpPartition(graph, assignment, num_ranks, tuple(described), tuple(ranks),
                           _cut_bytes(graph, assignment), param_memory_factor, tuple(notes))
    candidates: list[tuple[list[OpGroup], list[int], _FitsFactory | None, GluedSplit]] = []
    for order in op_orders(graph, group):
        pieces = runs(order, group)
        described = _describe(graph, pieces, weight)
        keys: list[frozenset[Hashable]] = [frozenset({group[p[0]]}) for p in pieces]
        item_of = [0] * len(nodes)
        for k, p in enumerate(pieces):
            for op in p:
                item_of[op] = k
        make_fits = _connectivity_factory(_item_links(graph, index, item_of, len(pieces))) if check_connected else None
        split = split_glued([g.cost for g in described], keys, num_ranks, make_fits=make_fits)
        if split is not None:
            candidates.append((described, item_of, make_fits, split))
    if not candidates:
        raise PartitionError(
            f"no split of the op graph into {num_ranks} connected pieces exists (contiguous=True). Fix: set "
            "contiguous: False or lower the number of partitions"
        )
    limit = (1.0 + balance_slack) * min(c[3].bottleneck for c in candidates)
    best: tuple[tuple[float, float, float, int, float], list[OpGroup], GluedSplit] | None = None
    for described, item_of, make_fits, split in candidates:
        refined = resplit(split, [g.cost for g in described], num_ranks, limit, make_fits=make_fits,
                          make_penalty=_bytes_factory(graph, index, item_of)) or split
        parts = refined.part_of_item
        assignment = {names[op]: parts[item_of[op]] for op in range(len(nodes))}
        broken = check_connected and not _pieces_connected(graph, described, parts)
        key = (float(broken), float(_cut_bytes(graph, assignment)), *refined.key())
        if best is None or key < best[0]:
            best = (key, described, refined)
    if best is None:  # cannot happen: candidates is not empty
        raise PartitionError("internal error: no op partition candidate")
    (broken_flag, *_), described, split = best
    if broken_flag:
        notes.append("contiguous=True relaxed: ops sharing variables or layers across the chain leave no split "
                     "whose every piece is connected")
    assignment = {op: split.part_of_item[k] for k, g in enumerate(described) for op in g.ops}
    return OpPartition(graph, assignment, num_ranks, tuple(described), split.part_of_item,
                       _cut_bytes(graph, assignment), param_memory_factor, tuple(notes))


def _exact(
    graph: OpGraph, group: Sequence[int], weight: float, num_ranks: int, slack: float, connected: bool
) -> tuple[list[OpGroup], list[int]] | None:
    """The ideal DP on the group DAG, when it is acyclic and narrow enough; groups in chain order."""
    names = [n.name for n in graph]
    index = {name: i for i, name in enumerate(names)}
    count = max(group) + 1 if group else 0
    members: list[list[int]] = [[] for _ in range(count)]
    for op, g in enumerate(group):
        members[g].append(op)
    preds = [0] * count
    nbrs = [0] * count
    spans: dict[str, list[int]] = {}  # tensor -> [producer group, consumer mask, bytes]
    for e in graph.edges:
        a, b = group[index[e.src]], group[index[e.dst]]
        if a == b:
            continue
        preds[b] |= 1 << a
        nbrs[a] |= 1 << b
        nbrs[b] |= 1 << a
        span = spans.setdefault(e.tensor_key, [a, 0, e.bytes])
        span[1] |= 1 << b
        span[2] = max(span[2], e.bytes)
    topo = _group_topo(preds)
    if topo is None:  # glued groups make a cycle: the run heuristics handle revisits
        return None
    described = _describe(graph, members, weight)
    found = ideal_split(preds, [g.cost for g in described], num_ranks, slack=slack,
                        neighbours=nbrs if connected else None,
                        tensors=[(a, mask, size) for a, mask, size in spans.values()])
    if found is None:
        return None
    piece_of, _ = found
    chain_order = sorted(range(count), key=lambda g: (piece_of[g], topo.index(g)))
    return [described[g] for g in chain_order], [piece_of[g] for g in chain_order]


def _group_topo(preds: Sequence[int]) -> list[int] | None:
    """A topological order of the groups (by index among ready ones), or None on a cycle."""
    done, order = 0, []
    remaining = set(range(len(preds)))
    while remaining:
        ready = [g for g in sorted(remaining) if preds[g] & ~done == 0]
        if not ready:
            return None
        for g in ready:
            order.append(g)
            done |= 1 << g
            remaining.discard(g)
    return order


def _describe(graph: OpGraph, pieces: Sequence[Sequence[int]], memory_weight: float) -> list[OpGroup]:
    ops = list(graph)
    var_bytes = graph.variables()
    use_count = sum(n.cost for n in ops) <= 0
    seen: set[str] = set()
    raw = []
    for ms in pieces:
        variables = sorted({v for i in ms for v in ops[i].variables})
        fresh = [v for v in variables if v not in seen]  # a variable's bytes count once, on its first run
        seen.update(fresh)
        compute = float(len(ms)) if use_count else sum(ops[i].cost for i in ms)
        layers = sorted({layer for i in ms if (layer := ops[i].layer) is not None})
        label = ",".join(layers) if layers else ops[ms[0]].name
        if len(label) > 48:
            label = label[:45] + "..."
        if len(ms) > 1 and not layers:
            label += f" (+{len(ms) - 1} ops)"
        raw.append((tuple(ops[i].name for i in ms), label, tuple(variables), sum(var_bytes[v] for v in fresh),
                    sum(graph.variable_elements(v) for v in fresh), compute))
    model = CostModel(memory_weight=memory_weight, total_memory=float(sum(r[3] for r in raw)),
                      total_compute=sum(r[5] for r in raw), param_memory_factor=1.0)
    return [OpGroup(o, lab, v, vb, pc, comp, model.cost(vb, 0, comp)) for o, lab, v, vb, pc, comp in raw]


def _item_links(graph: OpGraph, index: Mapping[str, int], item_of: Sequence[int], n_items: int) -> list[set[int]]:
    links: list[set[int]] = [set() for _ in range(n_items)]
    for e in graph.edges:
        a, b = item_of[index[e.src]], item_of[index[e.dst]]
        if a != b:
            links[a].add(b)
            links[b].add(a)
    return links


def _connectivity_factory(links: Sequence[set[int]]) -> _FitsFactory:
    """Connectivity of DP parts; items glued away to another rank act as bridges between their neighbours.

    The exact rule (every final chain piece connected) is verified on the result afterwards.
    """

    def make(reduction: Reduction) -> SegmentCheck:
        pos_of: dict[int, int] = {}
        for pos, placed in enumerate(reduction.placed):
            for item in placed:
                pos_of[item] = pos
        nb: list[set[int]] = [set() for _ in reduction.placed]
        for item, item_links in enumerate(links):
            near = {pos_of[w] for w in item_links if w in pos_of}
            if item in pos_of:
                nb[pos_of[item]].update(near - {pos_of[item]})
            else:  # glued away: it links all its placed neighbours
                for a in near:
                    nb[a].update(near - {a})
        return Connectivity(nb)

    return make


def _bytes_factory(graph: OpGraph, index: Mapping[str, int], item_of: Sequence[int]) -> _PenaltyFactory:
    """Penalty of a piece: bytes of tensors made in it and still needed after it."""

    def make(reduction: Reduction) -> SegmentPenalty:
        pos_of: dict[int, int] = {}
        for pos, carried in enumerate(reduction.carried):
            for item in carried:
                pos_of[item] = pos
        spans: dict[str, list[int]] = {}  # tensor -> [producer position, last consumer position, bytes]
        for e in graph.edges:
            a, b = pos_of[item_of[index[e.src]]], pos_of[item_of[index[e.dst]]]
            if a < b:
                span = spans.setdefault(e.tensor_key, [a, b, e.bytes])
                span[1] = max(span[1], b)
                span[2] = max(span[2], e.bytes)
        n = len(reduction.carried)
        cache: dict[int, list[float]] = {}

        def leaving(part: int, i: int, j: int) -> float:
            if j >= n:
                return 0.0
            prefix = cache.get(j)
            if prefix is None:
                prefix = [0.0] * (j + 1)
                for producer, last, size in spans.values():
                    if producer < j <= last:
                        prefix[producer + 1] += size
                for x in range(1, j + 1):
                    prefix[x] += prefix[x - 1]
                cache[j] = prefix
            return prefix[j] - prefix[i]

        return leaving

    return make


def _pieces_connected(graph: OpGraph, runs_in_order: Sequence[OpGroup], ranks: Sequence[int]) -> bool:
    """Whether every chain piece (consecutive runs on one rank) is a connected subgraph."""
    pieces: list[set[str]] = []
    for k, run in enumerate(runs_in_order):
        if k == 0 or ranks[k] != ranks[k - 1]:
            pieces.append(set())
        pieces[-1].update(run.ops)
    for ops in pieces:
        start = next(iter(ops))
        seen, stack = {start}, [start]
        while stack:
            x = stack.pop()
            for y in (*graph.successors(x), *graph.predecessors(x)):
                if y in ops and y not in seen:
                    seen.add(y)
                    stack.append(y)
        if len(seen) != len(ops):
            return False
    return True


def _cut_bytes(graph: OpGraph, assignment: Mapping[str, int]) -> int:
    """Bytes sent per microbatch: each tensor once per rank, other than its producer's, that reads it."""
    receivers: dict[str, tuple[int, set[int]]] = {}
    for e in graph.edges:
        src, dst = assignment[e.src], assignment[e.dst]
        size, ranks = receivers.setdefault(e.tensor_key, (e.bytes, set()))
        if dst != src:
            ranks.add(dst)
        receivers[e.tensor_key] = (max(size, e.bytes), ranks)
    return sum(size * len(ranks) for size, ranks in receivers.values())

