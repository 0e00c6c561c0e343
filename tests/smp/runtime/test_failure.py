"""The failure channel over a dict store and the wait loop over fake work handles, without processes."""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from smp.errors import CommTimeoutError, PeerLostError, PeerStalledError, RemoteRankError
from smp.runtime import failure
from smp.runtime.failure_record import FAILED, LOST, STALLED, FailureRecord


class DictStore:
    """The `FailureStore` protocol over a dict (what torch's TCPStore does for the channel)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.broken: Exception | None = None

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        if self.broken is not None:
            raise self.broken
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        if self.broken is not None:
            raise self.broken
        return all(k in self.data for k in keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        current = self.data.get(key, b"").decode()
        if current == expected:
            self.data[key] = desired.encode()
        return self.data.get(key, b"")


class Done:
    def __init__(self, value: Any = "result") -> None:
        self.value = value

    def is_completed(self) -> bool:
        return True

    def wait(self) -> Any:
        return self.value


class Never:
    def is_completed(self) -> bool:
        return False

    def wait(self) -> Any:
        time.sleep(30)


class Raising:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def is_completed(self) -> bool:
        return True

    def wait(self) -> Any:
        raise self.error


@pytest.fixture
def store() -> Iterator[DictStore]:
    s = DictStore()
    ch = failure.FailureChannel(s, rank=1, timeout_s=5.0)
    failure.set_channel(ch)
    try:
        yield s
    finally:
        failure.set_channel(None)


def _record(store: DictStore) -> FailureRecord:
    return FailureRecord.decode(store.data["failure"].decode())


def test_the_first_published_failure_wins_and_reaches_the_other_ranks(store: DictStore) -> None:
    ch = failure.channel()
    assert ch is not None
    ch.publish("Traceback: boom")
    ch.publish("Traceback: second")
    where = f"pid {os.getpid()} on host {socket.gethostname()}"
    assert _record(store) == FailureRecord(1, FAILED, 1, "Traceback: boom", f"rank 1 ({where})")
    ch.check()  # its own failure: this rank raises that itself
    other = failure.FailureChannel(store, rank=0, timeout_s=5.0)
    with pytest.raises(RemoteRankError, match=re.escape(f"rank 1 ({where}) failed:\nTraceback: boom")):
        other.check()


def test_a_store_that_is_gone_means_rank_0_is_gone(store: DictStore) -> None:
    store.broken = ConnectionError("Connection reset by peer")
    with pytest.raises(PeerLostError, match="rank 0 is most likely gone: rank 1 lost the job's key-value store"):
        failure.check_peers(None, "a wait")


def test_publish_failure_records_a_stall_in_the_silent_peers_name_and_never_republishes_a_peers(
        store: DictStore) -> None:
    failure.publish_failure(RemoteRankError(3, "its traceback"))
    assert "failure" not in store.data
    failure.publish_failure(PeerStalledError(2, "rank 2 did not answer"))
    assert _record(store) == FailureRecord(2, STALLED, 1, "rank 2 did not answer")


def test_publish_failure_without_a_channel_or_an_exception_does_nothing() -> None:
    failure.set_channel(None)
    failure.publish_failure(ValueError("x"))
    failure.publish_failure()


def test_wait_returns_the_handles_result(store: DictStore) -> None:
    assert failure.wait(Done(7), "allgather", [0, 1]) == 7


def test_wait_times_out_naming_the_wait_and_the_limit(store: DictStore) -> None:
    start = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"rank 1: a barrier with rank\(s\) \[0\] did not complete within 0.2 s"):
        failure.wait(Never(), "a barrier", [0, 1], timeout_s=0.2)
    assert time.monotonic() - start < 2


def test_wait_stops_when_another_rank_publishes_its_failure(store: DictStore) -> None:
    def fail_later() -> None:
        time.sleep(0.2)
        failure.FailureChannel(store, rank=0, timeout_s=5.0).publish("Traceback: rank 0's error")

    threading.Thread(target=fail_later).start()
    with pytest.raises(RemoteRankError, match="rank 0's error") as caught:
        failure.wait(Never(), "recv", 0, timeout_s=10)
    assert caught.value.rank == 0


def test_a_p2p_wait_blocks_in_a_helper_thread_and_still_times_out(store: DictStore) -> None:
    assert failure.wait(Done(), "send", 0, p2p=True) is None
    with pytest.raises(CommTimeoutError, match="recv of an object"):
        failure.wait(Never(), "recv of an object", 0, timeout_s=0.2, p2p=True)


def test_a_handles_own_error_is_raised_as_is_when_it_is_no_transport_error(store: DictStore) -> None:
    with pytest.raises(RuntimeError, match="size mismatch"):
        failure.wait(Raising(RuntimeError("size mismatch")), "allreduce", [0, 1])
    with pytest.raises(ValueError, match="bad"):
        failure.wait(Raising(ValueError("bad")), "send", 0, p2p=True)


def test_a_dropped_connection_becomes_the_failure_another_rank_reported(store: DictStore) -> None:
    failure.FailureChannel(store, rank=0, timeout_s=5.0).publish_record(
        FailureRecord(0, LOST, 2, "rank 0 is gone"))
    dropped = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    with pytest.raises(PeerLostError, match="rank 0 is gone") as caught:
        failure.wait(Raising(dropped), "recv", 0)
    assert caught.value.__cause__ is dropped


def test_translate_keeps_errors_that_name_no_peer_failure(store: DictStore) -> None:
    error = KeyError("x")
    assert failure.translate(error, "a step") is error
    remote = RemoteRankError(0, "t")
    assert failure.translate(remote, "a step") is remote


def test_stalled_and_timeout_errors_without_a_channel_name_the_peer_and_the_limit() -> None:
    failure.set_channel(None)
    assert "rank 3 did not answer within 2 s" in str(failure.stalled_error(3, "the reply", 2.0))
    assert "this rank: a recv with rank(s) 3 did not complete within 2 s" in str(failure.timeout_error("a recv", 3, 2.0))
