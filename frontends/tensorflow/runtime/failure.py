"""The failure protocol for an mpiexec job: the core's channel on the job's file store, and how a failing job ends.

The procedure (publish a failure, detect it, name the rank, heartbeats, waits with a timeout) is
`smp.runtime.failure`; this module opens its channel on the `MPIStore` of store.py and adds what
MPI needs on top: mpiexec does not stop the other ranks when one rank's Python raises (measured:
a rank that exits with an error leaves its peers running, waiting forever), so an uncaught
exception ends the job itself:

1. the core's hook publishes the failure (a peer's failure is not published again) and prints the
   traceback, after a ``[smp rank r] ERROR`` line naming the rank;
2. this rank marks itself exited (its heartbeat) and waits up to ``SMP_EXIT_GRACE_S`` (5 s) for
   every other rank to be done: exited (the others stop within ~50 ms of the record when they are
   in an smp wait, with `RemoteRankError` naming the failed rank and its traceback, and come
   through this same hook) or gone;
3. if all are done it exits normally (exit status 1); otherwise it logs which ranks still run and
   calls ``MPI_Abort`` (exit status 1), which ends every rank of the job.

Timeline (2 ranks, rank 1 raises while rank 0 waits for its activations)::

    t=0.00  rank 1: ValueError -> asks rank 0 to record "1 failed 1" -> prints -> marks exited, waits
    t=0.05  rank 0: its recv's check takes the request in, records it, sends it to every rank
            -> RemoteRankError(rank 1 on its host, traceback) -> prints -> exited
    t=0.10  both see the other exited -> exit 1; mpiexec returns 1

A SIGKILLed rank ends an mpiexec (Hydra) job at once: Hydra kills the others itself. Under
``mpiexec -disable-auto-cleanup`` (or a launcher that keeps running) the survivors find the dead
peer through the heartbeat (its ``/proc`` entry is gone: ~1 s on one host, 5 s otherwise) and stop
with `PeerLostError` naming it. A rank that stalls (alive, not answering) is named by the rank
waiting for it after ``comm_timeout`` (`PeerStalledError`); that rank's exit then aborts the job.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from smp.errors import RemoteRankError, SMPError
from smp.runtime.failure import (
    DEAD_AFTER_S,
    HEARTBEAT_S,
    FailureChannel,
    channel,
    check_peers,
    publish_failure,
    set_channel,
    stalled_error,
    timeout_error,
    translate,
    wait,
)
from smp.runtime.liveness import EXITED, local_process_gone

from .store import MPIStore

__all__ = ["DEAD_AFTER_S", "EXIT_GRACE_S", "HEARTBEAT_S", "ExitGuard", "FailureChannel", "channel", "check_peers",
           "note_wait_error", "open_channel", "publish_failure", "ranks_still_running", "set_channel",
           "smp_error_behind", "stalled_error", "timeout_error", "translate", "wait"]

logger = logging.getLogger("smp")

EXIT_GRACE_S = float(os.environ.get("SMP_EXIT_GRACE_S", "5"))
# Between the last line this rank writes and MPI_Abort: mpiexec (Hydra) tears the job down on the
# abort without always passing on what the rank wrote just before (the "ending the job" line was
# missing from the job's output in 1 of 4-8 launches of tests/tensorflow/runtime/test_failures.py).
_FORWARD_S = 0.25
# The keys smp.runtime.liveness writes: a rank's beat ("<count>\t<activity>" or "exited\t") and where it runs.
_BEAT_KEY, _WHERE_KEY = "hb/{}", "hb/{}/where"


def open_channel(store: MPIStore | None, rank: int, timeout_s: float,
                 describe: Callable[[int], str] | None = None) -> FailureChannel:
    """This process's failure channel on the job's store, made current (``smp.state.current().failure``)."""
    global _wait_error
    _wait_error = None
    ch = FailureChannel(store, rank, timeout_s, describe)
    set_channel(ch)
    return ch


# Note [errors inside TF ops]: a wait that fails inside a ``tf.numpy_function`` (the engine's
# exchange ops) raises its RemoteRankError / CommTimeoutError in a TF executor thread; TF turns it
# into a ``tf.errors.UnknownError`` carrying only the text. Published as is, that error would name
# this rank as the one that failed, and a stalled peer would not be reported in its own name. So
# the first such error of this process is kept here (`note_wait_error`, called by mpi.poll), and
# `smp_error_behind` gives it back for the TF error that carries its text.
_wait_error: BaseException | None = None


def note_wait_error(error: BaseException) -> None:
    """Keep the first failed wait's error of this process (see Note [errors inside TF ops])."""
    global _wait_error
    if _wait_error is None:
        _wait_error = error


