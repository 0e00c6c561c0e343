"""Graph questions the TensorFlow tests ask of a traced function."""

from __future__ import annotations

from typing import Any


def ancestors(op: Any) -> set[Any]:
    """Every op ``op`` waits for in its graph, through data and control inputs."""
    seen: set[Any] = set()
    todo = [op]
    while todo:
        o = todo.pop()
        for parent in [t.op for t in o.inputs] + list(o.control_inputs):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen
