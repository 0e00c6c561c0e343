"""Process-wide state: the one place it lives (STYLE.md habit 5).

Frontends read and write it through `current()`, `update()` and the `override()` context
manager, which restores the previous values in ``finally``; tests call `reset()`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

from smp.config import Config
from smp.topology import RankMap


@dataclass
class State:
    """What one process knows about the job. Users read ``smp.state.cfg.<key>`` as in SMP v1.

    Attributes:
        cfg: the resolved configuration (None before init).
        rank_map: the pp x tp x rdp layout (None before init).
        rank, local_rank, local_size: this process in the world and on its host.
        framework: "torch" or "tensorflow" once a frontend initialised.
        runtime: the frontend's runtime object (process groups, stores); opaque to the core.
        model, optimizer: the DistributedModel / DistributedOptimizer of this process.
    """

    cfg: Config | None = None
    rank_map: RankMap | None = None
    rank: int = 0
    local_rank: int = 0
    local_size: int = 1
    framework: str | None = None
    runtime: Any = None
    model: Any = None
    optimizer: Any = None

    @property
    def initialized(self) -> bool:
        return self.cfg is not None


_STATE = State()


def current() -> State:
    """The process-wide state object (the same object for the life of the process)."""
    return _STATE


def update(**values: Any) -> None:
    """Set fields of the state; unknown names are an error."""
    names = {f.name for f in fields(State)}
    for name, value in values.items():
        if name not in names:
            raise AttributeError(f"State has no field {name!r}")
        setattr(_STATE, name, value)


def reset() -> None:
    """Back to the uninitialised state (same object, so references stay valid)."""
    for f in fields(State):
        setattr(_STATE, f.name, f.default)


@contextmanager
def override(**values: Any) -> Iterator[State]:
    """Temporarily set fields; the previous values come back in ``finally``."""
    saved = {name: getattr(_STATE, name) for name in values}
    try:
        update(**values)
        yield _STATE
    finally:
        update(**saved)
