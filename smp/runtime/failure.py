"""Waiting on other ranks with a timeout, and spreading one rank's failure to all ranks.

Framework-free: a frontend supplies the job's key-value store (`FailureStore`: torch's TCPStore,
smp.tensorflow's MPIStore, a dict in tests) when it opens the channel, and its work handles (`Work`: anything with
``is_completed()`` and a blocking ``wait()``) when it waits.

Every wait in smp goes through `wait()`: it polls the frontend's work handle, checks the
job's store for a failure another rank reported and this rank's view of its peers' heartbeats
(smp.runtime.liveness), and gives up after ``comm_timeout`` with an error naming the rank that did
not answer. A rank that fails publishes its traceback in the store (`publish_failure`, also
installed as ``sys.excepthook`` by ``smp.init``); a rank that finds a peer gone publishes that, in
the peer's name. So every rank stops with the same error, naming the same rank: `RemoteRankError`
(it raised), `PeerLostError` (its process is gone) or `PeerStalledError` (alive, not answering).

Transport errors ("Connection reset by peer" from gloo) are never reported as this rank's own
failure: a dropped connection means a peer went away, so the error is translated into the peer's
(see `translate`), waiting at most a few heartbeats for the evidence.
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, Protocol

import smp.state as smp_state
from smp.errors import CommTimeoutError, PeerLostError, PeerStalledError, RemoteRankError, SMPError
from smp.runtime.failure_record import FAILED, LOST, STALLED, FailureRecord, is_transport_error
from smp.runtime.liveness import Heartbeat, PeerState, Store

__all__ = ["DEAD_AFTER_S", "HEARTBEAT_S", "FailureChannel", "FailureStore", "Work", "channel", "check_peers",
           "publish_failure", "set_channel", "stalled_error", "timeout_error", "translate", "wait"]

_ERROR_KEY = "failure"
_CHECK_EVERY_S = 0.05
HEARTBEAT_S = 0.5
# A peer silent this long is gone. Loaded CI boxes starve threads for a second or two, never five.
DEAD_AFTER_S = float(os.environ.get("SMP_PEER_DEAD_AFTER_S", "5"))
# A peer that exited normally may have sent its last message just before: give it time to arrive.
_EXIT_GRACE_S = 2.0


class Work(Protocol):
    """A frontend's handle on an asynchronous operation (torch.distributed's ``Work``)."""

    def is_completed(self) -> bool: ...
    def wait(self) -> Any: ...


class FailureStore(Store, Protocol):
    """The job's key-value store as the failure record uses it: a `Store` with compare-and-set."""

    def compare_set(self, key: str, expected: str, desired: str) -> Any: ...


