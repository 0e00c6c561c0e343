"""The op graph: the neutral DAG a frontend lowers a traced TensorFlow step into.

Each `OpNode` is one operation: its compute cost, the variables it reads (name -> bytes), its
layer scope (ops of one Keras layer stay together) and its colocation group (TF colocation
constraints). Each `OpEdge` is a tensor from one op to another, with its size in bytes; several
edges may carry the same tensor (``tensor`` names it) to different consumers. The core never sees
a ``tf.Operation``.

Nodes are listed in program order (the order the frontend traced them); the partitioner uses it
to break ties between topological orders.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from smp.errors import PartitionError

__all__ = ["OpEdge", "OpGraph", "OpNode"]


@dataclass(frozen=True)
class OpNode:
    """One operation.

    Attributes:
        name: unique op name.
        cost: compute cost (time or FLOPs; any unit, only ratios matter).
        variables: variable name -> bytes, for each variable the op reads.
        layer: layer scope (e.g. ``"dense_1"``); ops with the same layer stay on one rank.
        colocation: colocation group; ops with the same group stay on one rank.

    Example:
        >>> OpNode("dense/MatMul", cost=2.0, variables={"dense/kernel": 4096}, layer="dense")
        OpNode(name='dense/MatMul', ...)
    """

    name: str
    cost: float = 0.0
    variables: Mapping[str, int] = field(default_factory=dict)
    layer: str | None = None
    colocation: str | None = None

    def __repr__(self) -> str:
        return f"OpNode(name={self.name!r}, ...)"


@dataclass(frozen=True)
class OpEdge:
    """A tensor flowing from ``src`` to ``dst``; edges with the same ``tensor`` carry one tensor."""

    src: str
    dst: str
    bytes: int = 0
    tensor: str | None = None

    @property
    def tensor_key(self) -> str:
        """Identity of the tensor (one per edge unless ``tensor`` is given)."""
        return self.tensor if self.tensor is not None else f"{self.src}->{self.dst}"


class OpGraph:
    """A validated op DAG.

    Construction checks everything at once (duplicate names, unknown endpoints, negative sizes,
    a variable with two sizes, cycles) and raises one `PartitionError`.

    Example:
        >>> g = OpGraph([OpNode("a", 1.0), OpNode("b", 1.0)], [OpEdge("a", "b", 64)])
        >>> [n.name for n in g], g.successors("a"), g.variables()
        (['a', 'b'], ('b',), {})
    """

    def __init__(
        self,
        nodes: Iterable[OpNode],
        edges: Iterable[OpEdge],
        *,
        variable_elements: Mapping[str, int] | None = None,
    ) -> None:
        self._nodes: dict[str, OpNode] = {}
        problems: list[str] = []
        for node in nodes:
            if node.name in self._nodes:
                problems.append(f"op {node.name!r} is listed twice")
            if node.cost < 0 or any(b < 0 for b in node.variables.values()):
                problems.append(f"op {node.name!r} has a negative cost or variable size")
            self._nodes[node.name] = node
        self._edges = tuple(edges)
        self._succ: dict[str, list[str]] = {n: [] for n in self._nodes}
        self._pred: dict[str, list[str]] = {n: [] for n in self._nodes}
        for e in self._edges:
            if e.src not in self._nodes or e.dst not in self._nodes:
                problems.append(f"edge {e.src!r} -> {e.dst!r} names an unknown op")
                continue
            if e.bytes < 0:
                problems.append(f"edge {e.src!r} -> {e.dst!r} has negative bytes")
            if e.src == e.dst:
                problems.append(f"edge {e.src!r} -> {e.dst!r} is a self-loop")
            self._succ[e.src].append(e.dst)
            self._pred[e.dst].append(e.src)
        self._var_bytes: dict[str, int] = {}
        for node in self._nodes.values():
            for var, size in node.variables.items():
                if var in self._var_bytes and self._var_bytes[var] != size:
                    problems.append(f"variable {var!r} has two sizes, {self._var_bytes[var]} and {size} bytes")
                self._var_bytes.setdefault(var, size)
        if problems:
            raise PartitionError("invalid op graph:\n" + "\n".join(f"  - {p}" for p in problems))
        indegree = {n: len(p) for n, p in self._pred.items()}
        ready = [n for n in self._nodes if indegree[n] == 0]
        seen = 0
        while ready:
            n = ready.pop()
            seen += 1
            for m in self._succ[n]:
                indegree[m] -= 1
                if indegree[m] == 0:
                    ready.append(m)
        if seen != len(self._nodes):
            cyclic = sorted(n for n, d in indegree.items() if d > 0)
            raise PartitionError(f"invalid op graph: ops {cyclic[:8]} are on a cycle; the graph must be a DAG")
        self._elements = dict(variable_elements or {})

    def __iter__(self) -> Iterator[OpNode]:
        """Ops in program order."""
        return iter(self._nodes.values())

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, name: object) -> bool:
        return name in self._nodes

    def node(self, name: str) -> OpNode:
        """The op called ``name``."""
        try:
            return self._nodes[name]
        except KeyError:
            raise PartitionError(f"no op {name!r} in the op graph") from None

    @property
    def edges(self) -> tuple[OpEdge, ...]:
        """All edges."""
        return self._edges

    def successors(self, name: str) -> tuple[str, ...]:
        """Consumers of ``name``'s outputs."""
        return tuple(self._succ[name])

    def predecessors(self, name: str) -> tuple[str, ...]:
        """Producers of ``name``'s inputs."""
        return tuple(self._pred[name])

    def variables(self) -> dict[str, int]:
        """Every variable read by some op: name -> bytes."""
        return dict(self._var_bytes)

    def variable_elements(self, name: str) -> int:
        """Number of elements of a variable (0 when the frontend did not say)."""
        return self._elements.get(name, 0)
