"""A backward in two parts: the input gradients now, the weight gradients later (zero-bubble I / W).

A pipeline rank's backward of one microbatch computes two things: the gradient of what it received
(the previous rank waits for it) and the gradient of its own weights (nobody waits for it before
the optimizer step). The zero-bubble schedules (``zb_h1``, ``zb_v``) run the first as action I and
defer the second to action W, which fills the time the rank would otherwise idle at the end of the
step while the first rank finishes its last backward.

How (the idea of torch.distributed.pipelining's ``stage_backward_input``/``_weight``, written for
our owner side): walk the autograd graph from the outputs; the *input closure* is every node with
a path to a received tensor. A weight's gradient leaves that closure at the nodes where its own
branch joins it (a linear layer's ``AddmmBackward``: one output goes to the input, one to the
weight). `backward_input` runs ``autograd.grad`` towards the received tensors only, so those nodes
compute only their input-side outputs, and a pre-hook keeps the gradient that reached each of
them. `WeightGrads.run` later starts from those kept gradients and runs backward towards the
weights, which accumulate into ``.grad`` through their usual accumulators (hooks included): each
output of each node is computed once, as in one backward (the entry nodes run in both passes,
each time for other outputs).

Not every graph splits. `backward_input` returns None (run one whole backward instead) when the
graph has an end that is not a leaf tensor, when a custom autograd function (a value fetched from a
third rank: its backward sends a message) would run in the weight pass, which runs the entry
nodes again, when an output does not depend on any received tensor, or when nothing received
needs a gradient.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node

__all__ = ["WeightGrads", "backward_input"]


def _accumulator(t: torch.Tensor) -> Node:
    """The node that a leaf tensor's gradient ends in (its grad accumulator)."""
    with torch.enable_grad():
        view = t.view_as(t)
    assert view.grad_fn is not None
    return view.grad_fn.next_functions[0][0]


def _reachable_from(starts: Sequence[Node], edges: dict[Node, list[Node]], stop: set[Node] | None = None
                    ) -> tuple[set[Node], set[Node]]:
    """Nodes reached from ``starts`` along ``edges``; with ``stop``, those met are not crossed but returned."""
    seen: set[Node] = set(starts)
    met: set[Node] = set()
    todo = deque(starts)
    while todo:
        node = todo.popleft()
        for nxt in edges.get(node, ()):
            if nxt in seen:
                continue
            if stop is not None and nxt in stop:
                met.add(nxt)
                continue
            seen.add(nxt)
            todo.append(nxt)
    return seen, met


class WeightGrads:
    """The deferred half of a split backward: `run` accumulates the weight gradients (once)."""

    def __init__(self, groups: list[tuple[list[Node], list[Any], list[torch.Tensor]]]) -> None:
        # Per group of weights that share entry nodes: the nodes, the gradients kept at each (a
        # tuple per node, set by the input pass), and the weights.
        self._groups = groups

    def run(self) -> None:
        groups, self._groups = self._groups, []
        for nodes, kept, weights in groups:
            roots: list[GradientEdge] = []
            grads: list[torch.Tensor] = []
            for node, node_grads in zip(nodes, kept, strict=True):
                for i, g in enumerate(node_grads or ()):
                    if g is not None:
                        roots.append(GradientEdge(node, i))
                        grads.append(g)
            if not roots:
                continue
            handles = []
            if len(nodes) > 1:
                # One entry node can lie below another (a weight used twice): what flows into it
                # from above is already in its kept gradient, so it gets exactly that.
                for node, node_grads in zip(nodes, kept, strict=True):
                    handles.append(node.register_prehook(lambda _g, saved=tuple(node_grads or ()): saved))
            try:
                torch.autograd.backward(roots, grads, retain_graph=True, inputs=weights)
            finally:
                for h in handles:
                    h.remove()


def backward_input(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor | None], WeightGrads] | None:
    """The gradients of ``inputs`` for ``outputs`` with output gradients ``grads``, and the weights' part to run later.

    Returns None when this graph does not split (see the module docstring): nothing ran, and the
    caller runs a whole backward. The graph is kept (``retain_graph``) for `WeightGrads.run`.

    Example:
        >>> lin = torch.nn.Linear(3, 3)
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> dx, weights = backward_input([lin(x)], [torch.ones(2, 3)], [x])
        >>> lin.weight.grad is None
        True
        >>> weights.run(); lin.weight.grad.shape
        torch.Size([3, 3])
    """
    roots = [o.grad_fn for o in outputs]
    if not roots or any(r is None for r in roots):
        return None
    input_nodes: dict[Node, int] = {}
    for i, t in enumerate(inputs):
        if t.requires_grad and t.grad_fn is None:
            input_nodes.setdefault(_accumulator(t), i)
    # The graph, and its edges reversed (towards the outputs).
    parents: dict[Node, list[Node]] = {}
    children: dict[Node, list[Node]] = {}
    seen: set[Node] = set()
    todo: deque[Node] = deque()
    for r in roots:
        assert r is not None
        if r not in seen:
            seen.add(r)
            todo.append(r)
    weights: list[Node] = []
    while todo:
        node = todo.popleft()
        nexts = [n for n, _ in node.next_functions if n is not None]
        children[node] = nexts
        if not nexts:
            if not hasattr(node, "variable"):
                return None  # a source that is not a leaf tensor: its backward must run in order
            if node not in input_nodes:
                weights.append(node)
        for n in nexts:
            parents.setdefault(n, []).append(node)
            if n not in seen:
                seen.add(n)
                todo.append(n)
    present = [n for n in input_nodes if n in seen]
    if not present:
        return None
    closure, _ = _reachable_from(present, parents)
    if any(r not in closure for r in roots):
        return None
    # Weights grouped by the closure nodes their branches enter (union of overlapping sets).
    groups: list[tuple[set[Node], list[Node]]] = []
    for w in weights:
        _, entries = _reachable_from([w], parents, stop=closure)
        if not entries:
            return None
        merged = [g for g in groups if g[0] & entries]
        for g in merged:
            groups.remove(g)
            entries |= g[0]
        groups.append((entries, [w, *(x for g in merged for x in g[1])]))
    # The weight pass runs the entry nodes again and everything between them and the weights: a
    # function of ours or a user's there (a fetch, whose backward sends a message) would run twice.
    toward, _ = _reachable_from(weights, parents)
    rerun, _ = _reachable_from([n for entries, _ in groups for n in entries],
                               {n: [k for k in children.get(n, ()) if k in toward] for n in toward})
    if any(isinstance(n, BackwardCFunction) for n in rerun):
        return None
    parts = [(list(entries), [None] * len(entries), [w.variable for w in ws]) for entries, ws in groups]
    handles = []
    try:
        for nodes, kept, _ in parts:
            for j, node in enumerate(nodes):
                def keep(node_grads: Any, kept: list[Any] = kept, j: int = j) -> None:
                    kept[j] = node_grads
                handles.append(node.register_prehook(keep))
        wanted = [inputs[i] for node, i in input_nodes.items() if node in seen]
        got = torch.autograd.grad(list(outputs), wanted, list(grads), retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    by_id = {id(t): g for t, g in zip(wanted, got, strict=True)}
    return [by_id.get(id(t)) for t in inputs], WeightGrads(parts)