class FailureChannel:
    """Publishes and detects failures through the job's key-value store.

    Args:
        store: the job's store (None: a single process, nothing to report to).
        rank: this rank.
        timeout_s: the ``comm_timeout``.
        describe: ``describe(rank)`` names a rank with its coordinates ("rank 3 (pp_rank 1, ...)").
    """

    def __init__(self, store: FailureStore | None, rank: int, timeout_s: float,
                 describe: Callable[[int], str] | None = None) -> None:
        self.store = store
        self.rank = rank
        self.timeout_s = timeout_s
        self.describe = describe or (lambda r: f"rank {r}")
        self.heartbeat: Heartbeat | None = None
        self._prev_hook: Callable[..., Any] | None = None
        self._published = False

    # --- the failure record --------------------------------------------------------------------

    def who(self) -> str:
        """This rank as its failure names it: coordinates, pid and host ("rank 1 (pp_rank 1; pid 7 on host b)")."""
        where = f"pid {os.getpid()} on host {socket.gethostname()}"
        name = self.describe(self.rank)
        return f"{name[:-1]}; {where})" if name.endswith(")") else f"{name} ({where})"

    def publish(self, text: str) -> None:
        """Record this rank's failure (the first published failure wins), named with its coordinates and host."""
        self.publish_record(FailureRecord(self.rank, FAILED, self.rank, text, self.who()))

    def publish_record(self, record: FailureRecord) -> None:
        """Record a failure, possibly in another rank's name (a lost or stalled peer)."""
        if self._published or self.store is None:
            return
        self._published = True
        payload = record.encode()
        try:
            self.store.compare_set(_ERROR_KEY, "", payload)
        except Exception:  # noqa: BLE001 - best effort while the job is already failing
            try:
                self.store.set(_ERROR_KEY, payload)
            except Exception:  # noqa: BLE001
                pass

    def check(self) -> None:
        """Raise if another rank reported a failure, or the store itself is gone."""
        if self.store is None:
            return
        try:
            if not self.store.check([_ERROR_KEY]):
                return
            raw = self.store.get(_ERROR_KEY).decode("utf-8", "replace")
        except Exception as e:  # noqa: BLE001 - the store lives on a rank that may be gone
            why = f"{type(e).__name__}: {e}".split("\n")[0]
            if self.heartbeat is not None and self.heartbeat.store_error is None:
                self.heartbeat.store_error = why  # nor will the heartbeat reach it (or mark the exit)
            raise PeerLostError(0, self._store_lost_text(why)) from None
        error = FailureRecord.decode(raw).error_for(self.rank)
        if error is not None:
            raise error

    # --- liveness ------------------------------------------------------------------------------

    def start_heartbeat(self, peers: Iterable[int], store: Store | None = None) -> None:
        """Beat and watch ``peers`` (the ranks this one talks to) until `stop_heartbeat`."""
        if self.store is None or self.heartbeat is not None:
            return
        where = f"pid {os.getpid()} on host {socket.gethostname()}"
        self.heartbeat = Heartbeat(store if store is not None else self.store, self.rank, peers,
                                   on_lost=self._peer_lost, interval_s=HEARTBEAT_S, dead_after_s=DEAD_AFTER_S,
                                   where=where)
        self.heartbeat.start()

    def stop_heartbeat(self, *, exited: bool = True) -> None:
        hb, self.heartbeat = self.heartbeat, None
        if hb is not None:
            hb.stop(exited=exited)

    def _name(self, rank: int) -> str:
        where = self.heartbeat.where_of(rank) if self.heartbeat is not None else ""
        name = self.describe(rank)
        if not where:
            return name
        return f"{name[:-1]}; {where})" if name.endswith(")") else f"{name} ({where})"

    def _peer_lost(self, rank: int, reason: str) -> None:
        self.publish_record(FailureRecord(rank, LOST, self.rank, self._lost_text(rank, reason)))

    def _lost_text(self, rank: int, reason: str) -> str:
        return (f"{self._name(rank)} is gone: {reason} without an error report (noticed by rank {self.rank} from "
                f"the heartbeat, without waiting for the comm_timeout of {self.timeout_s:g} s). "
                "Its process was killed (SIGKILL, the out-of-memory killer), crashed in native code, or is frozen "
                "(SIGSTOP); check that rank's log and the kernel log (dmesg) of its host. The job cannot go on "
                "without it; restart from the last checkpoint.")

    def _exited_text(self, rank: int, what: str) -> str:
        return (f"{self._name(rank)} left the job: its process exited without an error (sys.exit(), the end of its "
                f"script) while rank {self.rank} still needed it ({what}). If its training loop simply ended "
                "sooner, the ranks ran different numbers of steps, e.g. uneven data across DP replicas: give every "
                "replica the same number of batches (DistributedSampler with drop_last=True).")

    def _store_lost_text(self, error: str) -> str:
        return (f"{self._name(0)} is most likely gone: rank {self.rank} lost the job's key-value store ({error}), "
                "which lives in rank 0's process with a bare launch or mpirun (a TCPStore at "
                "MASTER_ADDR:MASTER_PORT); check rank 0's log. Under torchrun the store is the agent's, so that "
                "agent or its host is gone.")

    def check_peers(self, peers: Iterable[int] | None, what: str, *, exit_grace_s: float = _EXIT_GRACE_S) -> None:
        """Raise if another rank reported a failure, a watched peer is lost, or one of ``peers`` left.

        Args:
            peers: the ranks this wait needs by name. None: none by name, so a peer that exited is no
                error here (it may have finished its script while this rank finishes its own).
            what: the wait, for the message.
            exit_grace_s: how long a peer may have exited before that counts (its last messages may
                still be arriving).
        """
        self.check()
        hb = self.heartbeat
        if hb is None:
            return
        if hb.store_error is not None:
            raise PeerLostError(0, self._store_lost_text(hb.store_error))
        lost = hb.lost()
        if lost:
            rank = min(lost)
            raise PeerLostError(rank, self._lost_text(rank, lost[rank]))
        for p in (() if peers is None else peers):
            state = hb.peer(p)
            if state.status == "exited" and state.exited_s >= exit_grace_s:
                text = self._exited_text(p, what)
                self.publish_record(FailureRecord(p, LOST, self.rank, text))
                raise PeerLostError(p, text)

    def explain(self, error: BaseException, what: str, peers: Iterable[int] | None) -> RemoteRankError | None:
        """The peer failure behind a transport error, waiting up to a few heartbeats for the evidence."""
        deadline = time.monotonic() + DEAD_AFTER_S + 4 * HEARTBEAT_S
        # The connection already failed, so any watched peer that exited is a suspect.
        suspects = list(peers) if peers is not None else (self.heartbeat.peers if self.heartbeat else [])
        while True:
            try:
                self.check_peers(suspects, what, exit_grace_s=0.0)
            except RemoteRankError as found:
                found.__cause__ = error
                return found
            if self.heartbeat is None or time.monotonic() > deadline:
                return None
            time.sleep(_CHECK_EVERY_S * 2)

    # --- stalls --------------------------------------------------------------------------------

    def _state_text(self, state: PeerState) -> str:
        if state.status == "alive":
            doing = f"waiting in {state.activity}" if state.activity else "running its own code, not waiting on a peer"
            return f"alive (last heartbeat {state.silent_s:.1f} s ago), {doing}"
        if state.status == "lost":
            return "gone (no heartbeat)"
        if state.status == "exited":
            return f"exited {state.exited_s:.1f} s ago"
        return "state unknown (not watched by this rank)"

    def stalled(self, peer: int, what: str, limit: float) -> CommTimeoutError:
        """The error for ``what`` not answered by ``peer`` within ``limit`` s (named after that peer)."""
        state = self.heartbeat.peer(peer) if self.heartbeat is not None else None
        seen = f" It is {self._state_text(state)}." if state is not None else ""
        return PeerStalledError(peer, (
            f"{self._name(peer)} did not answer rank {self.rank} within {limit:g} s (the comm_timeout config key "
            f"sets this limit): {what}.{seen} It is stuck or far slower than its peers (a deadlock, an endless loop, "
            "a blocking read, a rank waiting for a different operation); dump its stacks (py-spy dump --pid <its "
            "pid>), and raise comm_timeout if it is only slow."))

    def timeout_error(self, what: str, peers: Iterable[int], limit: float) -> CommTimeoutError:
        """The error for a wait with ``peers`` that ran past ``limit``: names the peer that is not in it."""
        others = [p for p in peers if p != self.rank]
        hb = self.heartbeat
        if hb is not None and others:
            states = {p: hb.peer(p) for p in others}
            # The peers waiting in the same operation are fine; the one elsewhere is the one to name.
            suspects = [p for p, s in states.items() if s.status != "alive" or what not in s.activity]
            if len(suspects) == 1:
                return self.stalled(suspects[0], what, limit)
            listing = "; ".join(f"{self.describe(p)}: {self._state_text(s)}" for p, s in states.items())
        else:
            listing = "no heartbeat information"
        return CommTimeoutError(
            f"rank {self.rank}: {what} with rank(s) {others} did not complete within {limit:g} s (the comm_timeout "
            f"config key sets this limit); a peer is stuck or waiting for a different operation. Peers: {listing}")

    # --- the exception hook --------------------------------------------------------------------

    def install_excepthook(self) -> None:
        """Publish uncaught exceptions of this process before the default hook prints them."""
        if self._prev_hook is not None:
            return
        self._prev_hook = sys.excepthook

        def hook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
            shown = translate(value, "this rank's last operation")
            if shown is not value:
                tp, value, tb = type(shown), shown, shown.__traceback__
            publish_failure(value)
            assert self._prev_hook is not None
            self._prev_hook(tp, value, tb)

        sys.excepthook = hook

    def uninstall_excepthook(self) -> None:
        if self._prev_hook is not None:
            sys.excepthook = self._prev_hook
            self._prev_hook = None

    def close(self) -> None:
        """Give back the excepthook and stop the heartbeat (marked exited); `smp.state.reset` calls it."""
        self.uninstall_excepthook()
        self.stop_heartbeat()


