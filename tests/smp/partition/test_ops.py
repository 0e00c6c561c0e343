"""Op-DAG partitioning on synthetic graphs shaped like real models (skips, branches, shared variables)."""

from __future__ import annotations

import itertools
import random

import pytest

from smp.errors import PartitionError
from smp.partition import OpEdge, OpGraph, OpNode, OpPartition, partition_op_graph
from tests.smp.partition.builders import branchy_graph, transformer_graph


def _check_invariants(graph: OpGraph, part: OpPartition, *, contiguous: bool) -> None:
    chain = part.chain()
    # Acyclic in pipeline order: every edge goes to the same or a later position of the chain.
    for e in graph.edges:
        assert part.position_of(e.src) <= part.position_of(e.dst), e
    for node in graph:
        assert chain[part.position_of(node.name)] == part.rank_of(node.name)
    # Ops reading one variable, or in one layer, or one colocation group, share a rank.
    by_key: dict[tuple[str, str], set[int]] = {}
    for node in graph:
        for v in node.variables:
            by_key.setdefault(("var", v), set()).add(part.rank_of(node.name))
        if node.layer is not None:
            by_key.setdefault(("layer", node.layer), set()).add(part.rank_of(node.name))
        if node.colocation is not None:
            by_key.setdefault(("coloc", node.colocation), set()).add(part.rank_of(node.name))
    assert all(len(r) == 1 for r in by_key.values()), {k: r for k, r in by_key.items() if len(r) > 1}
    assert set(part.assignment.values()) == set(range(part.num_ranks)), "every rank gets ops"
    if contiguous:
        for pos in range(len(chain)):
            ops = {n.name for n in graph if part.position_of(n.name) == pos}
            start = next(iter(ops))
            seen, stack = {start}, [start]
            while stack:
                x = stack.pop()
                for y in (*graph.successors(x), *graph.predecessors(x)):
                    if y in ops and y not in seen:
                        seen.add(y)
                        stack.append(y)
            assert seen == ops, f"chain position {pos} is not connected"


def _bottleneck(part: OpPartition) -> float:
    return max(r.cost for r in part.report().ranks)


def _brute_force(graph: OpGraph, part: OpPartition, *, contiguous: bool = False) -> float:
    """Least bottleneck over every monotone assignment of the same groups (all ranks non-empty)."""
    groups = part.groups
    index = {op: g for g, grp in enumerate(groups) for op in grp.ops}
    edges = {(index[e.src], index[e.dst]) for e in graph.edges if index[e.src] != index[e.dst]}
    best = float("inf")
    for ranks in itertools.product(range(part.num_ranks), repeat=len(groups)):
        if len(set(ranks)) < part.num_ranks or any(ranks[a] > ranks[b] for a, b in edges):
            continue
        if contiguous and not all(_connected({g for g, r in enumerate(ranks) if r == k}, edges)
                                  for k in range(part.num_ranks)):
            continue
        loads = [0.0] * part.num_ranks
        for g, r in zip(groups, ranks, strict=True):
            loads[r] += g.cost
        best = min(best, max(loads))
    return best


def _connected(nodes: set[int], edges: set[tuple[int, int]]) -> bool:
    start = next(iter(nodes))
    seen, stack = {start}, [start]
    while stack:
        x = stack.pop()
        for a, b in edges:
            for u, v in ((a, b), (b, a)):
                if u == x and v in nodes and v not in seen:
                    seen.add(v)
                    stack.append(v)
    return seen == nodes


def test_transformer_like_graph_with_tied_embedding() -> None:
    rng = random.Random(1)
    for layers, p in ((4, 2), (6, 3), (8, 4)):
        graph = transformer_graph(rng, layers, tied=True)
        part = partition_op_graph(graph, p)
        _check_invariants(graph, part, contiguous=True)
        # The head reads the embedding table: same rank as the embedding, the chain comes back to it.
        assert part.rank_of("head/matmul") == part.rank_of("embed/gather")
        assert part.variable_ranks()["embed/table"] == part.rank_of("embed/gather")
        chain = part.chain()
        assert len(chain) == p + 1 and chain[0] == chain[-1] and sorted(set(chain)) == list(range(p))


def test_untied_transformer_is_balanced_within_slack_of_brute_force() -> None:
    rng = random.Random(2)
    for layers, p in ((4, 2), (5, 3), (6, 3)):
        graph = transformer_graph(rng, layers, tied=False)
        part = partition_op_graph(graph, p)
        _check_invariants(graph, part, contiguous=True)
        assert _bottleneck(part) <= 1.05 * _brute_force(graph, part) + 1e-12


