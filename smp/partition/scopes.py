"""Manual placement bookkeeping: ``with smp.partition(i):``, ``smp.set_partition``, ``default_partition``.

The frontend drives a `PartitionScopes`: it asks `PartitionScopes.current` when a module is
created (and remembers the answer with `PartitionScopes.note_created`), forwards
``smp.set_partition(module, i)`` to `PartitionScopes.assign` with the module's path, and, when the
module tree is known, calls `PartitionScopes.resolve` for the final `TreePartition`.

Rules (SMP v1, reference sections 3.3 and 3.7):

- Nested ``partition`` blocks: the innermost wins. The index must be in ``[0, pp)``.
- ``set_partition(path, i, recurse=True)`` places the module and all its descendants; calls apply
  in order, so a later call overrides an earlier one for the modules it covers. After the first
  step (`freeze`) it raises.
- A module with no placement gets ``default_partition``, except a parameter-less one (activation,
  dropout), which runs on its parent's rank: it has no state to place and would only add a hop.
- With ``auto_partition=True`` both are ignored, with one log line each.
- Modules that share a parameter must end up on one rank; otherwise an error names both.

Example:
    >>> from smp.partition.graph import ModuleNode, ModuleTree
    >>> scopes = PartitionScopes(pp_size=2, default_partition=0)
    >>> with scopes.partition(1):
    ...     scopes.note_created("head")          # the frontend calls this in nn.Module.__init__
    >>> tree = ModuleTree([ModuleNode("", ("body", "head")), ModuleNode("body", param_bytes=4),
    ...                    ModuleNode("head", param_bytes=4)])
    >>> scopes.resolve(tree).assignment
    {'': 0, 'body': 0, 'head': 1}
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Protocol

from smp.errors import InvalidPartitionIDError, PartitionError
from smp.partition.cost import MemoryBudget
from smp.partition.graph import ModuleTree
from smp.partition.result import TreePartition

__all__ = ["PartitionScopes", "PartitionSettings"]

logger = logging.getLogger("smp.partition")


class PartitionSettings(Protocol):
    """The part of the config manual placement needs (``smp.config.PartitionSection`` has it)."""

    @property
    def num_stages(self) -> int: ...

    @property
    def auto_partition(self) -> bool: ...

    @property
    def default_partition(self) -> int | None: ...


class PartitionScopes:
    """Manual placement state for one model (framework-free).

    Args:
        pp_size: pipeline_parallel_degree.
        auto_partition: when True, manual placement is ignored (logged once).
        default_partition: rank of modules placed nowhere (None: every module must be placed).
    """

    def __init__(self, pp_size: int, *, auto_partition: bool = False, default_partition: int | None = 0) -> None:
        if not isinstance(pp_size, int) or pp_size < 1:
            raise PartitionError(f"pp_size={pp_size!r} must be an int >= 1")
        self.pp_size = pp_size
        self.auto_partition = auto_partition
        if default_partition is not None:
            self._check(default_partition, "default_partition")
        self.default_partition = default_partition
        self._stack: list[int] = []
        self._created: dict[str, int] = {}
        self._calls: list[tuple[str, int, bool]] = []
        self._frozen = False
        self._logged: set[str] = set()

    @classmethod
    def from_settings(cls, settings: PartitionSettings) -> PartitionScopes:
        """Build from the config's partition section."""
        return cls(settings.num_stages, auto_partition=settings.auto_partition,
                   default_partition=settings.default_partition)

    # -- helpers ------------------------------------------------------------------------------
    def _check(self, index: object, what: str) -> int:
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < self.pp_size:
            raise InvalidPartitionIDError(
                f"{what}={index!r} is not a valid partition: it must be an int in [0, {self.pp_size}) for "
                f"pipeline_parallel_degree={self.pp_size}. Fix: use 0..{self.pp_size - 1}, or raise "
                "pipeline_parallel_degree"
            )
        return index

    def _log_once(self, key: str, message: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.info(message)

    # -- smp.partition --------------------------------------------------------------------------
    @contextmanager
    def partition(self, index: int) -> Iterator[None]:
        """``with smp.partition(index):`` -- modules created inside go to ``index`` (innermost wins)."""
        if self.auto_partition:
            self._log_once("scope", "smp.partition(...) blocks are ignored because auto_partition=True")
            yield
            return
        self._stack.append(self._check(index, "smp.partition index"))
        try:
            yield
        finally:
            self._stack.pop()

    def current(self) -> int | None:
        """The innermost active partition index, or None outside any block (or under auto)."""
        return self._stack[-1] if self._stack else None

    def note_created(self, path: str, index: int | None = None) -> None:
        """Record that module ``path`` was created in a block (``index``, default `current`)."""
        idx = self.current() if index is None else self._check(index, "partition index")
        if idx is not None:
            self._created[path] = idx

    def rename(self, mapping: Mapping[str, str]) -> None:
        """Re-key creation records (a frontend may record a provisional key before paths exist)."""
        self._created = {mapping.get(k, k): v for k, v in self._created.items()}

    # -- smp.set_partition ----------------------------------------------------------------------
    def assign(self, path: str, index: int, *, recurse: bool = True) -> None:
        """``smp.set_partition(module, index, recurse)`` for the module at ``path``."""
        if self.auto_partition:
            self._log_once("set", "smp.set_partition(...) calls are ignored because auto_partition=True")
            return
        if self._frozen:
            raise PartitionError(
                f"smp.set_partition({path!r}, {index}) after the first step: the partition is final once "
                "the first smp.step ran. Fix: call set_partition before the first step"
            )
        self._calls.append((path, self._check(index, f"set_partition({path!r}) index"), recurse))

    def freeze(self) -> None:
        """Mark the partition final (after the first step); later `assign` calls raise."""
        self._frozen = True

    # -- resolution -----------------------------------------------------------------------------
    def placements(self, tree: ModuleTree) -> dict[str, int]:
        """The explicit placements only (creation blocks, then set_partition calls in order)."""
        placed: dict[str, int] = {p: i for p, i in self._created.items() if p in tree}
        for path, index, recurse in self._calls:
            if path not in tree:
                raise PartitionError(
                    f"smp.set_partition was called for module {path!r}, which is not part of the model. "
                    "Fix: call it on a submodule of the DistributedModel"
                )
            for p in tree.subtree(path) if recurse else (path,):
                placed[p] = index
        return placed

    def resolve(self, tree: ModuleTree, *, budget: MemoryBudget | None = None) -> TreePartition:
        """Every module's rank under the manual rules; checks shared parameters.

        Raises:
            PartitionError: auto_partition is on, a module is unplaced with no default, or
                modules sharing a parameter are on different ranks (the message names both).
        """
        if self.auto_partition:
            raise PartitionError("resolve() is for manual placement; with auto_partition=True use partition_tree")
        placed = self.placements(tree)
        assignment: dict[str, int] = {}
        unplaced: list[str] = []
        for node in tree:
            path = node.path
            if path in placed:
                assignment[path] = placed[path]
                continue
            parent = tree.parent(path)
            if parent is not None and tree.is_parameterless(path):
                assignment[path] = assignment[parent]
            elif self.default_partition is not None:
                assignment[path] = self.default_partition
            else:
                unplaced.append(path)
                assignment[path] = 0
        if unplaced:
            raise PartitionError(
                f"{len(unplaced)} module(s) have no partition and default_partition is not set: "
                f"{unplaced[:6]}{' ...' if len(unplaced) > 6 else ''}. Fix: set default_partition in the config "
                "or place them with smp.partition / smp.set_partition"
            )
        return TreePartition.from_assignment(tree, assignment, self.pp_size, budget=budget, method="manual")