def set_channel(channel: FailureChannel | None) -> None:
    """Make ``channel`` this process's (``smp.state.current().failure``); the previous one is closed."""
    st = smp_state.current()
    previous = st.failure
    st.failure = channel
    if previous is not None and previous is not channel:
        previous.close()


def channel() -> FailureChannel | None:
    """This process's channel (in ``smp.state``, so `smp.state.reset` drops it), or None before init."""
    ch = smp_state.current().failure
    return ch if isinstance(ch, FailureChannel) else None


def _ranks(peers: object) -> list[int] | None:
    """The ranks in a wait's ``peers`` argument (an int or a list of ints), or None if it names none."""
    if isinstance(peers, int):
        return [peers]
    if isinstance(peers, (list, tuple)) and all(isinstance(p, int) for p in peers):
        return list(peers)
    return None


def translate(error: BaseException, what: str, peers: object = None) -> BaseException:
    """A transport error becomes the failure of the peer behind it; any other error is returned as is.

    A timeout that names no peer (a microbatch on this rank waiting for the baton that a stuck
    microbatch holds) is replaced by the peer's report if one arrives within a second: the rank that
    waited on this one publishes a stall in this rank's name, which says more than "waited".
    """
    ch = channel()
    if ch is None or isinstance(error, RemoteRankError):
        return error
    if isinstance(error, CommTimeoutError):
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                ch.check()
            except RemoteRankError as report:
                report.__cause__ = error
                return report
            time.sleep(_CHECK_EVERY_S)
        return error
    if isinstance(error, SMPError) or not is_transport_error(str(error)):
        return error
    found = ch.explain(error, what, _ranks(peers))
    return found if found is not None else error


