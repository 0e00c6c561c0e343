"""The threads that run an engine's microbatch tasks: one per microbatch index, kept across steps.

Threads are kept across steps on purpose: a fresh thread pays per-thread warm-up in the math
libraries (measured: a GEMM-heavy forward ~20 % slower on a new thread than on a warm one). They
end with their engine: `smp.reset` stops every pool (`close_all`), and an engine that is collected
without one stops its own (engine.py), so a script that builds model after model in one process
(``init`` ... ``reset`` in a loop, a notebook) does not keep a thread per microbatch per model.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable

__all__ = ["Workers", "close_all"]

_LIVE: weakref.WeakSet[Workers] = weakref.WeakSet()


class _Worker:
    """One thread running the jobs it is given, in order, until it gets None."""

    def __init__(self, name: str) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            job()
            del job  # an idle thread keeps nothing of the last task alive


class Workers:
    """One engine's threads, by microbatch index."""

    def __init__(self) -> None:
        self._by_mb: dict[int, _Worker] = {}
        _LIVE.add(self)

    def submit(self, mb: int, job: Callable[[], None]) -> None:
        """Run ``job`` on microbatch ``mb``'s thread (started on first use). Not thread-safe: the
        engine calls it under its lock."""
        worker = self._by_mb.get(mb)
        if worker is None:
            worker = self._by_mb[mb] = _Worker(f"smp-mb{mb}")
        worker.jobs.put(job)

    def close(self, timeout_s: float = 0.5) -> None:
        """Stop every thread once it finishes its job; wait up to ``timeout_s`` in all for them (idle
        ones end at once; one still in a task after a failure is not waited for longer)."""
        workers, self._by_mb = list(self._by_mb.values()), {}
        for w in workers:
            w.jobs.put(None)
        deadline = time.monotonic() + timeout_s
        for w in workers:
            if w.thread is not threading.current_thread():
                w.thread.join(max(0.0, deadline - time.monotonic()))


def close_all() -> None:
    """Stop the threads of every engine in this process (``smp.reset``)."""
    for pool in list(_LIVE):
        pool.close()
