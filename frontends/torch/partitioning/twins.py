"""Identical layers cost the same: one measured time for every copy of a repeated layer.

A traced time is a measurement: 5 runs of one microbatch, the fastest kept (trace.py), still move
by a few percent between launches, and the automatic partition is a function of those times. With
every decoder layer timed on its own, the layers near a cut win or lose a few percent at random and
the cut moved between launches (issue 39: 2 distinct cuts in 5 launches of an HF Llama). But the
layers of a ``ModuleList`` (or ``nn.Sequential``) that have the same class, the same parameter
shapes and the same output are the same computation: they get one time, the median of their
measured times (and so does every submodule of theirs, attention and MLP alike). Eight layers
measured once each give one time measured eight times; what is left to noise is the ratio of a
layer to the model's other modules (the embedding, the head and its loss), which decides the cut
only when it sits on a boundary.
"""

from __future__ import annotations

import statistics
from typing import Any

from torch import nn

__all__ = ["equalize_twins"]

_CONTAINERS = (nn.Sequential, nn.ModuleList)


def _signature(module: nn.Module, output_bytes: int | None) -> tuple[Any, ...]:
    shapes = tuple((name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters())
    kinds = tuple(type(m).__qualname__ for m in module.modules())
    return type(module).__qualname__, kinds, shapes, output_bytes


def _groups(root: nn.Module, tr: Any) -> list[list[str]]:
    """Paths of twin layers: siblings in one container with the same signature, traced, two or more."""
    out = []
    for path, container in root.named_modules():
        if not isinstance(container, _CONTAINERS):
            continue
        by_signature: dict[tuple[Any, ...], list[str]] = {}
        for name, child in container.named_children():
            child_path = f"{path}.{name}" if path else name
            if child_path in tr.time:
                by_signature.setdefault(_signature(child, tr.output_bytes.get(child_path)), []).append(child_path)
        out += [paths for paths in by_signature.values() if len(paths) > 1]
    return out


def _median_over(values: dict[Any, float], keys: list[Any]) -> None:
    """Set each of ``keys`` (all present in ``values``) to their median."""
    middle = statistics.median(values[k] for k in keys)
    for k in keys:
        values[k] = middle


def equalize_twins(root: nn.Module, tr: Any) -> Any:
    """Give the twin layers of ``root`` (module docstring) and their submodules the median of their times.

    ``tr`` is a `trace.Trace`; its ``time``, ``backward_time`` and ``tails`` change in place, and it is returned.

    Example:
        >>> import torch
        >>> from types import SimpleNamespace
        >>> net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
        >>> tr = SimpleNamespace(time={"0": 1.0, "1": 1.3, "2": 1.1}, output_bytes={"0": 64, "1": 64, "2": 64},
        ...                      backward_time={}, tails={})
        >>> equalize_twins(net, tr).time
        {'0': 1.1, '1': 1.1, '2': 1.1}
    """
    for paths in _groups(root, tr):
        suffixes = [p[len(paths[0]):] for p in tr.time if p == paths[0] or p.startswith(paths[0] + ".")]
        for table in (tr.time, tr.backward_time):
            for suffix in suffixes:
                keys = [p + suffix for p in paths]
                if all(k in table for k in keys):
                    _median_over(table, keys)
        for caller, child in [k for k in tr.tails if k[0] == paths[0] or k[0].startswith(paths[0] + ".")]:
            rel = (caller[len(paths[0]):], child[len(paths[0]):])
            keys = [(p + rel[0], p + rel[1]) for p in paths]
            if all(k in tr.tails for k in keys):
                _median_over(tr.tails, keys)
    return tr
