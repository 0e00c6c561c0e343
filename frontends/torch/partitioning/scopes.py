"""``smp.partition`` and ``smp.set_partition``: the manual placement a user writes, recorded for the core.

``with smp.partition(i):`` patches ``nn.Module.__init__`` while the outermost block is open, so that
every module created inside is noted with the innermost index; ``smp.set_partition`` notes an
existing module. Both land on the process state (`TorchState.created`, `TorchState.assigned`);
`manual_scopes` hands them to the core's `PartitionScopes`, which resolves them against the tree.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

import smp.state as smp_state
from smp.partition import PartitionScopes

from ..runtime.process_state import torch_state


def _recording_init(original: Callable[..., None]) -> Callable[..., None]:
    """``nn.Module.__init__`` while a block is open: ``original``, then note the innermost block."""

    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        ts = torch_state()
        if ts.partition_stack:
            ts.created[self] = ts.partition_stack[-1]

    return __init__


@contextlib.contextmanager
def partition(index: int) -> Iterator[None]:
    """``with smp.partition(i):`` — modules created inside are placed on pipeline rank ``i``.

    Nested blocks: the innermost wins. Ignored (with one log line) when ``auto_partition`` is True.

    Example:
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         with smp.partition(0):
        ...             self.embed = nn.Embedding(100, 16)
        ...         with smp.partition(1):
        ...             self.head = nn.Linear(16, 100)
    """
    cfg = smp_state.current().cfg
    if cfg is not None:
        # Checks the index (and logs the auto_partition rule) through the core's bookkeeping.
        with PartitionScopes.from_settings(cfg.partition_section()).partition(index):
            pass
    if not isinstance(index, int) or isinstance(index, bool):
        raise TypeError(f"smp.partition index must be an int, got {index!r}")
    # The block pushes and pops on the state it entered in: after an smp.reset() inside the block
    # that state is detached (and its patch already undone), so leaving touches nothing new.
    ts = torch_state()
    outermost = not ts.partition_stack
    ts.partition_stack.append(index)
    if outermost:
        ts.patch("smp.partition", nn.Module, "__init__", _recording_init(nn.Module.__init__))
    try:
        yield
    finally:
        ts.partition_stack.pop()
        if outermost:
            ts.unpatch("smp.partition")


def set_partition(module: nn.Module, partition: int, recurse: bool = True) -> None:
    """Place an existing module (and by default its submodules) on pipeline rank ``partition``.

    Call it after ``smp.DistributedModel(...)`` and before the first step.
    """
    model = smp_state.current().model
    if model is not None and getattr(model, "partitioned", False) and smp_state.current().cfg is not None \
            and smp_state.current().cfg.pipeline_parallel_degree > 1:
        from smp.errors import PartitionError

        raise PartitionError("smp.set_partition after the first step: the partition is final once the first "
                             "smp.step ran. Fix: call set_partition before the first step")
    torch_state().assigned.append((weakref.ref(module), partition, recurse))


def manual_scopes(root: nn.Module, cfg: Any) -> PartitionScopes:
    """The core's bookkeeping filled with this model's `smp.partition` blocks and set_partition calls."""
    scopes = PartitionScopes.from_settings(cfg.partition_section())
    paths = {id(m): p for p, m in root.named_modules()}
    ts = torch_state()
    for path, module in root.named_modules():
        if module in ts.created:
            scopes.note_created(path, ts.created[module])
    for ref, index, recurse in ts.assigned:
        module = ref()
        if module is not None and id(module) in paths:
            scopes.assign(paths[id(module)], index, recurse=recurse)
    return scopes
