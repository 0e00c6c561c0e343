"""Waiting on other ranks with a timeout, and spreading one rank's failure to all ranks.

Every wait in smp goes through `wait()`: it polls the torch.distributed work handle, gives up after
the communication timeout with an error naming the operation and the peers, and checks the
rendezvous store for a failure that another rank published. A rank that fails publishes its
traceback there (`publish_failure`, also installed as ``sys.excepthook`` by ``smp.init``), so the
others stop with `RemoteRankError` naming that rank instead of hanging.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any, Protocol

from smp.errors import CommTimeoutError, RemoteRankError

_ERROR_KEY = "smp/failure"
_CHECK_EVERY_S = 0.05


class _Work(Protocol):
    def is_completed(self) -> bool: ...
    def wait(self) -> Any: ...


class FailureChannel:
    """Publishes and detects failures through the job's key-value store."""

    def __init__(self, store: Any, rank: int, timeout_s: float) -> None:
        self.store = store
        self.rank = rank
        self.timeout_s = timeout_s
        self._prev_hook: Callable[..., Any] | None = None
        self._published = False

    def publish(self, text: str) -> None:
        """Record this rank's failure (the first published failure wins)."""
        if self._published or self.store is None:
            return
        self._published = True
        payload = f"{self.rank}\n{text}"
        try:
            self.store.compare_set(_ERROR_KEY, "", payload)
        except Exception:  # noqa: BLE001 - best effort while the job is already failing
            try:
                self.store.set(_ERROR_KEY, payload)
            except Exception:  # noqa: BLE001
                pass

    def check(self) -> None:
        """Raise RemoteRankError if another rank published a failure."""
        if self.store is None:
            return
        try:
            if not self.store.check([_ERROR_KEY]):
                return
            raw = self.store.get(_ERROR_KEY).decode("utf-8", "replace")
        except Exception as e:  # noqa: BLE001 - the store lives on a rank that may be gone
            raise RemoteRankError(0, f"lost the rendezvous store (hosted by rank 0): {e}") from None
        rank_text, _, text = raw.partition("\n")
        rank = int(rank_text) if rank_text.isdigit() else -1
        if rank != self.rank:
            raise RemoteRankError(rank, text)

    def install_excepthook(self) -> None:
        """Publish uncaught exceptions of this process before the default hook prints them."""
        if self._prev_hook is not None:
            return
        self._prev_hook = sys.excepthook

        def hook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
            if not isinstance(value, RemoteRankError):
                self.publish("".join(traceback.format_exception(tp, value, tb)))
            assert self._prev_hook is not None
            self._prev_hook(tp, value, tb)

        sys.excepthook = hook

    def uninstall_excepthook(self) -> None:
        if self._prev_hook is not None:
            sys.excepthook = self._prev_hook
            self._prev_hook = None


_channel: FailureChannel | None = None


def set_channel(channel: FailureChannel | None) -> None:
    global _channel
    if _channel is not None and channel is not _channel:
        _channel.uninstall_excepthook()
    _channel = channel


def channel() -> FailureChannel | None:
    return _channel


def publish_failure(exc: BaseException | None = None) -> None:
    """Tell every rank that this one failed (the current exception by default)."""
    if _channel is None:
        return
    if exc is None:
        text = traceback.format_exc()
    elif isinstance(exc, RemoteRankError):
        return
    else:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    _channel.publish(text)


class _Waiter:
    """A daemon thread that blocks on point-to-point work handles for the caller.

    gloo's send/recv handles never report completion through ``is_completed()`` and a ``wait`` with
    a timeout tears the connection down, so the blocking wait runs here while the caller polls an
    event, the deadline and the failure store.
    """

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[tuple[_Work, threading.Event, list[BaseException]]] = queue.SimpleQueue()
        self.busy_since: float | None = None
        threading.Thread(target=self._run, name="smp-p2p-waiter", daemon=True).start()

    def _run(self) -> None:
        while True:
            work, done, errors = self.jobs.get()
            self.busy_since = time.monotonic()
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                errors.append(e)
            self.busy_since = None
            done.set()


_waiter: _Waiter | None = None
_waiter_lock = threading.Lock()


def _p2p_waiter() -> _Waiter:
    global _waiter
    with _waiter_lock:
        if _waiter is None or _waiter.busy_since is not None:
            # A waiter still blocked on an earlier handle (after a timeout) is abandoned.
            _waiter = _Waiter()
        return _waiter


def _timeout_error(what: str, peers: object, limit: float) -> CommTimeoutError:
    ch = _channel
    me = f"rank {ch.rank}" if ch else "this rank"
    return CommTimeoutError(
        f"{me}: {what} with rank(s) {peers} did not complete within {limit:g} s "
        "(the comm_timeout config key sets this limit); a peer is probably stuck or waiting for a "
        "different operation")


def wait(work: _Work, what: str, peers: object, timeout_s: float | None = None, *, p2p: bool = False) -> Any:
    """Wait for a torch.distributed work handle with a timeout and failure detection.

    Args:
        work: the handle returned by an ``async_op=True`` collective, ``isend`` or ``irecv``.
        what: the operation, for the error message ("recv of an object").
        peers: the rank(s) involved, for the error message.
        timeout_s: overrides the configured communication timeout.
        p2p: the handle is a point-to-point send/recv (waited on by a helper thread).
    """
    ch = _channel
    limit = timeout_s if timeout_s is not None else (ch.timeout_s if ch else 300.0)
    start = time.monotonic()
    if p2p:
        done = threading.Event()
        errors: list[BaseException] = []
        _p2p_waiter().jobs.put((work, done, errors))
        while not done.wait(_CHECK_EVERY_S):
            if ch is not None:
                ch.check()
            if time.monotonic() - start > limit:
                raise _timeout_error(what, peers, limit)
        if errors:
            if ch is not None:
                time.sleep(0.2)  # give a crashing peer the moment it needs to publish its error
                ch.check()
            raise errors[0]
        return None
    next_check = start + _CHECK_EVERY_S
    pause = 0.0
    while not work.is_completed():
        now = time.monotonic()
        if now >= next_check:
            if ch is not None:
                ch.check()
            next_check = now + _CHECK_EVERY_S
        if now - start > limit:
            raise _timeout_error(what, peers, limit)
        # Spin briefly, then back off to at most 2 ms.
        if pause:
            time.sleep(pause)
        pause = min(0.002, pause * 2 if pause else 0.00005) if now - start > 0.001 else 0.0
    try:
        return work.wait()
    except RuntimeError:
        # A peer that failed closes its connections ("Connection closed by peer"): report its
        # published error rather than the transport's.
        if ch is not None:
            time.sleep(0.2)
            ch.check()
        raise
