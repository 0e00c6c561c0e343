"""The module tree: the neutral graph a frontend lowers a model's module hierarchy into.

A frontend (``smp.torch``) walks its ``nn.Module`` tree once and describes every module as a
`ModuleNode`: its dotted path, its children in *execution* order, the bytes of its own parameters,
the bytes it keeps for backward, the bytes of its output, its own compute cost and the ids of the
parameter-sharing groups it belongs to. The core never sees an ``nn.Module``.

Conventions (every number is per microbatch and excludes the children):

- ``param_bytes``/``param_count``: the module's *own* parameters (``recurse=False``). A parameter
  shared by several modules is counted once, on the first module that owns it (what
  ``named_parameters()`` does), and every module that uses it lists the same id in
  ``shared_groups``.
- ``compute``: the module's *own* cost: measured time minus its children's time, or an estimate
  (FLOPs). Any unit; only ratios matter. Use `exclusive_compute` to convert inclusive timings.
- ``activation_bytes``: what the module's own work keeps alive for backward (at least its output).
- ``output_bytes``: the size of the module's output, i.e. what crosses to the next rank when the
  pipeline is cut right after it; ``None`` means "same as ``activation_bytes``".
- ``atomic``: never split this module across ranks (e.g. a transformer block whose forward does
  residual adds between its children: cutting inside it adds round trips).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from smp.errors import PartitionError

__all__ = ["ModuleNode", "ModuleTree", "exclusive_compute"]


@dataclass(frozen=True)
class ModuleNode:
    """One module of the tree.

    Example:
        >>> ModuleNode("model.layers.0", children=("model.layers.0.attn",), param_bytes=1024)
        ModuleNode(path='model.layers.0', ...)
    """

    path: str
    children: tuple[str, ...] = ()
    param_bytes: int = 0
    activation_bytes: int = 0
    compute: float = 0.0
    shared_groups: frozenset[str] = field(default_factory=frozenset)
    param_count: int = 0
    output_bytes: int | None = None
    atomic: bool = False
    no_return_cut: bool = False
    """A cut back to a rank the chain visited before must not fall inside it: a layer whose own code
    adds its children's outputs to its input would, on that way back, fetch two values whose
    graphs meet on the other rank, and its backward would visit that rank twice."""

    @property
    def boundary_bytes(self) -> int:
        """Bytes sent to the next rank when the pipeline is cut right after this module."""
        return self.activation_bytes if self.output_bytes is None else self.output_bytes

    def __repr__(self) -> str:
        return f"ModuleNode(path={self.path!r}, ...)"


@dataclass(frozen=True)
class Totals:
    """Sums over a set of modules (a subtree, a rank, a work item)."""

    param_bytes: int = 0
    param_count: int = 0
    activation_bytes: int = 0
    compute: float = 0.0
    modules: int = 0

    def __add__(self, other: Totals) -> Totals:
        return Totals(
            self.param_bytes + other.param_bytes,
            self.param_count + other.param_count,
            self.activation_bytes + other.activation_bytes,
            self.compute + other.compute,
            self.modules + other.modules,
        )


def _own(node: ModuleNode) -> Totals:
    return Totals(node.param_bytes, node.param_count, node.activation_bytes, node.compute, 1)


class ModuleTree:
    """A validated module tree with its parameter-sharing groups.

    The root is the one node that is nobody's child. Construction checks everything at once and
    raises one `PartitionError` listing every problem (unknown child, two parents, cycle, negative
    sizes).

    Example:
        >>> tree = ModuleTree([
        ...     ModuleNode("", children=("embed", "block", "head")),
        ...     ModuleNode("embed", param_bytes=40, shared_groups=frozenset({"tied"})),
        ...     ModuleNode("block", param_bytes=100, compute=5.0),
        ...     ModuleNode("head", shared_groups=frozenset({"tied"}), compute=1.0),
        ... ])
        >>> tree.root, [n.path for n in tree], tree.groups()["tied"]
        ('', ['', 'embed', 'block', 'head'], ('embed', 'head'))
    """

    def __init__(self, nodes: Iterable[ModuleNode]) -> None:
        self._nodes: dict[str, ModuleNode] = {}
        problems: list[str] = []
        for node in nodes:
            if node.path in self._nodes:
                problems.append(f"module {node.path!r} is listed twice")
            self._nodes[node.path] = node
        self._parent: dict[str, str] = {}
        for node in self._nodes.values():
            if node.param_bytes < 0 or node.param_count < 0 or node.activation_bytes < 0 or node.compute < 0:
                problems.append(f"module {node.path!r} has a negative size or cost")
            if node.output_bytes is not None and node.output_bytes < 0:
                problems.append(f"module {node.path!r} has negative output_bytes")
            for child in node.children:
                if child not in self._nodes:
                    problems.append(f"module {node.path!r} lists unknown child {child!r}")
                elif child in self._parent:
                    problems.append(
                        f"module {child!r} has two parents, {self._parent[child]!r} and {node.path!r}; "
                        "a module reused in two places must be described once (its second use shares its "
                        "parameters: give both a common shared_groups id)"
                    )
                else:
                    self._parent[child] = node.path
        roots = [p for p in self._nodes if p not in self._parent]
        if len(roots) != 1 and not problems:
            problems.append(f"a module tree needs exactly one root (a module nobody lists as child); found {roots}")
        if problems:
            raise PartitionError("invalid module tree:\n" + "\n".join(f"  - {p}" for p in problems))
        self.root: str = roots[0]
        self._order: list[str] = []
        stack = [self.root]
        while stack:
            path = stack.pop()
            self._order.append(path)
            stack.extend(reversed(self._nodes[path].children))
        if len(self._order) != len(self._nodes):
            cyclic = sorted(set(self._nodes) - set(self._order))
            raise PartitionError(f"invalid module tree: modules {cyclic} form a cycle unreachable from the root")

    # -- access -----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[ModuleNode]:
        """Nodes in pre-order (a parent before its children, children in execution order)."""
        return (self._nodes[p] for p in self._order)

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, path: object) -> bool:
        return path in self._nodes

    def node(self, path: str) -> ModuleNode:
        """The node at ``path``; a `PartitionError` names the unknown path."""
        try:
            return self._nodes[path]
        except KeyError:
            raise PartitionError(f"no module {path!r} in the module tree") from None

    def parent(self, path: str) -> str | None:
        """The parent's path, or None for the root."""
        return self._parent.get(path)

    @property
    def order(self) -> tuple[str, ...]:
        """All paths in pre-order."""
        return tuple(self._order)

    def subtree(self, path: str) -> Iterator[str]:
        """Paths of ``path`` and its descendants, in pre-order."""
        stack = [path]
        while stack:
            p = stack.pop()
            yield p
            stack.extend(reversed(self._nodes[p].children))

    # -- derived quantities -----------------------------------------------------------------
    @cached_property
    def _subtree_totals(self) -> dict[str, Totals]:
        totals: dict[str, Totals] = {}
        for path in reversed(self._order):
            acc = _own(self._nodes[path])
            for child in self._nodes[path].children:
                acc = acc + totals[child]
            totals[path] = acc
        return totals

    def totals(self, path: str | None = None) -> Totals:
        """Sums over the subtree at ``path`` (the whole tree by default)."""
        return self._subtree_totals[self.root if path is None else path]

    @cached_property
    def _subtree_shared(self) -> dict[str, bool]:
        shared: dict[str, bool] = {}
        for path in reversed(self._order):
            node = self._nodes[path]
            shared[path] = bool(node.shared_groups) or any(shared[c] for c in node.children)
        return shared

    def is_parameterless(self, path: str) -> bool:
        """True when no module of the subtree holds or shares a parameter.

        Such a subtree runs on its parent's rank (SMP >= 1.13), so it is never split off alone.
        """
        return self.totals(path).param_bytes == 0 and not self._subtree_shared[path]

    def groups(self) -> dict[str, tuple[str, ...]]:
        """Parameter-sharing groups: id -> member paths in pre-order."""
        out: dict[str, list[str]] = {}
        for path in self._order:
            for gid in sorted(self._nodes[path].shared_groups):
                out.setdefault(gid, []).append(path)
        return {gid: tuple(members) for gid, members in out.items()}


def exclusive_compute(inclusive: Mapping[str, float], children: Mapping[str, Iterable[str]]) -> dict[str, float]:
    """Turn inclusive timings (a module's time with its children) into the own costs a node wants.

    A child that was never called itself (a ``ModuleList`` whose parent loops over its members)
    counts with the time of its own descendants, so the parent's own cost excludes the members'
    work. Negative differences (timer noise) clip to zero.

    Example:
        >>> exclusive_compute({"": 10.0, "a": 4.0, "b": 5.0}, {"": ["a", "b"], "a": [], "b": []})
        {'': 1.0, 'a': 4.0, 'b': 5.0}
        >>> exclusive_compute({"": 10.0, "l.0": 4.0, "l.1": 5.0}, {"": ["l"], "l": ["l.0", "l.1"]})
        {'': 1.0, 'l.0': 4.0, 'l.1': 5.0}
    """
    def spent(path: str) -> float:
        if path in inclusive:
            return inclusive[path]
        return sum(spent(c) for c in children.get(path, ()))

    return {
        path: max(0.0, total - sum(spent(c) for c in children.get(path, ())))
        for path, total in inclusive.items()
    }
