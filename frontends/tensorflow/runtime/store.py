"""The job's key-value store for the failure protocol: a copy on every rank, kept up to date over MPI.

smp's failure record and heartbeats (`smp.runtime.failure`, `smp.runtime.liveness`) need a store
with ``set`` / ``get`` / ``check`` / ``compare_set``. torch has its TCPStore; TensorFlow has none,
and ``import smp.tensorflow`` must not import torch. The ranks of an smp.tensorflow job are already
connected by MPI, so the store lives there: every rank keeps a copy (a dict), a ``set`` sends the
new value to the ranks that read that key, on a communicator of the store's own (a ``Dup`` of the
world: no engine or user message can match one of these), and a read first takes in what arrived
(``improbe``; one probe when nothing came) and answers from the copy.

Who is sent what:

- ``hb/<r>`` (rank r's beat, every 0.5 s): the ranks that watch r (its group members, ``watchers``);
  its last beat, ``exited``, goes to every rank (the exit guard waits for all of them);
- every other key (where each rank runs, the failure record): every rank.

A rank that marked itself exited still takes messages in: it waits in `close` or in the exit guard.

The failure record is written with ``compare_set``, and the first failure must win on every rank.
Rank 0 arbitrates: a rank sends it the request, rank 0 applies it to its copy and sends the record
that won to every rank (and the answer to the asker). Rank 0 takes requests in whenever it reads the
store: every heartbeat (0.5 s) and every 50 ms of a wait on a peer. If rank 0 gives no answer within
`ARBITER_WAIT_S` (it is the frozen rank, or it left), the asker sets the record itself and sends it
to every rank; each copy keeps the first record it receives.

Why not files in a directory every rank sees (smp's first design): many clusters have no file
system shared by all hosts (Kubernetes pods, MPI clusters on local disks), and there the protocol
failed at ``smp.init``. Why not one-sided MPI (an atomic compare-and-swap on a window of rank 0): a
passive-target operation on a frozen rank 0 need not return, and every wait here must end in
seconds whatever a peer does. What files gave and this keeps: a record published by a rank that
then dies is already in every other rank's copy, and a rank's last beat (``exited``) outlives it.

Leaving: `close` (``smp.reset``, the end of the script) waits until every rank closes its store (a
non-blocking barrier, taking messages in meanwhile, at most ``timeout_s``), so no store message is
still on its way when MPI finalizes (MPICH's ``MPI_Finalize`` waits for every rank anyway). A rank
that ends the job after a failure calls `abandon` instead: its peers may be gone.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterable
from typing import Any

from mpi4py import MPI

from smp.runtime.liveness import EXITED

__all__ = ["ARBITER", "ARBITER_WAIT_S", "MPIStore"]

logger = logging.getLogger("smp")

ARBITER = 0
ARBITER_WAIT_S = 2.0
_SET, _CAS, _ANSWER = 1, 2, 3  # message tags
_POLL_S = 0.005
_BEAT = re.compile(r"hb/(\d+)")
_EXITED = EXITED.encode()
# Sends abandoned by `abandon`/`close`: MPI may still read their buffers (mpi4py keeps them with the request).
_ABANDONED: list[Any] = []


class MPIStore:
    """A key-value store kept by every rank of ``comm`` (see the module docstring).

    Args:
        comm: a communicator of the store's own (every rank of the job, collectively made).
        watchers: the ranks that read this rank's heartbeat (its group members).
        timeout_s: how long `get` waits for a key that is not set yet, and `close` for the others.

    Example (every rank runs it)::

        store = MPIStore(MPI.COMM_WORLD.Dup(), watchers=[1 - rank])
        store.set("hb/%d/where" % rank, "pid 7 on host a")
        store.get("hb/1/where")               # waits until rank 1's value arrives
        store.compare_set("failure", "", "0 failed 0\\n...")   # the same winner on every rank
        store.close()
    """

    def __init__(self, comm: Any, watchers: Iterable[int] = (), timeout_s: float = 30.0) -> None:
        self.comm = comm
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        self.timeout_s = timeout_s
        self._watchers = sorted(set(watchers) - {self.rank})
        self._data: dict[str, bytes] = {}
        self._first_wins: set[str] = set()  # keys written by compare_set: a copy keeps the first value
        self._answers: dict[str, bytes] = {}
        self._sends: list[Any] = []
        self._lock = threading.RLock()
        self._status = MPI.Status()
        self._open = True

    # --- the Store protocol ----------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        with self._lock:
            self._data[key] = data
            beat = _BEAT.fullmatch(key)
            if beat is not None and int(beat.group(1)) == self.rank and not data.startswith(_EXITED):
                self._send(_SET, (key, data, False), self._watchers)
            else:
                self._send(_SET, (key, data, False), range(self.size))

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to ``timeout_s`` for it to arrive (as torch's stores do)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            self._take_in()
            value = self._data.get(key)
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"key {key!r} not set in the job's store within {self.timeout_s:g} s "
                                   f"(rank {self.rank})")
            time.sleep(_POLL_S)

    def check(self, keys: list[str]) -> bool:
        self._take_in()
        return all(k in self._data for k in keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        """Set ``key`` to ``desired`` if its value is ``expected`` ("" also matches an unset key), on every rank.

        Returns the value stored afterwards (``desired`` when it was set), like torch's stores.
        """
        want, new = expected.encode("utf-8"), desired.encode("utf-8")
        with self._lock:
            self._first_wins.add(key)
            if self.rank == ARBITER:
                return self._arbitrate(key, want, new, asker=None)
            self._answers.pop(key, None)
            self._send(_CAS, (key, want, new), [ARBITER])
        deadline = time.monotonic() + ARBITER_WAIT_S
        while time.monotonic() < deadline:
            self._take_in()
            with self._lock:
                if key in self._answers:
                    return self._answers.pop(key)
            time.sleep(_POLL_S)
        with self._lock:  # no answer: rank 0 is frozen or gone; decide on this rank's copy
            logger.debug("rank %d: rank %d did not answer a compare_set of %r within %g s; setting it here",
                         self.rank, ARBITER, key, ARBITER_WAIT_S)
            return self._arbitrate(key, want, new, asker=None)

    # --- leaving ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait (up to ``timeout_s``) for every rank to close, taking messages in, then free the communicator."""
        if not self._open:
            return
        request = self.comm.Ibarrier()
        deadline = time.monotonic() + self.timeout_s
        while not request.Test():
            self._take_in()
            if time.monotonic() > deadline:
                # MPI_Finalize waits for the others anyway; this rank just stops answering the store.
                logger.debug("rank %d: not every rank closed the job's store within %g s; leaving it",
                             self.rank, self.timeout_s)
                _ABANDONED.append(request)
                self.abandon()
                return
            time.sleep(_POLL_S)
        self._take_in()
        self._open = False
        _ABANDONED.extend(r for r in self._sends if not r.Test())
        self._sends = []
        self.comm.Free()

    def abandon(self) -> None:
        """Stop using the store without waiting for anyone (the job is failing; peers may be gone)."""
        with self._lock:
            self._open = False
            _ABANDONED.extend(self._sends)
            self._sends = []

    # --- messages --------------------------------------------------------------------------------

    def _send(self, tag: int, message: tuple[Any, ...], ranks: Iterable[int]) -> None:
        if not self._open:
            return
        self._sends = [r for r in self._sends if not r.Test()]
        for peer in ranks:
            if peer != self.rank:
                self._sends.append(self.comm.isend(message, dest=peer, tag=tag))

    def _take_in(self) -> None:
        """Apply every store message that arrived."""
        with self._lock:
            while self._open:
                msg = self.comm.improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, self._status)
                if msg is None:
                    return
                source, tag = self._status.Get_source(), self._status.Get_tag()
                body = msg.recv()
                if tag == _CAS:
                    self._arbitrate(*body, asker=source)
                elif tag == _ANSWER:
                    key, value = body
                    self._receive(key, value)
                    self._answers[key] = self._data.get(key, b"")
                else:
                    key, value, first_wins = body
                    if first_wins:
                        self._first_wins.add(key)
                    self._receive(key, value)

    def _receive(self, key: str, value: bytes | None) -> None:
        if value is not None and not (key in self._first_wins and key in self._data):
            self._data[key] = value

    def _arbitrate(self, key: str, expected: bytes, desired: bytes, asker: int | None) -> bytes:
        """Apply a compare-and-set to this copy; send what won to every rank (and the answer to ``asker``)."""
        self._first_wins.add(key)
        current = self._data.get(key)
        if (current is None and expected == b"") or current == expected:
            self._data[key] = current = desired
            self._send(_SET, (key, desired, True), range(self.size))
        if asker is not None:
            self._send(_ANSWER, (key, current), [asker])
        return current if current is not None else b""
