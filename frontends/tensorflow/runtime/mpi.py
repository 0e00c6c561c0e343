"""mpi4py requests as the failure protocol's work handles, and pickled-object collectives that never hang.

Every wait on another rank in smp.tensorflow goes through `wait_request`: the request is polled
(``Test``) by `poll`, which checks the job's failure record and the peers' heartbeats between
polls (the core's `check_peers`) and gives up after ``comm_timeout`` naming the peer (the core's
`timeout_error`). It is the core's `smp.runtime.failure.wait` procedure with MPI's poll interval
(see `poll` for why). The poll runs in the calling thread: MPI requests report completion, unlike
gloo's, so no helper thread is needed, and concurrent waits from several TF executor threads never
queue behind each other.

A request abandoned by a timeout or a failure may still complete later into its buffer; both are
kept referenced in `_ABANDONED` so MPI never writes into freed memory (the job is failing anyway).
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from smp.errors import CommTimeoutError, RemoteRankError
from smp.runtime import failure as core_failure

from .failure import note_wait_error

__all__ = ["RequestWork", "all_true", "allgather_objects", "bcast_object", "poll", "set_backoff", "wait_request"]

_ABANDONED: list[tuple[Any, Any]] = []
_CHECK_EVERY_S = 0.05  # failure record and heartbeats, as often as the core checks them
_SPIN_S = 0.0005  # lockstep: test without pausing this long (a reply already on its way)
_PAUSE_S = 0.00005
_BACKOFF_S = 0.002  # with overlap, a long wait backs off to pauses this long: see `poll`
_max_pause_s = _PAUSE_S  # set by `set_backoff` (smp.init)
_spin_s = _SPIN_S  # set by `set_backoff` (smp.init)


def set_backoff(overlap: bool) -> None:
    """Overlap (each rank bound to its own core): waits pause from the first test on and back off; lockstep:
    spin briefly, then poll every 50 µs."""
    global _max_pause_s, _spin_s
    _max_pause_s = _BACKOFF_S if overlap else _PAUSE_S
    _spin_s = 0.0 if overlap else _SPIN_S


class RequestWork:
    """An ``MPI.Request`` as a `smp.runtime.failure.Work` (``is_completed`` polls ``Test``).

    Args:
        request: the pending request.
        keep: what the request reads or writes (kept alive with it).
        status: filled in on completion (a receive's source, tag and byte count).
    """

    def __init__(self, request: MPI.Request, keep: Any = None, status: MPI.Status | None = None) -> None:
        self.request = request
        self.keep = keep
        self.status = status
        self.done = False

    def is_completed(self) -> bool:
        self.done = self.done or bool(self.request.Test(self.status))
        return self.done

    def wait(self) -> None:
        # A completed request is null: waiting on it again would overwrite the status with an empty one.
        if not self.done:
            self.request.Wait(self.status)
            self.done = True


def wait_request(request: MPI.Request, what: str, peers: int | list[int], keep: Any = None,
                 timeout_s: float | None = None, status: MPI.Status | None = None) -> None:
    """Wait for ``request`` with the comm_timeout and failure detection (see the module docstring).

    Raises:
        RemoteRankError: another rank failed (`PeerLostError`: it is gone).
        CommTimeoutError: past the timeout (`PeerStalledError` naming the silent peer).
    """
    work = RequestWork(request, keep, status)
    try:
        poll(work, what, peers, timeout_s)
    except BaseException:
        if request != MPI.REQUEST_NULL:
            _ABANDONED.append((request, keep))
        raise


def poll(work: Any, what: str, peers: int | list[int], timeout_s: float | None = None) -> None:
    """The core's wait (`smp.runtime.failure.wait`) with MPI's polling: at most ~0.1 ms between tests.

    MPI moves a message (or a collective's next round) only inside MPI calls, so the gap between two
    ``Test`` calls is latency added to every step of a transfer: the core's loop backs off to 2 ms
    (right for gloo, whose own threads make progress). A 1 MiB allreduce over 2 ranks on the dev box:
    1.9 ms with this loop against 14 ms with the core's (load average 6), 8.1 against 16.4 ms
    (load 11, the two interleaved in one job). The cost of the short pause: a rank waiting 1 s used 0.065 s of CPU
    (0.021 s with 1 ms pauses; measured with mpi4py on the dev box). With overlap (`set_backoff`),
    a wait that goes on doubles its pause up to 2 ms: there a receive waits for the peer's next
    microbatch while another action computes on the same core, and 20,000 wake-ups a second took
    that core from it (``benchmarks/tf_pipeline.py``'s model, 2 ranks bound to a core each: 150 ->
    133 ms per step at 64 rows, 114-121 -> 102-106 at 16; every action ran 10-40 % shorter); nor
    does it spin first: a receive posted for the next microbatch spun 0.5 ms on the core the
    current action computes on (119 -> 112 ms per step at 64 rows, medians of 5 paired launches).
    Lockstep keeps the spin and the short pause: the waiting rank has nothing else to run, and on an unbound
    pair of ranks the backoff cost 5-15 %. The checks, the errors and
    their texts are the core's (`check_peers`, `timeout_error`, the heartbeat's activity), as in
    `smp.runtime.failure.wait`; a ``max_pause`` option there would let this function go.
    """
    ch = core_failure.channel()
    hb = ch.heartbeat if ch is not None else None
    ranks = [peers] if isinstance(peers, int) else list(peers)
    limit = timeout_s if timeout_s is not None else (ch.timeout_s if ch is not None else 300.0)
    if hb is not None:
        hb.set_activity(what)  # peers that time out can tell whether this rank was in the same wait
    try:
        start = time.monotonic()
        next_check = start + _CHECK_EVERY_S
        pause = _PAUSE_S
        while not work.is_completed():
            now = time.monotonic()
            if now >= next_check:
                core_failure.check_peers(ranks, what)
                next_check = now + _CHECK_EVERY_S
            if now - start > limit:
                raise core_failure.timeout_error(what, ranks, limit)
            if now - start >= _spin_s:
                time.sleep(pause)  # lets the other ranks (and TF's threads) have the core
                pause = min(2 * pause, _max_pause_s)
    except (RemoteRankError, CommTimeoutError) as e:
        note_wait_error(e)  # TF may hide it behind its own error: failure.py's Note [errors inside TF ops]
        raise
    finally:
        if hb is not None:
            hb.set_activity(None)


def _members(comm: MPI.Comm, ranks: list[int] | None) -> list[int]:
    return ranks if ranks is not None else list(range(comm.Get_size()))


def bcast_object(comm: MPI.Comm, obj: Any, root: int, what: str, ranks: list[int] | None = None,
                 timeout_s: float | None = None) -> Any:
    """``obj`` of ``root`` (a rank of ``comm``) on every member of ``comm``.

    Args:
        ranks: the global ranks of ``comm``'s members, for error messages (default: comm ranks).
    """
    if comm.Get_size() == 1:
        return obj
    peers = _members(comm, ranks)
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if comm.Get_rank() == root else b""
    size = np.array([len(data)], dtype=np.int64)
    wait_request(comm.Ibcast(size, root=root), f"{what} (size)", peers, size, timeout_s)
    buf = np.frombuffer(bytearray(data), dtype=np.uint8) if data else np.empty(int(size[0]), dtype=np.uint8)
    wait_request(comm.Ibcast(buf, root=root), what, peers, buf, timeout_s)
    return obj if comm.Get_rank() == root else pickle.loads(buf.tobytes())


def bcast_array(comm: MPI.Comm, array: np.ndarray, root: int, what: str, ranks: list[int] | None = None,
                timeout_s: float | None = None) -> np.ndarray:
    """``root``'s ``array`` on every member of ``comm``, sent as it is (no pickling: one copy at most).

    Every member passes an array of the agreed shape and dtype (the receivers' contents are
    overwritten, in place); returned for convenience.
    """
    if comm.Get_size() == 1:
        return array
    buf = np.ascontiguousarray(array)
    wait_request(comm.Ibcast(buf.reshape(-1).view(np.uint8), root=root), what, _members(comm, ranks), buf,
                 timeout_s)
    return buf


def allgather_objects(comm: MPI.Comm, obj: Any, what: str, ranks: list[int] | None = None,
                      timeout_s: float | None = None) -> list[Any]:
    """Every member's ``obj``, in ``comm`` rank order."""
    if comm.Get_size() == 1:
        return [obj]
    peers = _members(comm, ranks)
    data = np.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=np.uint8)
    sizes = np.zeros(comm.Get_size(), dtype=np.int64)
    mine = np.array([data.size], dtype=np.int64)
    wait_request(comm.Iallgather(mine, sizes), f"{what} (sizes)", peers, (mine, sizes), timeout_s)
    counts = [int(s) for s in sizes]
    displs = [sum(counts[:i]) for i in range(len(counts))]
    out = np.empty(sum(counts), dtype=np.uint8)
    wait_request(comm.Iallgatherv(data, [out, counts, displs, MPI.BYTE]), what, peers, (data, out), timeout_s)
    return [pickle.loads(out[d:d + c].tobytes()) for d, c in zip(displs, counts)]


def all_true(comm: MPI.Comm, flag: bool, what: str, timeout_s: float | None = None) -> bool:
    """Whether ``flag`` is True on every member of ``comm``."""
    if comm.Get_size() == 1:
        return flag
    mine = np.array([1 if flag else 0], dtype=np.int32)
    out = np.zeros(1, dtype=np.int32)
    wait_request(comm.Iallreduce(mine, out, op=MPI.MIN), what, list(range(comm.Get_size())), (mine, out),
                 timeout_s)
    return bool(out[0])
