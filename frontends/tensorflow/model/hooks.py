"""``@smp.register_post_partition_hook``: functions run once, after partitioning, before the first forward.

SMP v1 TF (1.3.1+): a module-level decorator on a function of no arguments, run in eager mode
once the model is partitioned (typically to restore a checkpoint into the partitioned model).
The registry is per process, like the decorator lines that fill it (they run at import time, so
it survives ``smp.reset()``); each `DistributedModel` runs every registered hook once, at its own
partitioning. ``smp.CheckpointManager.restore()`` called before the first step runs there too,
once, after the registered hooks (`run_after_partitioning`).

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
_ONCE: list[Callable[[], Any]] = []  # `run_after_partitioning`: one-shot, cleared by smp.reset()


def register_post_partition_hook(hook: Callable[[], Any]) -> Callable[[], Any]:
    """Register ``hook`` (called with no arguments) to run after partitioning; returns it unchanged.

    Raises:
        TypeError: ``hook`` is not callable.
    """
    if not callable(hook):
        raise TypeError(f"smp.register_post_partition_hook takes a function, got {hook!r}")
    _HOOKS.append(hook)
    return hook


_MODEL_BUILT: list[bool] = []  # non-empty once a DistributedModel was constructed in this smp.init session


def note_model_constructed() -> None:
    """Record that this session has a DistributedModel (so a deferred action will run); `smp.reset()` forgets it."""
    from ..state import tf_state

    if not _MODEL_BUILT:
        _MODEL_BUILT.append(True)
        tf_state().close_hooks.append(_MODEL_BUILT.clear)


def model_constructed() -> bool:
    """Whether a DistributedModel was constructed since ``smp.init``."""
    return bool(_MODEL_BUILT)


def run_after_partitioning(action: Callable[[], Any]) -> None:
    """Run ``action`` once, at the next partitioning of a DistributedModel, after the registered hooks.

    For smp's own deferred work (``CheckpointManager.restore()`` before the first step). Pending
    actions are dropped at ``smp.reset()``.
    """
    from ..state import tf_state

    if not _ONCE:
        tf_state().close_hooks.append(_ONCE.clear)
    _ONCE.append(action)


def run_post_partition_hooks() -> None:
    """Run every registered hook in registration order, then the pending one-shot actions (once per model)."""
    for hook in list(_HOOKS):
        hook()
    while _ONCE:
        _ONCE.pop(0)()
