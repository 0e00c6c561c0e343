"""The baton: which microbatch runs next on a rank (plan order, SMP v1's dynamic rule), with threads."""

from __future__ import annotations

import threading
import time

import pytest

from smp.errors import CommTimeoutError
from smp.pipeline.baton import BACKWARD, FORWARD, Baton


def _run(baton: Baton, tasks: list[tuple[str, int, bool]]) -> None:
    """Start one thread per (kind, microbatch, new) request, all at once; each holds the baton briefly."""
    barrier = threading.Barrier(len(tasks))

    def task(kind: str, mb: int, new: bool) -> None:
        barrier.wait()
        baton.acquire(kind, mb, new=new)
        baton.release(finished=kind == BACKWARD)

    threads = [threading.Thread(target=task, args=t) for t in tasks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)


def test_plan_mode_follows_the_plan_whatever_order_the_tasks_arrive_in() -> None:
    plan = [(FORWARD, 1), (FORWARD, 0)]
    baton = Baton(plan, "interleaved", 2, timeout_s=10)
    _run(baton, [(FORWARD, 0, True), (FORWARD, 1, True)])
    assert baton.order == plan and not baton.dynamic


def test_an_action_the_plan_does_not_expect_falls_back_to_the_dynamic_rule_once() -> None:
    reasons: list[str] = []
    baton = Baton([(FORWARD, 0)], "interleaved", 2, timeout_s=10, on_fallback=reasons.append)
    baton.acquire(BACKWARD, 0)
    baton.release()
    assert baton.dynamic and reasons == ["microbatch 0 asked for B where the plan expects F"]


def test_dynamic_interleaved_admits_in_index_order_under_the_in_flight_cap() -> None:
    baton = Baton(None, "interleaved", 1, timeout_s=10)
    baton.acquire(FORWARD, 0, new=True)
    baton.release()
    # microbatch 1 may not start while 0 is in flight (cap 1); 0's backward runs first
    _run(baton, [(FORWARD, 1, True), (BACKWARD, 0, False)])
    assert baton.order == [(FORWARD, 0), (BACKWARD, 0), (FORWARD, 1)]


def test_a_wait_that_cannot_progress_times_out() -> None:
    baton = Baton([(FORWARD, 1), (FORWARD, 0)], "interleaved", 2, timeout_s=0.2)
    with pytest.raises(CommTimeoutError, match="microbatch 0 waited 0.2 s to run F"):
        baton.acquire(FORWARD, 0, new=True)


def test_in_plan_mode_a_release_wakes_only_the_thread_whose_action_is_next(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from smp.pipeline import baton as baton_module

    woken = []

    class Counting(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            got = super().wait(timeout)
            woken.append(got)
            return got

    monkeypatch.setattr(baton_module, "threading", types.SimpleNamespace(Condition=Counting, RLock=threading.RLock))
    n = 8
    plan = [(FORWARD, mb) for mb in reversed(range(n))]
    baton = Baton(plan, "interleaved", n, timeout_s=10)

    def task(mb: int) -> None:
        baton.acquire(FORWARD, mb, new=True)
        if mb == n - 1:  # the first holder lets go only once every other microbatch waits
            while len(baton.waiting) < n - 1:
                time.sleep(0.001)
        baton.release()

    threads = [threading.Thread(target=task, args=(mb,)) for mb in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert baton.order == plan
    # one wake-up per waiting thread; one condition shared by all woke 14 here (up to 7 + 6 + ... + 1)
    assert len(woken) <= n, len(woken)