def test_layer_around_an_outside_op_is_glued_not_cyclic() -> None:
    # Layer L has ops before and after "mid", which is outside L: L's two runs share a rank and
    # the chain may come back to it, but no edge goes backwards along the chain.
    ops = [OpNode("in", 1.0, layer="a"), OpNode("L/pre", 1.0, layer="L"), OpNode("mid", 3.0, layer="M"),
           OpNode("L/post", 1.0, layer="L"), OpNode("out", 1.0, layer="b")]
    edges = [OpEdge("in", "L/pre", 4), OpEdge("L/pre", "mid", 4), OpEdge("mid", "L/post", 4),
             OpEdge("L/post", "out", 4)]
    graph = OpGraph(ops, edges)
    part = partition_op_graph(graph, 2)
    _check_invariants(graph, part, contiguous=True)
    assert part.rank_of("L/pre") == part.rank_of("L/post")
    assert max(r.cost for r in part.report().ranks) == pytest.approx(4 / 7)


def test_branches_stay_whole_and_cut_bytes_are_small() -> None:
    rng = random.Random(3)
    for blocks, width, p in ((2, 3, 2), (3, 2, 3), (2, 4, 4)):
        graph = branchy_graph(rng, blocks, width)
        part = partition_op_graph(graph, p)
        _check_invariants(graph, part, contiguous=True)
        assert part.cut_bytes > 0
        assert sum(e.bytes for e in part.crossing_edges()) >= part.cut_bytes


def test_crossing_bytes_are_minimal_among_balanced_splits_of_a_chain() -> None:
    # A chain of equal layers with one huge activation: with slack the cut avoids it.
    sizes = [10, 10, 1000, 10, 10]
    ops = [OpNode(f"l{i}", 1.0, layer=f"l{i}") for i in range(6)]
    edges = [OpEdge(f"l{i}", f"l{i + 1}", sizes[i]) for i in range(5)]
    graph = OpGraph(ops, edges)
    strict = partition_op_graph(graph, 2, balance_slack=0.0)
    assert strict.cut_bytes == 1000 and [strict.rank_of(f"l{i}") for i in range(6)] == [0, 0, 0, 1, 1, 1]
    loose = partition_op_graph(graph, 2, balance_slack=0.4)
    assert loose.cut_bytes == 10 and _bottleneck(loose) == pytest.approx(4 / 6)


def test_skip_tensor_counted_once() -> None:
    # a feeds b and d (a skip) with one tensor; every cut sends it, cutting after a sends it once.
    ops = [OpNode(n, 1.0, layer=n) for n in "abcd"]
    edges = [OpEdge("a", "b", 100, tensor="a:0"), OpEdge("a", "d", 100, tensor="a:0"),
             OpEdge("b", "c", 1), OpEdge("c", "d", 1)]
    part = partition_op_graph(OpGraph(ops, edges), 2, balance_slack=1.0)
    assert part.cut_bytes == 100 and [part.rank_of(n) for n in "abcd"] == [0, 1, 1, 1]
    balanced = partition_op_graph(OpGraph(ops, edges), 2, balance_slack=0.0)
    assert balanced.cut_bytes == 101 and [balanced.rank_of(n) for n in "abcd"] == [0, 0, 1, 1]


def test_optimize_memory_balances_variables_speed_balances_cost() -> None:
    ops = [OpNode("big", 1.0, {"w_big": 900}, layer="big"), OpNode("s1", 5.0, {"w1": 50}, layer="s1"),
           OpNode("s2", 5.0, {"w2": 50}, layer="s2"), OpNode("s3", 1.0, layer="s3")]
    edges = [OpEdge("big", "s1", 1), OpEdge("s1", "s2", 1), OpEdge("s2", "s3", 1)]
    graph = OpGraph(ops, edges)
    mem = partition_op_graph(graph, 2, optimize="memory", balance_slack=0.0)
    assert [mem.rank_of(n) for n in ("big", "s1", "s2", "s3")] == [0, 1, 1, 1]
    speed = partition_op_graph(graph, 2, optimize="speed", balance_slack=0.0)
    assert [speed.rank_of(n) for n in ("big", "s1", "s2", "s3")] == [0, 0, 1, 1]


