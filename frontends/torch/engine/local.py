"""The microbatch task the current thread runs (set by the engine around each task).

Scoped to one step, so there is nothing here for smp.reset() to drop.
"""

from __future__ import annotations

import threading
from typing import Any

_local = threading.local()


def current_task() -> Any:
    """The engine's `Task` running on this thread, or None outside a pipelined step."""
    return getattr(_local, "task", None)


def set_task(task: Any) -> None:
    _local.task = task
