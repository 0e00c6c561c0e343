"""Heartbeats over a fake store and a fake clock: alive, lost, exited, never seen, store gone; the failure record."""

from __future__ import annotations

import threading
import time

import pytest

from smp.errors import PeerLostError, PeerStalledError, RemoteRankError
from smp.runtime import (
    EXITED,
    FAILED,
    LOST,
    STALLED,
    FailureRecord,
    Heartbeat,
    is_transport_error,
    local_process_gone,
)


class DictStore:
    """The Store protocol over a dict; ``broken`` makes every call fail like a vanished TCPStore."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.broken = False

    def _alive(self) -> None:
        if self.broken:
            raise ConnectionResetError("Connection reset by peer")

    def set(self, key: str, value: str) -> None:
        self._alive()
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        self._alive()
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        self._alive()
        return all(k in self.data for k in keys)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _pair(dead_after: float = 5.0) -> tuple[DictStore, Clock, Heartbeat, Heartbeat, list[tuple[int, str]]]:
    store, clock, lost = DictStore(), Clock(), []
    a = Heartbeat(store, 0, [0, 1], on_lost=lambda r, why: lost.append((r, why)), clock=clock, dead_after_s=dead_after)
    b = Heartbeat(store, 1, [0], on_lost=lambda r, why: lost.append((r, why)), clock=clock, dead_after_s=dead_after,
                  where="pid 7 on host h")
    return store, clock, a, b, lost


def test_a_peer_that_keeps_beating_is_alive_with_its_activity() -> None:
    store, clock, a, b, lost = _pair()
    assert a.peers == [1]  # never watches itself
    b.set_activity("gradient allreduce over DP")
    for _ in range(20):
        b.tick()
        a.tick()
        clock.now += 1.0
    state = a.peer(1)
    assert (state.status, state.activity, lost) == ("alive", "gradient allreduce over DP", [])
    assert state.silent_s == pytest.approx(1.0)
    b.set_activity(None)
    b.tick()
    a.tick()
    assert a.peer(1).activity == ""


@pytest.mark.parametrize("silent", [4.9, 5.1])
def test_a_peer_is_lost_exactly_when_silent_longer_than_dead_after(silent: float) -> None:
    store, clock, a, b, lost = _pair(dead_after=5.0)
    store.set("hb/1/where", "pid 7 on host h")
    b.tick()
    a.tick()
    clock.now += silent
    a.tick()
    if silent < 5.0:
        assert lost == [] and a.peer(1).status == "alive"
    else:
        assert lost == [(1, "its heartbeat stopped 5.1 s ago")]
        assert a.peer(1).status == "lost" and a.lost() == {1: "its heartbeat stopped 5.1 s ago"}
        assert a.where_of(1) == "pid 7 on host h"
        clock.now += 10
        a.tick()
        assert len(lost) == 1  # reported once


def test_a_peer_that_exited_is_never_lost() -> None:
    store, clock, a, b, lost = _pair()
    b.tick()
    a.tick()
    b.stop()  # a normal exit marks the key
    assert store.data["hb/1"].decode().startswith(EXITED)
    clock.now += 60
    a.tick()
    state = a.peer(1)
    assert (state.status, lost) == ("exited", [])
    assert state.exited_s == 0.0
    clock.now += 3
    assert a.peer(1).exited_s == pytest.approx(3.0)


def test_a_peer_that_never_beats_is_lost_after_three_times_dead_after() -> None:
    store, clock, a, _, lost = _pair(dead_after=5.0)
    clock.now += 14.0
    a.tick()
    assert lost == [] and a.peer(1).status == "unknown"
    clock.now += 2.0
    a.tick()
    assert [r for r, _ in lost] == [1] and "never sent a heartbeat" in lost[0][1]


def test_the_thread_beats_stops_and_marks_the_exit_and_a_dead_store_is_reported() -> None:
    store, gone = DictStore(), []
    hb = Heartbeat(store, 0, [1], on_lost=lambda r, w: None, on_store_lost=gone.append, interval_s=0.01)
    hb.start()
    time.sleep(0.2)
    assert hb.running and int(store.data["hb/0"].decode().split("\t")[0]) > 3
    hb.stop()
    assert not hb.running and store.data["hb/0"].decode() == f"{EXITED}\t"
    assert not any(t.name.startswith("smp-heartbeat") for t in threading.enumerate())

    hb = Heartbeat(store, 0, [1], on_lost=lambda r, w: None, on_store_lost=gone.append, interval_s=0.01)
    hb.start()
    store.broken = True
    for _ in range(200):
        if gone:
            break
        time.sleep(0.01)
    assert gone == ["ConnectionResetError: Connection reset by peer"] and hb.store_error == gone[0]
    hb.stop()  # no exit mark on a dead store, and no hang
    assert not hb.running


@pytest.mark.parametrize("raw, rank, kind, reporter", [
    ("3 lost 1\nrank 3 is gone", 3, LOST, 1),
    ("1 stalled 0\nrank 1 did not answer", 1, STALLED, 0),
    ("2 failed 2\nTraceback", 2, FAILED, 2),
    ("2\nTraceback", 2, FAILED, 2),  # the format before kinds existed
    ("garbage", -1, FAILED, -1),
])
def test_failure_records_round_trip(raw: str, rank: int, kind: str, reporter: int) -> None:
    rec = FailureRecord.decode(raw)
    assert (rec.rank, rec.kind, rec.reporter) == (rank, kind, reporter)
    if raw.split("\n")[0].count(" ") == 2:
        assert rec.encode() == raw


def test_each_rank_raises_the_error_naming_the_rank_at_fault() -> None:
    lost = FailureRecord(3, LOST, 1, "rank 3 is gone")
    for me in (0, 1, 2, 3):
        e = lost.error_for(me)
        assert isinstance(e, PeerLostError) and e.rank == 3 and "rank 3 is gone" in str(e)
    assert "reported by rank 1" in str(lost.error_for(0)) and "reported by" not in str(lost.error_for(1))
    stall = FailureRecord(1, STALLED, 0, "rank 1 did not answer")
    mine = stall.error_for(1)
    assert isinstance(mine, PeerStalledError) and isinstance(mine, TimeoutError) and mine.rank == 1
    assert "rank 0 reported this rank (1)" in str(mine)
    other = stall.error_for(2)
    assert isinstance(other, PeerStalledError) and other.rank == 1
    failed = FailureRecord(2, FAILED, 2, "Traceback: ValueError")
    assert failed.error_for(2) is None  # its own failure: it raises the original itself
    e = failed.error_for(0)
    assert type(e) is RemoteRankError and e.rank == 2 and str(e) == "rank 2 failed:\nTraceback: ValueError"


def test_transport_errors_are_told_apart_from_user_errors() -> None:
    assert is_transport_error("[gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:1: Connection reset by peer")
    assert is_transport_error("Connection closed by peer [127.0.0.1]:2")
    assert not is_transport_error("mat1 and mat2 shapes cannot be multiplied")


def test_a_silent_peer_whose_process_is_gone_is_lost_after_two_missed_beats() -> None:
    store, clock, lost = DictStore(), Clock(), []
    gone = {"pid 7 on host h": True}
    a = Heartbeat(store, 0, [1], on_lost=lambda r, why: lost.append((r, why)), clock=clock, interval_s=0.5,
                  probe=lambda where: gone.get(where, False))
    store.set("hb/1/where", "pid 7 on host h")
    store.set("hb/1", "1\t")
    a.tick()
    clock.now += 0.9  # within two beats: no probe yet
    a.tick()
    assert lost == []
    clock.now += 0.2
    a.tick()
    assert lost == [(1, "its process no longer exists (heartbeat silent for 1.1 s)")]


def test_local_process_gone_reads_this_hosts_processes() -> None:
    import os
    import signal
    import socket
    import subprocess
    import sys

    host = socket.gethostname()
    assert not local_process_gone(f"pid {os.getpid()} on host {host}")
    assert not local_process_gone(f"pid 1 on host not-{host}")  # another host: cannot tell
    assert not local_process_gone("")
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    assert local_process_gone(f"pid {done.pid} on host {host}")
    zombie = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        os.kill(zombie.pid, signal.SIGKILL)
        time.sleep(0.5)  # not reaped yet: a zombie
        assert local_process_gone(f"pid {zombie.pid} on host {host}")
        assert not local_process_gone(f"pid {stopped.pid} on host {host}")  # frozen is not gone
    finally:
        stopped.kill()
        for p in (zombie, stopped):
            p.wait()
