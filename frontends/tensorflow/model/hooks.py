"""``@smp.register_post_partition_hook``: functions run once, after partitioning, before the first forward.

SMP v1 TF (1.3.1+): a module-level decorator on a function of no arguments, run in eager mode
once the model is partitioned (typically to restore a checkpoint into the partitioned model).
The registry is per process, like the decorator lines that fill it (they run at import time, so
it survives ``smp.reset()``); each `DistributedModel` runs every registered hook once, at its own
partitioning.

Example:
    >>> @smp.register_post_partition_hook
    ... def restore():
    ...     checkpoint_manager.restore()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["register_post_partition_hook"]

_HOOKS: list[Callable[[], Any]] = []


def register_post_partition_hook(hook: Callable[[], Any]) -> Callable[[], Any]:
    """Register ``hook`` (called with no arguments) to run after partitioning; returns it unchanged.

    Raises:
        TypeError: ``hook`` is not callable.
    """
    if not callable(hook):
        raise TypeError(f"smp.register_post_partition_hook takes a function, got {hook!r}")
    _HOOKS.append(hook)
    return hook


def run_post_partition_hooks() -> None:
    """Run every registered hook in registration order (the model calls this once)."""
    for hook in list(_HOOKS):
        hook()
