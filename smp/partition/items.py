"""Work items: a module tree cut into the sequence of indivisible pieces that get a rank each.

A *work item* is either a whole subtree (kept on one rank) or the own work of a module that was
opened up (its parameters and compute, excluding the children it was opened into). Items are
listed in execution order: an opened module's own item comes right before its first child, which
is where its forward starts.

Two rules from SMP v1 shape the items:

- Parameter-less subtrees (activations, dropout, rotary embeddings) run on their parent's rank
  (SMP >= 1.13), so they are folded into the parent's own item and never stand alone.
- A module with no parameters and no compute of its own (a container such as ``ModuleList``)
  makes an empty own item; it carries no work and does not count as a visit in the chain.

Example::

    root                       lower(tree, expanded={"root"})      lower(tree, {"root", "body"})
    |- embed   (params)   ->   [root*] [embed] [body] [head]   ->   [root*] [embed] [body*] [l0] [l1] [head]
    |- body                    root* = root's own work + act       (body* is empty: a container)
    |  |- l0   (params)
    |  |- l1   (params)
    |- act     (no params)
    |- head    (params)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from smp.partition.graph import ModuleTree, Totals

__all__ = ["WorkItem", "expandable", "fallback_compute", "lower", "lower_assignment"]

Place = TypeVar("Place", bound=Hashable)


@dataclass(frozen=True)
class WorkItem:
    """One indivisible piece of work.

    Attributes:
        path: the module it stands for.
        whole: True for the whole subtree at ``path``; False for ``path``'s own work only (plus the
            parameter-less children folded into it).
        members: every module path whose work the item carries.
        totals: sums of parameter bytes/counts, activation bytes, compute and module count.
        output_bytes: bytes sent onwards when the pipeline is cut right after this item.
        groups: parameter-sharing group ids of the members.
    """

    path: str
    whole: bool
    members: tuple[str, ...]
    totals: Totals
    output_bytes: int
    groups: frozenset[str]

    @property
    def label(self) -> str:
        """``path`` for a whole subtree, ``path (own)`` for an opened module's own work."""
        name = self.path or "<root>"
        return name if self.whole else f"{name} (own)"

    @property
    def is_empty(self) -> bool:
        """No parameters, no compute, no activations: a pure container."""
        t = self.totals
        return t.param_bytes == 0 and t.compute == 0 and t.activation_bytes == 0 and t.param_count == 0


def fallback_compute(tree: ModuleTree) -> Callable[[str], float]:
    """Per-module compute: the node's own cost, or a module count when the tree has no costs.

    The count (SMP v1's fallback) is 1 for a module that owns parameters or is a leaf; containers
    count 0 so that opening one does not create work out of nothing.
    """
    if tree.totals().compute > 0:
        return lambda path: tree.node(path).compute

    def count(path: str) -> float:
        node = tree.node(path)
        return 1.0 if node.param_bytes > 0 or node.param_count > 0 or not node.children else 0.0

    return count


def _sum(tree: ModuleTree, paths: Iterable[str], compute: Callable[[str], float]) -> Totals:
    acc = Totals()
    for p in paths:
        n = tree.node(p)
        acc = acc + Totals(n.param_bytes, n.param_count, n.activation_bytes, compute(p), 1)
    return acc


def _groups(tree: ModuleTree, paths: Iterable[str]) -> frozenset[str]:
    out: set[str] = set()
    for p in paths:
        out |= tree.node(p).shared_groups
    return frozenset(out)


def _item(tree: ModuleTree, path: str, whole: bool, members: list[str], compute: Callable[[str], float]) -> WorkItem:
    return WorkItem(
        path=path,
        whole=whole,
        members=tuple(members),
        totals=_sum(tree, members, compute),
        output_bytes=tree.node(path).boundary_bytes,
        groups=_groups(tree, members),
    )


def expandable(tree: ModuleTree, path: str) -> bool:
    """A module can be opened when it is not atomic and at least one child carries parameters."""
    node = tree.node(path)
    return not node.atomic and any(not tree.is_parameterless(c) for c in node.children)


def lower(tree: ModuleTree, expanded: Iterable[str], compute: Callable[[str], float] | None = None) -> list[WorkItem]:
    """The work items when the modules in ``expanded`` are opened and everything else is kept whole.

    A module in ``expanded`` whose parent is not opened is ignored (it is inside a whole item).
    """
    opened = set(expanded)
    comp = compute or fallback_compute(tree)
    items: list[WorkItem] = []

    def visit(path: str) -> None:
        if path not in opened or not expandable(tree, path):
            items.append(_item(tree, path, True, list(tree.subtree(path)), comp))
            return
        children = tree.node(path).children
        own = [path]
        for c in children:
            if tree.is_parameterless(c):
                own.extend(tree.subtree(c))
        items.append(_item(tree, path, False, own, comp))
        for c in children:
            if not tree.is_parameterless(c):
                visit(c)

    visit(tree.root)
    return items


def lower_assignment(
    tree: ModuleTree, place_of: Mapping[str, Place], compute: Callable[[str], float] | None = None
) -> list[tuple[WorkItem, Place]]:
    """The finest work items of a complete placement, in execution order, with their places.

    A place is a rank, or a chain stage when a rank holds several. Every module that has a child
    placed elsewhere is opened; a parameter-less child placed with its parent is folded into the
    parent's own item, one placed elsewhere stands alone.

    Example:
        >>> from smp.partition.graph import ModuleNode
        >>> tree = ModuleTree([ModuleNode("", ("a", "b")), ModuleNode("a", param_bytes=1),
        ...                    ModuleNode("b", param_bytes=1)])
        >>> [(item.label, rank) for item, rank in lower_assignment(tree, {"": 0, "a": 0, "b": 1})]
        [('<root> (own)', 0), ('a', 0), ('b', 1)]
    """
    comp = compute or fallback_compute(tree)
    uniform: dict[str, bool] = {}
    for path in reversed(tree.order):
        r = place_of[path]
        uniform[path] = all(uniform[c] and place_of[c] == r for c in tree.node(path).children)
    out: list[tuple[WorkItem, Place]] = []

    def visit(path: str) -> None:
        place = place_of[path]
        if uniform[path]:
            out.append((_item(tree, path, True, list(tree.subtree(path)), comp), place))
            return
        children = tree.node(path).children
        folded = [c for c in children if tree.is_parameterless(c) and uniform[c] and place_of[c] == place]
        own = [path]
        for c in folded:
            own.extend(tree.subtree(c))
        out.append((_item(tree, path, False, own, comp), place))
        for c in children:
            if c not in folded:
                visit(c)

    visit(tree.root)
    return out
