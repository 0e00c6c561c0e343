"""Peer liveness over the job's key-value store: a heartbeat per rank, and which peers are gone.

Each rank's `Heartbeat` thread writes ``hb/<rank>`` every ``interval_s`` (a counter, plus what the
rank is waiting for) and reads the keys of the peers it watches. A peer whose value has not changed
for ``dead_after_s`` *on this rank's clock* is lost (no clock skew between hosts matters); a peer
whose value is ``exited`` left through a normal interpreter exit. The two differ on purpose: a
rank that finishes its script marks itself exited, so peers still finishing their last step do not
report it dead, and only a wait that still needs it turns "exited" into an error.

Worked example (interval 0.5 s, dead_after 5 s), rank 0 watching rank 1::

    t=0.0  hb/1 = "7\\t"                       rank 1 alive, running its own code
    t=0.5  hb/1 = "8\\tgradient allreduce"     alive, waiting in a collective
    t=1.0  hb/1 = "8\\tgradient allreduce"     unchanged (SIGKILL at t=0.7) ...
    t=5.5  still "8..." for 5.0 s              -> lost: ``on_lost(1, "...stopped 5.0 s ago...")``

The cost is one ``set`` per beat plus one ``get`` per watched peer; ranks watch the members of
their own groups (the ranks they talk to), and report a lost peer through the failure record so
that ranks which do not watch it learn of it too.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["EXITED", "Heartbeat", "PeerState", "Store", "local_process_gone"]

EXITED = "exited"
_KEY = "hb/{}"
_WHERE_KEY = "hb/{}/where"


def local_process_gone(where: str) -> bool:
    """Whether the process a peer registered as ``where`` ("pid P on host H") is gone, if H is this host.

    A process on this host can be looked up in ``/proc``: a killed peer is found in one heartbeat
    instead of ``dead_after_s``. Another host's process, a reused pid, or no ``/proc`` say False
    (the heartbeat's silence decides then). A stopped process (SIGSTOP) is not gone.
    """
    m = re.fullmatch(r"pid (\d+) on host (.+)", where)
    if m is None or m.group(2) != socket.gethostname():
        return False
    pid = int(m.group(1))
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[-1].split()[0]
        return state in ("Z", "X")  # a zombie has exited; only its parent has not collected it
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass
        return False


class Store(Protocol):
    """The part of a key-value store (torch's TCPStore, smp.tensorflow's MPIStore, a dict in tests) used here."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...


@dataclass(frozen=True)
class PeerState:
    """What this rank knows about one peer.

    Attributes:
        status: "alive", "exited" (left through a normal exit), "lost" (heartbeat stopped) or
            "unknown" (no heartbeat seen yet).
        silent_s: seconds since its heartbeat last changed (or since this rank started watching).
        activity: what it was waiting for at its last beat; "" means it was running its own code.
        exited_s: seconds since it was first seen exited (0 unless exited).
        where: "pid P on host H" as the peer registered itself ("" if unknown).
    """

    rank: int
    status: str
    silent_s: float
    activity: str
    exited_s: float
    where: str


class Heartbeat:
    """Writes this rank's heartbeat and watches its peers', from one daemon thread.

    Args:
        store: the job's store (a client of its own is best: the beat then never queues behind
            the training thread's store calls).
        rank: this rank.
        peers: the ranks to watch (this rank is dropped from the list).
        on_lost: called once per lost peer with (rank, reason), from the heartbeat thread.
        on_store_lost: called once when the store stops answering, with the error text.
        where: how this process describes itself to peers ("pid 123 on host h").
        probe: ``probe(where)`` tells whether a silent peer's process is known to be gone (default
            `local_process_gone`); such a peer is lost after two missed beats, not ``dead_after_s``.

    Example:
        >>> class Dict(dict):
        ...     def set(self, k, v): self[k] = v.encode()
        ...     def get(self, k): return self[k]
        ...     def check(self, ks): return all(k in self for k in ks)
        >>> store, now = Dict(), [0.0]
        >>> a = Heartbeat(store, 0, [1], on_lost=print, clock=lambda: now[0], dead_after_s=5)
        >>> b = Heartbeat(store, 1, [0], on_lost=print, clock=lambda: now[0])
        >>> b.tick(); a.tick(); a.peer(1).status
        'alive'
        >>> now[0] = 6.0; a.tick()   # rank 1 wrote nothing for 6 s
        1 its heartbeat stopped 6.0 s ago
    """

    def __init__(self, store: Store, rank: int, peers: Iterable[int], *,
                 on_lost: Callable[[int, str], None],
                 on_store_lost: Callable[[str], None] | None = None,
                 interval_s: float = 0.5, dead_after_s: float = 5.0, where: str = "",
                 probe: Callable[[str], bool] = local_process_gone,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.rank = rank
        self.peers = sorted(set(peers) - {rank})
        self.interval_s = interval_s
        self.dead_after_s = dead_after_s
        # A peer that never beat may still be starting (imports, group creation): wait longer.
        self.never_seen_after_s = 3 * dead_after_s
        self.where = where
        self.store_error: str | None = None
        self._on_lost = on_lost
        self._on_store_lost = on_store_lost
        self._probe = probe
        self._clock = clock
        started = clock()
        self._last: dict[int, str] = {}
        self._changed = {p: started for p in self.peers}
        self._seen: set[int] = set()
        self._exited_at: dict[int, float] = {}
        self._lost: dict[int, str] = {}
        self._activity: dict[int, str] = {}
        self._where: dict[int, str] = {}
        self._mine: dict[int, str] = {}  # thread ident -> what that thread waits for
        self._beat = 0
        self._failing = False  # the last beat failed: the store may be gone (its host exited first)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- this rank ---------------------------------------------------------------------------

    def set_activity(self, what: str | None) -> None:
        """Record what the calling thread waits for (None: it stopped waiting); sent with the next beat."""
        ident = threading.get_ident()
        if what is None:
            self._mine.pop(ident, None)
        else:
            self._mine[ident] = what

    def activity(self) -> str:
        # Tabs and newlines are the record's separators.
        text = "; ".join(sorted(set(self._mine.values())))
        return text.replace("\t", " ").replace("\n", " ")[:300]

    def start(self) -> None:
        """Write the first beat now (so peers see this rank at once), then beat from a thread."""
        if self._thread is not None:
            return
        try:
            if self.where:
                self.store.set(_WHERE_KEY.format(self.rank), self.where)
            self.tick()
        except Exception as e:  # noqa: BLE001 - any store failure means the store is unusable
            self._store_failed(e)
            return
        self._thread = threading.Thread(target=self._run, name=f"smp-heartbeat-{self.rank}", daemon=True)
        self._thread.start()

    def stop(self, *, exited: bool = True) -> None:
        """Stop the thread and (by default) mark this rank exited, so peers do not report it lost."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=self.interval_s + 5.0)
        if exited and self.store_error is None and not self._failing:
            try:
                self.store.set(_KEY.format(self.rank), f"{EXITED}\t")
            except Exception:  # noqa: BLE001 - the store may be gone with its host; exiting anyway
                pass

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
                failures = 0
                self._failing = False
            except Exception as e:  # noqa: BLE001 - any store failure
                # One retry: a single slow answer is not yet a lost store.
                failures += 1
                self._failing = True
                if failures >= 2:
                    self._store_failed(e)
                    return

    def _store_failed(self, e: BaseException) -> None:
        self.store_error = f"{type(e).__name__}: {e}".split("\n")[0]  # torch appends a C++ stack
        if self._on_store_lost is not None:
            self._on_store_lost(self.store_error)

    # --- the peers -----------------------------------------------------------------------------

    def tick(self) -> None:
        """One round: write this rank's beat, read every watched peer's, declare the lost ones."""
        self._beat += 1
        self.store.set(_KEY.format(self.rank), f"{self._beat}\t{self.activity()}")
        now = self._clock()
        newly_lost: list[tuple[int, str]] = []
        silent: list[tuple[int, float]] = []
        for p in self.peers:
            if p in self._lost:
                continue
            key = _KEY.format(p)
            if p not in self._seen:
                # get() blocks until a key exists, hence check() first.
                if not self.store.check([key]):
                    if now - self._changed[p] > self.never_seen_after_s:
                        newly_lost.append((p, f"it never sent a heartbeat in {now - self._changed[p]:.1f} s"))
                    continue
                self._seen.add(p)
            raw = self.store.get(key).decode("utf-8", "replace")
            count, _, activity = raw.partition("\t")
            with self._lock:
                if count == EXITED:
                    self._exited_at.setdefault(p, now)
                    continue
                self._exited_at.pop(p, None)  # written again: a new run of smp.init on that rank
                if raw != self._last.get(p):
                    self._last[p], self._changed[p], self._activity[p] = raw, now, activity
                elif now - self._changed[p] > self.dead_after_s:
                    newly_lost.append((p, f"its heartbeat stopped {now - self._changed[p]:.1f} s ago"))
                elif now - self._changed[p] > 2 * self.interval_s:
                    silent.append((p, now - self._changed[p]))
        for p, quiet in silent:
            if self._probe(self.where_of(p)):
                newly_lost.append((p, f"its process no longer exists (heartbeat silent for {quiet:.1f} s)"))
        for p, reason in newly_lost:
            with self._lock:
                self._lost[p] = reason
            self.where_of(p)
            self._on_lost(p, reason)

    def where_of(self, p: int) -> str:
        """How peer ``p`` registered itself ("pid P on host H"); one store read, then cached."""
        if p not in self._where:
            key = _WHERE_KEY.format(p)
            try:
                self._where[p] = self.store.get(key).decode() if self.store.check([key]) else ""
            except Exception:  # noqa: BLE001 - only decoration for the message
                self._where[p] = ""
        return self._where[p]

    def peer(self, rank: int) -> PeerState:
        """What this rank knows about ``rank`` (any rank; unwatched ones are "unknown")."""
        now = self._clock()
        with self._lock:
            where = self._where.get(rank, "")
            if rank in self._lost:
                return PeerState(rank, "lost", now - self._changed.get(rank, now), self._activity.get(rank, ""),
                                 0.0, where)
            if rank in self._exited_at:
                return PeerState(rank, "exited", 0.0, "", now - self._exited_at[rank], where)
            if rank in self._seen:
                return PeerState(rank, "alive", now - self._changed[rank], self._activity.get(rank, ""), 0.0, where)
        return PeerState(rank, "unknown", 0.0, "", 0.0, where)

    def lost(self) -> dict[int, str]:
        """Every lost peer with the reason."""
        with self._lock:
            return dict(self._lost)