def smp_error_behind(error: BaseException) -> BaseException | None:
    """The smp error behind ``error``: itself if it is one, the failed wait a TF error carries, or None.

    Example: a ``tf.errors.UnknownError`` whose text holds "PeerStalledError: rank 1 (...) did not
    answer" gives the `PeerStalledError` itself (with its ``rank``), to publish and print.
    """
    if isinstance(error, SMPError):
        return error
    noted = _wait_error
    if noted is not None and type(error).__module__.startswith("tensorflow") and \
            f"{type(noted).__name__}: " in str(error):
        return noted
    return None


def _rank_done(store: MPIStore, peer: int) -> bool:
    """Whether ``peer`` left the job: it marked itself exited, or its process on this host is gone."""
    beat = store.get(_BEAT_KEY.format(peer)) if store.check([_BEAT_KEY.format(peer)]) else b""
    if beat.decode("utf-8", "replace").partition("\t")[0] == EXITED:
        return True
    where_key = _WHERE_KEY.format(peer)
    where = store.get(where_key).decode() if store.check([where_key]) else ""
    return bool(where) and local_process_gone(where)


def ranks_still_running(store: MPIStore, world: int, rank: int) -> list[int]:
    """The ranks other than ``rank`` still in the job (empty: every one exited or is gone)."""
    return [p for p in range(world) if p != rank and not _rank_done(store, p)]


class ExitGuard:
    """Ends the job when this rank dies of an uncaught exception (see the module docstring).

    Installed over the core channel's ``sys.excepthook`` by ``smp.init``; ``abort`` is
    ``MPI.COMM_WORLD.Abort``.
    """

    def __init__(self, ch: FailureChannel, store: MPIStore, world: int, abort: Callable[[int], Any],
                 grace_s: float = EXIT_GRACE_S) -> None:
        self.channel = ch
        self.store = store
        self.world = world
        self.abort = abort
        self.grace_s = grace_s
        self._prev: Callable[..., Any] | None = None

    def install(self) -> None:
        if self._prev is not None:
            return
        self._prev = sys.excepthook
        sys.excepthook = self._hook

    def uninstall(self) -> None:
        if self._prev is not None and sys.excepthook == self._hook:
            sys.excepthook = self._prev
        self._prev = None

    def _hook(self, tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        rank = self.channel.rank
        behind = smp_error_behind(value)
        surfaced = ""
        if behind is not None and behind is not value:
            surfaced = f" (it surfaced as {type(value).__module__}.{tp.__name__} from a TensorFlow op)"
            tp, value, tb = type(behind), behind, behind.__traceback__
        remote = getattr(value, "rank", None) if isinstance(value, RemoteRankError) else None
        if remote is not None and remote != rank:
            logger.error("stopping: rank %s failed (%s)%s; its report follows", remote, tp.__name__, surfaced)
        else:
            logger.error("this rank failed with an uncaught %s%s; the other ranks are told to stop", tp.__name__,
                         surfaced)
        assert self._prev is not None
        self._prev(tp, value, tb)  # the core's hook: publish, then print
        sys.stderr.flush()
        self.end_job()

    def end_job(self) -> None:
        """Mark this rank exited, wait for the others to leave, abort the job if they do not."""
        self.channel.stop_heartbeat(exited=True)
        deadline = time.monotonic() + self.grace_s
        running = ranks_still_running(self.store, self.world, self.channel.rank)
        while running and time.monotonic() < deadline:
            time.sleep(0.05)
            running = ranks_still_running(self.store, self.world, self.channel.rank)
        self.store.abandon()  # the process ends now: no barrier with peers that may be gone
        if not running:
            return
        logger.error("ending the job with MPI_Abort: rank(s) %s still running %.0f s after the failure was "
                     "published (stalled, or not in an smp wait)", running, self.grace_s)
        sys.stderr.flush()
        sys.stdout.flush()
        time.sleep(_FORWARD_S)
        self.abort(1)
