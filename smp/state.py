"""Process-wide state: the one place it lives (STYLE.md habit 5).

Frontends read and write it through `current()`, `update()` and the `override()` context
manager, which restores the previous values in ``finally``; `reset()` (``smp.reset()``) drops all
of it at once. Two fields hold objects with a ``close()`` that `reset` calls: the failure channel
(`smp.runtime.failure`) and the frontend's own process state (``smp.torch``: `TorchState`, its
pending checkpoint loads, open context stacks and patches), so nothing a script set before a reset
reaches the next model. What a frontend keeps across resets on purpose is documented where it is
kept (``smp.torch``: ``process_state.KEPT``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, Protocol

from smp.config import Config
from smp.topology import RankMap


class Closeable(Protocol):
    """What `reset` closes: an object holding threads, hooks or patches that must not outlive it."""

    def close(self) -> None: ...


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
        failure: the failure channel (`smp.runtime.failure.FailureChannel`) once init opened it.
        frontend: the frontend's per-process state (``smp.torch``: `TorchState`), made on first use.
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
    failure: Closeable | None = None
    frontend: Closeable | None = None

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
    """Back to the uninitialised state (same object, so references stay valid).

    The failure channel and the frontend state are closed after every field is back to its default,
    so what a close triggers already sees the fresh state.
    """
    held = [obj for obj in (_STATE.failure, _STATE.frontend) if obj is not None]
    for f in fields(State):
        setattr(_STATE, f.name, f.default)
    _close_all(held)


def _close_all(objects: list[Closeable]) -> None:
    """Close each object, even when an earlier close raised (the first error is raised at the end)."""
    error: BaseException | None = None
    for obj in objects:
        try:
            obj.close()
        except BaseException as e:  # noqa: BLE001 - raised below, once every object is closed
            error = error or e
    if error is not None:
        raise error


@contextmanager
def override(**values: Any) -> Iterator[State]:
    """Temporarily set fields; the previous values come back in ``finally``."""
    saved = {name: getattr(_STATE, name) for name in values}
    try:
        update(**values)
        yield _STATE
    finally:
        update(**saved)
