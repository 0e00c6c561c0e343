"""Spawn N CPU ranks for a test: gloo, file rendezvous (no port races), a timeout, tracebacks re-raised.

Usage::

    from tests.helpers.spawn import run_ranks

    def body(x):                     # module level, so the spawned child can import it
        import smp.torch as smp
        smp.init({"pipeline_parallel_degree": 2})
        return smp.pp_rank() * x

    assert run_ranks(body, 2, args=(10,)) == [0, 10]

Each child gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and SMP_RENDEZVOUS_FILE, so
``smp.init`` rendezvouses through a fresh file. A child's exception is published to the other ranks
(they stop with RemoteRankError instead of hanging) and re-raised here with the child's traceback.
A child still running after ``timeout`` seconds fails the test with the ranks that did not finish;
before it is killed, the parent signals it (SIGUSR1) to print every thread's Python stack. The
signal, not ``faulthandler.dump_traceback_later``, so that a rank starts with its main thread alone,
as under torchrun: a watchdog thread would take a malloc arena of its own before ``smp.init``
(frontends/torch/runtime/heap.py).
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

DEFAULT_TIMEOUT = 120.0
SILENT_DEATH_GRACE_S = 15.0


class RankFailure(AssertionError):
    """A spawned rank raised, or the ranks did not finish in time."""


def _child(fn: Callable[..., Any], rank: int, world: int, env: Mapping[str, str], args: Sequence[Any],
           kwargs: Mapping[str, Any], results: Any) -> None:
    # A rank still running when the parent gives up prints where it is stuck (`_dump_stacks`).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world)})
    try:
        value = fn(*args, **kwargs)
        # Plain pickle: torch's queue pickler would share tensor storage through the child's file
        # descriptors, which vanish when the child exits.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        try:
            from smp.torch.runtime import failure

            failure.publish_failure(e)
        except Exception:  # noqa: BLE001 - smp may not even import
            pass
        results.put((rank, "error", "".join(traceback.format_exception(type(e), e, e.__traceback__))))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def _dump_stacks(procs: Sequence[Any]) -> None:
    """Have the ranks still running print their threads' stacks (faulthandler, to their stderr)."""
    for p in procs:
        if p.is_alive() and p.pid:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except OSError:
                continue
            time.sleep(0.5)  # one at a time, so the dumps do not interleave


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    expect_failure: bool = False,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` spawned ranks and return their results by rank.

    With ``expect_failure=True`` nothing is raised for failing ranks; the result list then holds, per
    rank, ``("ok", value)``, ``("error", traceback_text)`` or ``("died", exit_code)``; a timeout still
    raises.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="smp-test-") as tmp:
        child_env = {"SMP_RENDEZVOUS_FILE": os.path.join(tmp, "rendezvous"), "OMP_NUM_THREADS": "1",
                     "SMP_LOG_LEVEL": os.environ.get("SMP_LOG_LEVEL", "WARNING"), **(env or {})}
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, child_env, tuple(args), dict(kwargs or {}),
                                                   results), daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        got: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        silent_death: float | None = None
        while len(got) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, status, value = results.get(timeout=min(left, 0.5))
                got[rank] = (status, pickle.loads(value) if status == "ok" else value)
            except queue.Empty:
                # A rank that exited without reporting (killed, crashed in the interpreter) ends the run
                # after a grace period instead of the whole timeout. The grace outlasts smp's dead-peer
                # detection (a lost heartbeat: 5 s, SMP_PEER_DEAD_AFTER_S), so the survivors' own
                # errors are still collected.
                unreported = [p for r, p in enumerate(procs) if r not in got]
                if any(p.exitcode is not None for p in unreported):
                    silent_death = silent_death or time.monotonic()
                    # Every unreported rank has exited and the queue is drained: nothing more comes.
                    if all(p.exitcode is not None for p in unreported) or \
                            time.monotonic() - silent_death > SILENT_DEATH_GRACE_S:
                        break
        while len(got) < world_size:  # what an exiting rank wrote just before the loop stopped
            try:
                rank, status, value = results.get(timeout=0.2)
            except queue.Empty:
                break
            got[rank] = (status, pickle.loads(value) if status == "ok" else value)
        if len(got) < world_size and not silent_death:
            _dump_stacks([p for r, p in enumerate(procs) if r not in got])
        for p in procs:
            p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        killed = set()
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
                killed.add(r)
    missing = [r for r in range(world_size) if r not in got]
    errors = {r: v for r, (s, v) in got.items() if s == "error"}
    if expect_failure and missing and silent_death:
        # Expected failures include a rank that died (e.g. os._exit in a crash test).
        for r in missing:
            got[r] = ("died", procs[r].exitcode)
        missing = []
    if missing:
        detail = "".join(f"\n--- rank {r} raised:\n{tb}" for r, tb in sorted(errors.items()))
        codes = {r: procs[r].exitcode for r in missing}
        why = "died without reporting" if silent_death else f"did not finish within {timeout:g} s"
        raise RankFailure(f"ranks {missing} {why} (exit codes {codes}){detail}")
    if expect_failure:
        return [got[r] for r in range(world_size)]
    # A rank that reported and then crashed on its way out (an abort in a destructor, a thread left
    # joinable) fails the run too: users' processes would end the same way.
    crashed = {r: procs[r].exitcode for r, (s, _) in got.items() if s == "ok" and r not in killed
               and procs[r].exitcode not in (0, None)}
    if crashed and not errors:
        raise RankFailure(f"ranks {sorted(crashed)} returned, then exited with codes {crashed} (a crash at exit)")
    if errors:
        first = min(errors)
        others = "".join(f"\n--- rank {r} also raised:\n{errors[r]}" for r in sorted(errors) if r != first)
        raise RankFailure(f"rank {first} raised:\n{errors[first]}{others}")
    return [got[r][1] for r in range(world_size)]