def test_colocation_groups_stay_together() -> None:
    ops = [OpNode(f"o{i}", 1.0, layer=f"l{i}", colocation="c" if i in (1, 2) else None) for i in range(4)]
    edges = [OpEdge(f"o{i}", f"o{i + 1}", 1) for i in range(3)]
    graph = OpGraph(ops, edges)
    part = partition_op_graph(graph, 3)
    _check_invariants(graph, part, contiguous=True)


def test_contiguous_relaxed_for_a_disconnected_graph() -> None:
    ops = [OpNode(n, 1.0, layer=n) for n in ("a1", "a2", "b1", "b2")]
    graph = OpGraph(ops, [OpEdge("a1", "a2", 1), OpEdge("b1", "b2", 1)])
    part = partition_op_graph(graph, 2)
    assert "relaxed" in part.notes[0]
    _check_invariants(graph, part, contiguous=False)


def test_contiguous_forces_connected_pieces() -> None:
    # Program order interleaves two branches; a connected split must not cut across them.
    ops = [OpNode("src", 1.0, layer="src"), OpNode("x1", 1.0, layer="x1"), OpNode("y1", 1.0, layer="y1"),
           OpNode("x2", 1.0, layer="x2"), OpNode("y2", 1.0, layer="y2"), OpNode("sink", 1.0, layer="sink")]
    edges = [OpEdge("src", "x1", 1), OpEdge("src", "y1", 1), OpEdge("x1", "x2", 1), OpEdge("y1", "y2", 1),
             OpEdge("x2", "sink", 1), OpEdge("y2", "sink", 1)]
    graph = OpGraph(ops, edges)
    for p in (2, 3):
        part = partition_op_graph(graph, p)
        _check_invariants(graph, part, contiguous=True)


def test_errors() -> None:
    with pytest.raises(PartitionError, match="indivisible group"):
        partition_op_graph(OpGraph([OpNode("a", layer="L"), OpNode("b", layer="L")], [OpEdge("a", "b")]), 2)
    with pytest.raises(PartitionError, match="optimize"):
        partition_op_graph(OpGraph([OpNode("a")], []), 1, optimize="fast")
    with pytest.raises(PartitionError, match="cycle"):
        OpGraph([OpNode("a"), OpNode("b")], [OpEdge("a", "b"), OpEdge("b", "a")])
    with pytest.raises(PartitionError, match="unknown op"):
        OpGraph([OpNode("a")], [OpEdge("a", "zz")])
    with pytest.raises(PartitionError, match="two sizes"):
        OpGraph([OpNode("a", variables={"v": 1}), OpNode("b", variables={"v": 2})], [])


def test_report_and_data() -> None:
    rng = random.Random(4)
    graph = transformer_graph(rng, 4, tied=False)
    part = partition_op_graph(graph, 2)
    report = part.report()
    assert sum(r.params for r in report.ranks) == 0  # no element counts given
    assert sum(r.param_bytes for r in report.ranks) == sum(graph.variables().values())
    assert "bytes crossing ranks per microbatch" in str(report)
    assert part.chain() == (0, 1)


def test_random_branchy_and_skip_graphs_are_exact_when_small() -> None:
    """Against brute force over every pipeline-ordered assignment of the op groups (small graphs)."""
    rng = random.Random(5)
    compared = 0
    for _ in range(30):
        if rng.random() < 0.6:
            graph = branchy_graph(rng, rng.randint(1, 2), rng.randint(2, 3))
        else:
            graph = transformer_graph(rng, rng.randint(2, 4), tied=False)
        p = rng.randint(2, 3)
        optimize = rng.choice(["speed", "memory"])
        for contiguous in (True, False):
            part = partition_op_graph(graph, p, optimize=optimize, contiguous=contiguous, balance_slack=0.0)
            _check_invariants(graph, part, contiguous=contiguous)
            if len(part.groups) <= 10:
                assert _bottleneck(part) == pytest.approx(_brute_force(graph, part, contiguous=contiguous))
                compared += 1
    assert compared >= 20


def test_tied_graphs_keep_every_invariant() -> None:
    rng = random.Random(6)
    for _ in range(10):
        graph = transformer_graph(rng, rng.randint(2, 6), tied=True)
        p = rng.randint(2, 4)
        part = partition_op_graph(graph, p, optimize=rng.choice(["speed", "memory"]))
        _check_invariants(graph, part, contiguous=not any("relaxed" in n for n in part.notes))
        assert part.rank_of("head/matmul") == part.rank_of("embed/gather")
