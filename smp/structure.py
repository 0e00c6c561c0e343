"""Nested structures: the one walker and the container rules every part of smp uses.

Containers are walked and rebuilt with their own types; everything else is a leaf:

- ``tuple`` -> ``tuple``; a namedtuple -> the same namedtuple (fields positionally); other tuple
  subclasses (``torch.Size``, structseqs) -> ``type(t)(items)``;
- ``list`` -> ``list``; a list subclass -> a shallow copy with the new items (its attributes kept);
- ``dict`` -> ``dict``; a mutable mapping (``OrderedDict``, ``defaultdict``, Hugging Face
  ``ModelOutput`` and ``BatchEncoding``) -> a shallow copy with the new values (its attributes and
  ``default_factory`` kept, keys in the template's order); a read-only mapping -> ``type(m)(items)``;
- a dataclass instance that is not a mapping -> ``type(d)(**fields)`` (`map_structure` only);
- sets, strings, tensors and all other objects are leaves.

Example:
    >>> from collections import namedtuple
    >>> Pair = namedtuple("Pair", "a b")
    >>> map_structure({"x": [1, Pair(2, 3)], "y": {"z": (4,)}}, lambda v: v * 10)
    {'x': [10, Pair(a=20, b=30)], 'y': {'z': (40,)}}
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import fields, is_dataclass
from typing import Any, cast

__all__ = ["is_namedtuple", "leaves", "map_structure", "rebuild_mapping", "rebuild_sequence"]


def is_namedtuple(x: object) -> bool:
    """Whether ``x`` is a namedtuple instance (a tuple whose type has ``_fields``)."""
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def rebuild_sequence(template: list[Any] | tuple[Any, ...], items: list[Any]) -> Any:
    """A sequence of ``template``'s type holding ``items``."""
    if type(template) is list:
        return items
    if type(template) is tuple:
        return tuple(items)
    if is_namedtuple(template):
        return type(template)(*items)
    if isinstance(template, list):
        out = copy.copy(template)  # keeps attributes of list subclasses whose __init__ differs
        out[:] = items
        return out
    return type(template)(items)  # tuple subclasses (torch.Size, structseqs) take one iterable


def rebuild_mapping(template: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    """A mapping of ``template``'s type holding ``items``."""
    if type(template) is dict:
        return items
    if isinstance(template, MutableMapping):
        # OrderedDict, defaultdict (its default_factory), UserDict subclasses such as HF's
        # BatchEncoding (their attributes): copy the container, then put the new values in.
        out = copy.copy(template)
        for key, value in items.items():
            out[key] = value
        return out
    # Read-only mappings (e.g. types.MappingProxyType) are built from a dict.
    return cast(Callable[[dict[Any, Any]], Any], type(template))(items)


def map_structure(obj: Any, leaf: Callable[[Any], Any], *, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """Apply ``leaf`` to every leaf of ``obj`` and rebuild its containers with their own types.

    Args:
        obj: the structure.
        leaf: called on each leaf; its result takes the leaf's place.
        is_leaf: values to treat as leaves even when they are containers (a frontend's tensor type,
            a placeholder dataclass).
    """
    if is_leaf is not None and is_leaf(obj):
        return leaf(obj)
    if isinstance(obj, (list, tuple)):
        return rebuild_sequence(obj, [map_structure(x, leaf, is_leaf=is_leaf) for x in obj])
    if isinstance(obj, Mapping):
        return rebuild_mapping(obj, {k: map_structure(v, leaf, is_leaf=is_leaf) for k, v in obj.items()})
    if is_dataclass(obj) and not isinstance(obj, type):
        return type(obj)(**{f.name: map_structure(getattr(obj, f.name), leaf, is_leaf=is_leaf) for f in fields(obj)})
    return leaf(obj)


def leaves(obj: Any, *, is_leaf: Callable[[Any], bool] | None = None) -> list[Any]:
    """Every leaf of ``obj`` in `map_structure`'s order, without rebuilding any container.

    Collecting leaves through `map_structure` would rebuild each container from the collector's
    results: a ``torch.Size`` or structseq cannot be rebuilt from ``None``s.

    Example:
        >>> leaves({"x": [1, (2, 3)], "y": {"z": 4}})
        [1, 2, 3, 4]
    """
    out: list[Any] = []
    _collect(obj, out, is_leaf)
    return out


def _collect(obj: Any, out: list[Any], is_leaf: Callable[[Any], bool] | None) -> None:
    if is_leaf is not None and is_leaf(obj):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _collect(x, out, is_leaf)
    elif isinstance(obj, Mapping):
        for v in obj.values():
            _collect(v, out, is_leaf)
    elif is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            _collect(getattr(obj, f.name), out, is_leaf)
    else:
        out.append(obj)