def publish_failure(exc: BaseException | None = None) -> None:
    """Tell every rank that this one failed (the current exception by default).

    A stall is published in the silent peer's name; a peer's failure (`RemoteRankError`) is not
    published again; a dropped connection is first translated into the peer failure behind it.
    """
    ch = channel()
    if ch is None:
        return
    if exc is None:
        exc = sys.exc_info()[1]
        if exc is None:
            return
    exc = translate(exc, "this rank's last operation")
    if isinstance(exc, PeerStalledError):
        ch.publish_record(FailureRecord(exc.rank, STALLED, ch.rank, exc.remote_message))
    elif not isinstance(exc, RemoteRankError):
        ch.publish("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


def check_peers(peers: Iterable[int] | None, what: str) -> None:
    """Raise the failure of another rank, if any (for waits that are not `wait`'s, like the engine's)."""
    ch = channel()
    if ch is not None:
        ch.check_peers(peers, what)


def stalled_error(peer: int, what: str, limit: float) -> CommTimeoutError:
    """The error for ``peer`` not answering ``what`` within ``limit`` s."""
    ch = channel()
    if ch is None:
        return CommTimeoutError(f"rank {peer} did not answer within {limit:g} s (the comm_timeout config key "
                                f"sets this limit): {what}")
    return ch.stalled(peer, what, limit)


class _Waiter:
    """A daemon thread that blocks on point-to-point work handles for the caller.

    gloo's send/recv handles never report completion through ``is_completed()`` and a ``wait`` with
    a timeout tears the connection down, so the blocking wait runs here while the caller polls an
    event, the deadline and the failure store.
    """

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[tuple[Work, threading.Event, list[BaseException]]] = queue.SimpleQueue()
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


# Kept across smp.reset() on purpose: a worker thread, not job state. It holds nothing between
# waits (each job brings its handle and takes its result back), and one still blocked on a handle
# of an earlier job is replaced, never reused.
_waiter: _Waiter | None = None
_waiter_lock = threading.Lock()


def _p2p_waiter() -> _Waiter:
    global _waiter
    with _waiter_lock:
        if _waiter is None or _waiter.busy_since is not None:
            # A waiter still blocked on an earlier handle (after a timeout) is abandoned.
            _waiter = _Waiter()
        return _waiter


def timeout_error(what: str, peers: object, limit: float) -> CommTimeoutError:
    """The error for ``what`` with ``peers`` past ``limit`` s: names the one peer not in the same wait, if any."""
    ch = channel()
    ranks = _ranks(peers)
    if ch is not None and ranks is not None:
        return ch.timeout_error(what, ranks, limit)
    me = f"rank {ch.rank}" if ch else "this rank"
    return CommTimeoutError(
        f"{me}: {what} with rank(s) {peers} did not complete within {limit:g} s "
        "(the comm_timeout config key sets this limit); a peer is probably stuck or waiting for a "
        "different operation")


def wait(work: Work, what: str, peers: object, timeout_s: float | None = None, *, p2p: bool = False) -> Any:
    """Wait for a frontend's work handle with a timeout and failure detection.

    Args:
        work: the handle (torch: what an ``async_op=True`` collective, ``isend`` or ``irecv`` returns).
        what: the operation, for the error message ("recv of an object").
        peers: the rank(s) involved (an int or a list), for the error message and the liveness checks.
        timeout_s: overrides the configured communication timeout.
        p2p: the handle is a point-to-point send/recv (waited on by a helper thread).

    Raises:
        RemoteRankError: another rank failed (`PeerLostError`: it is gone).
        CommTimeoutError: past the timeout (`PeerStalledError` when one peer is identified).
    """
    ch = channel()
    hb = ch.heartbeat if ch is not None else None
    if hb is not None:
        hb.set_activity(what)  # peers that time out can tell whether this rank was in the same wait
    try:
        return _wait(work, what, peers, timeout_s, p2p)
    finally:
        if hb is not None:
            hb.set_activity(None)


def _wait(work: Work, what: str, peers: object, timeout_s: float | None, p2p: bool) -> Any:
    ch = channel()
    ranks = _ranks(peers)
    limit = timeout_s if timeout_s is not None else (ch.timeout_s if ch else 300.0)
    start = time.monotonic()
    if p2p:
        done = threading.Event()
        errors: list[BaseException] = []
        _p2p_waiter().jobs.put((work, done, errors))
        while not done.wait(_CHECK_EVERY_S):
            if ch is not None:
                ch.check_peers(ranks, what)
            if time.monotonic() - start > limit:
                raise timeout_error(what, peers, limit)
        if errors:
            translated = translate(errors[0], what, peers)
            if translated is errors[0]:
                raise translated
            raise translated from errors[0]
        return None
    next_check = start + _CHECK_EVERY_S
    pause = 0.0
    try:
        while not work.is_completed():
            now = time.monotonic()
            if now >= next_check:
                if ch is not None:
                    ch.check_peers(ranks, what)
                next_check = now + _CHECK_EVERY_S
            if now - start > limit:
                raise timeout_error(what, peers, limit)
            # Spin briefly, then back off to at most 2 ms.
            if pause:
                time.sleep(pause)
            pause = min(0.002, pause * 2 if pause else 0.00005) if now - start > 0.001 else 0.0
        return work.wait()
    except RuntimeError as e:
        # A peer that failed closes its connections ("Connection closed by peer"): report that peer.
        if isinstance(e, SMPError):
            raise
        translated = translate(e, what, peers)
        if translated is e:
            raise
        raise translated from e
