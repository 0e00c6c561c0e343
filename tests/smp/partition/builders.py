"""Test helpers: brute-force references and random module trees / op graphs (fixed seeds)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence

from smp.partition import ModuleNode, ModuleTree, OpEdge, OpGraph, OpNode


def all_splits(n: int, parts: int) -> list[list[int]]:
    """Every boundary list [0, b1, ..., n] with non-empty parts."""
    return [[0, *cuts, n] for cuts in itertools.combinations(range(1, n), parts - 1)]


def loads(costs: Sequence[float], bounds: Sequence[int]) -> list[float]:
    """Part sums computed directly (not from prefix sums), as an independent reference."""
    return [float(sum(costs[a:b])) for a, b in zip(bounds, bounds[1:], strict=False)]


def brute_force(
    costs: Sequence[float], parts: int, fits: Callable[[int, int, int], bool] | None = None
) -> tuple[float, float]:
    """(least bottleneck, least sum of squares among the splits reaching it), by enumeration."""
    best = (float("inf"), float("inf"))
    for b in all_splits(len(costs), parts):
        if fits is not None and not all(fits(k, b[k], b[k + 1]) for k in range(parts)):
            continue
        ls = loads(costs, b)
        best = min(best, (max(ls), sum(x * x for x in ls)))
    return best


def reference_chain(costs: Sequence[float], parts: int) -> float:
    """Least bottleneck by the textbook O(P n^2) DP (independent of smp's bisection DP)."""
    n = len(costs)
    inf = float("inf")
    dp = [[inf] * (n + 1) for _ in range(parts + 1)]
    dp[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(1, n + 1):
            for i in range(k - 1, j):
                dp[k][j] = min(dp[k][j], max(dp[k - 1][i], float(sum(costs[i:j]))))
    return dp[parts][n]


def random_tree(rng: random.Random, leaves: int, *, max_children: int = 4, paramless: float = 0.0,
                own_cost: float = 0.0) -> tuple[ModuleTree, list[str], dict[str, float]]:
    """A random tree with ``leaves`` parameterised leaves (plus optional parameter-less leaves).

    Returns the tree, the parameterised leaves in execution order and each leaf's compute.
    Internal nodes are containers unless ``own_cost`` > 0 (then they get small own params/compute).
    """
    nodes: list[ModuleNode] = []
    order: list[str] = []
    compute: dict[str, float] = {}
    counter = itertools.count()

    def build(path: str, budget: int) -> None:
        if budget == 1:
            c = float(rng.randint(1, 20))
            nodes.append(ModuleNode(path, param_bytes=rng.randint(1, 50) * 64, compute=c,
                                    activation_bytes=rng.randint(1, 10) * 32, param_count=rng.randint(1, 50) * 16))
            order.append(path)
            compute[path] = c
            return
        k = min(budget, rng.randint(2, max_children))
        cuts = sorted(rng.sample(range(1, budget), k - 1))
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, budget], strict=True)]
        children = []
        for size in sizes:
            child = f"{path}.m{next(counter)}" if path else f"m{next(counter)}"
            children.append(child)
            build(child, size)
            if rng.random() < paramless:
                act = f"{path}.act{next(counter)}" if path else f"act{next(counter)}"
                nodes.append(ModuleNode(act, compute=float(rng.randint(0, 2))))
                children.append(act)
        own = own_cost > 0 and rng.random() < own_cost
        nodes.append(ModuleNode(path, tuple(children), param_bytes=64 if own else 0,
                                compute=1.0 if own else 0.0, param_count=16 if own else 0))

    build("", leaves)
    return ModuleTree(nodes), order, compute


def chain_tree(costs: Sequence[float], *, params: Sequence[int] | None = None,
               acts: Sequence[int] | None = None) -> ModuleTree:
    """A root whose children are the blocks ``b0..b{n-1}`` with the given compute."""
    n = len(costs)
    params = params or [1] * n
    acts = acts or [0] * n
    return ModuleTree([
        ModuleNode("", tuple(f"b{i}" for i in range(n))),
        *[ModuleNode(f"b{i}", param_bytes=params[i], param_count=params[i], compute=float(costs[i]),
                     activation_bytes=acts[i]) for i in range(n)],
    ])


def transformer_graph(rng: random.Random, layers: int, *, tied: bool = True) -> OpGraph:
    """An op DAG shaped like a decoder: embedding, blocks with residual skips, head tied to the embedding."""
    ops: list[OpNode] = []
    edges: list[OpEdge] = []
    hidden = 4096

    def op(name: str, cost: float, layer: str | None, variables: dict[str, int] | None = None) -> str:
        ops.append(OpNode(name, cost=cost, variables=variables or {}, layer=layer))
        return name

    x = op("embed/gather", 1.0, "embed", {"embed/table": 64_000})
    for i in range(layers):
        scale = rng.uniform(0.5, 2.0)
        ln1 = op(f"block{i}/ln1", 0.1, f"block{i}", {f"block{i}/ln1/g": 256})
        qkv = op(f"block{i}/qkv", 3.0 * scale, f"block{i}", {f"block{i}/qkv/w": 48_000})
        att = op(f"block{i}/attn", 2.0 * scale, f"block{i}")
        out = op(f"block{i}/proj", 1.0 * scale, f"block{i}", {f"block{i}/proj/w": 16_000})
        add1 = op(f"block{i}/add1", 0.1, f"block{i}")
        mlp = op(f"block{i}/mlp", 8.0 * scale, f"block{i}", {f"block{i}/mlp/w": 128_000})
        add2 = op(f"block{i}/add2", 0.1, f"block{i}")
        edges += [OpEdge(x, ln1, hidden, tensor=x), OpEdge(ln1, qkv, hidden), OpEdge(qkv, att, 3 * hidden),
                  OpEdge(att, out, hidden), OpEdge(out, add1, hidden), OpEdge(x, add1, hidden, tensor=x),
                  OpEdge(add1, mlp, hidden, tensor=add1), OpEdge(mlp, add2, hidden),
                  OpEdge(add1, add2, hidden, tensor=add1)]
        x = add2
    norm = op("final/ln", 0.1, "final", {"final/g": 256})
    head = op("head/matmul", 6.0, "head" if not tied else None, {"embed/table": 64_000} if tied else {"head/w": 64_000})
    loss = op("loss/xent", 0.5, None)
    edges += [OpEdge(x, norm, hidden), OpEdge(norm, head, hidden), OpEdge(head, loss, 16 * hidden)]
    return OpGraph(ops, edges)


def branchy_graph(rng: random.Random, blocks: int, width: int) -> OpGraph:
    """An inception-like DAG: blocks of ``width`` parallel layer chains joined by a concat."""
    ops: list[OpNode] = []
    edges: list[OpEdge] = []
    prev = "stem"
    ops.append(OpNode(prev, cost=1.0, variables={"stem/w": 1000}, layer="stem"))
    for b in range(blocks):
        tails = []
        for w in range(width):
            depth = rng.randint(1, 3)
            last = prev
            for d in range(depth):
                name = f"b{b}/br{w}/conv{d}"
                ops.append(OpNode(name, cost=float(rng.randint(1, 6)), variables={f"{name}/k": rng.randint(1, 9) * 500},
                                  layer=f"b{b}_br{w}_conv{d}"))
                edges.append(OpEdge(last, name, rng.randint(1, 8) * 256))
                last = name
            tails.append(last)
        cat = f"b{b}/concat"
        ops.append(OpNode(cat, cost=0.5))
        edges += [OpEdge(t, cat, 1024) for t in tails]
        prev = cat
    return OpGraph(ops, edges)
