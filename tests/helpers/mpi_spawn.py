"""Run a test function on N MPI ranks: ``mpiexec -n N``, a timeout, tracebacks re-raised.

Usage::

    from tests.helpers.mpi_spawn import run_mpi_ranks

    def body(x):                     # module level, so every rank can import it by name
        import smp.tensorflow as smp
        smp.init({"pipeline_parallel_degree": 2})
        return smp.pp_rank() * x

    assert run_mpi_ranks(body, 2, args=(10,)) == [0, 10]

The job is ``<venv>/bin/mpiexec -n N <python> -m tests.helpers._mpi_child <payload> <results>``,
run from the repository root in its own process group. ``fn`` travels by module and qualname,
``args``/``kwargs`` pickled into a temporary file. Each rank writes its return value (or its
formatted traceback) to its own result file; the values come back as a list by world rank.

The children get TF_CPP_MIN_LOG_LEVEL=3, TF_ENABLE_ONEDNN_OPTS=0 (bit-stable comparisons),
OMP_NUM_THREADS=1 and PYTHONUNBUFFERED=1 (then ``env``), and none of RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, SMP_RENDEZVOUS_FILE: the ranks learn
who they are from MPI alone, as under a real ``mpiexec`` launch.

How a run ends:

- the job exits by itself: normal case, and what smp's failure protocol does after an exception;
- every rank reported but the job lingers (a rank stuck in MPI_Finalize): killed after
  `LINGER_S`;
- a rank reported an error and another rank reported nothing within `SILENT_GRACE_S`: killed
  (the silent rank is named);
- past ``timeout``: killed; the ranks dump their Python stacks (faulthandler) 3 s before, so the
  output tail shows where each was stuck.

A kill takes the whole process group (mpiexec and every rank). Without ``expect_failure`` any
failing rank, missing rank or kill raises `RankFailure` with each traceback and the output tail.
With ``expect_failure=True`` an `MPIRun` comes back instead (a kill at ``timeout`` still raises).
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tests.helpers.spawn import RankFailure

__all__ = ["MPIRun", "RankFailure", "RankOutcome", "mpiexec_path", "run_mpi_ranks"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_TIMEOUT = 120.0
LINGER_S = 10.0
# Outlasts smp's failure detection (a published failure is seen within ~0.1 s, a lost heartbeat
# after SMP_PEER_DEAD_AFTER_S = 5 s), so the other ranks' own errors are still collected.
SILENT_GRACE_S = 15.0
TAIL_CHARS = 6000
DROPPED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "SMP_RENDEZVOUS_FILE")
CHILD_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": "0", "OMP_NUM_THREADS": "1",
             "PYTHONUNBUFFERED": "1"}


@dataclass
class RankOutcome:
    """What one rank reported.

    Attributes:
        status: "ok" (returned ``value``), "error" (raised: ``traceback`` holds the text) or
            "missing" (wrote nothing: killed, stalled, or ended by another rank's abort).
    """

    status: str
    value: Any = None
    traceback: str = ""


@dataclass
class MPIRun:
    """One ``expect_failure`` run: per-rank outcomes, how the job ended, its output.

    Attributes:
        outcomes: by world rank.
        returncode: mpiexec's exit status (negative: killed by that signal).
        killed: True when this helper killed the job (see the module docstring for when).
        wall_s: seconds from start to the job's end.
        output: mpiexec's stdout and stderr, combined.
    """

    outcomes: list[RankOutcome]
    returncode: int
    killed: bool
    wall_s: float
    output: str

    def tail(self, chars: int = TAIL_CHARS) -> str:
        return self.output[-chars:]


def mpiexec_path() -> str | None:
    """The venv's ``mpiexec`` (next to ``sys.executable``), or None when there is none."""
    path = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return path if os.access(path, os.X_OK) else None


def _read_results(result_dir: str, n: int) -> dict[int, RankOutcome]:
    got: dict[int, RankOutcome] = {}
    for rank in range(n):
        path = os.path.join(result_dir, f"rank{rank}.pkl")
        if os.path.exists(path):  # written to a temporary name and renamed: complete when present
            with open(path, "rb") as f:
                status, payload = pickle.load(f)
            got[rank] = RankOutcome("ok", value=payload) if status == "ok" else RankOutcome("error", traceback=payload)
    return got


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_mpi_ranks(fn: Callable[..., Any], n: int, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                  timeout: float = DEFAULT_TIMEOUT, env: Mapping[str, str] | None = None,
                  expect_failure: bool = False, mpiexec_args: Sequence[str] = ()) -> Any:
    """Run ``fn(*args, **kwargs)`` on ``n`` MPI ranks; return the values by world rank.

    Args:
        fn: a module-level function (found again in each rank by module and qualname).
        n: the number of ranks (``mpiexec -n``).
        timeout: seconds for the whole job, from start to exit.
        env: extra environment for the ranks (applied after the defaults above).
        expect_failure: return an `MPIRun` instead of raising when ranks fail (fault tests).
        mpiexec_args: extra mpiexec options before ``-n`` (e.g. Hydra's ``-disable-auto-cleanup``,
            which keeps the other ranks running when one is killed).

    Raises:
        RankFailure: a rank raised or reported nothing, or the job passed ``timeout``.
    """
    mpiexec = mpiexec_path()
    if mpiexec is None:
        import pytest

        pytest.skip(f"mpiexec not found next to {sys.executable} (install mpich: requirements/dev.txt)")
    qualname = getattr(fn, "__qualname__", "")
    if "<" in qualname or getattr(fn, "__module__", None) in (None, "__main__"):
        raise ValueError(f"run_mpi_ranks needs a module-level function importable by name, got {fn!r}")
    with tempfile.TemporaryDirectory(prefix="smp-mpi-test-") as tmp:
        payload = os.path.join(tmp, "payload.pkl")
        result_dir = os.path.join(tmp, "results")
        os.mkdir(result_dir)
        with open(payload, "wb") as f:
            pickle.dump({"module": fn.__module__, "qualname": qualname, "args": tuple(args),
                         "kwargs": dict(kwargs or {}), "timeout": float(timeout)}, f)
        child_env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
        child_env.update(CHILD_ENV)
        child_env["SMP_LOG_LEVEL"] = os.environ.get("SMP_LOG_LEVEL", "WARNING")
        child_env.update(env or {})
        out_path = os.path.join(tmp, "output.txt")
        cmd = [mpiexec, *mpiexec_args, "-n", str(n), sys.executable, "-m", "tests.helpers._mpi_child", payload, result_dir]
        start = time.monotonic()
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        killed_why = ""
        first_error: float | None = None
        all_reported: float | None = None
        while proc.poll() is None:
            now = time.monotonic()
            got = _read_results(result_dir, n)
            if len(got) == n:
                all_reported = all_reported or now
            if first_error is None and any(o.status == "error" for o in got.values()):
                first_error = now
            if now - start > timeout:
                killed_why = f"did not finish within {timeout:g} s"
            elif all_reported is not None and now - all_reported > LINGER_S:
                killed_why = f"every rank reported but the job did not exit within {LINGER_S:g} s"
            elif first_error is not None and len(got) < n and now - first_error > SILENT_GRACE_S:
                killed_why = f"a rank raised and the others stayed silent for {SILENT_GRACE_S:g} s"
            if killed_why:
                _kill_group(proc)
                break
            time.sleep(0.05)
        wall = time.monotonic() - start
        got = _read_results(result_dir, n)
        with open(out_path, "rb") as f:
            output = f.read().decode("utf-8", "replace")
    outcomes = [got.get(r, RankOutcome("missing")) for r in range(n)]
    missing = [r for r, o in enumerate(outcomes) if o.status == "missing"]
    errors = {r: o.traceback for r, o in enumerate(outcomes) if o.status == "error"}
    timed_out = killed_why.startswith("did not finish")
    if expect_failure and not timed_out:
        return MPIRun(outcomes, proc.returncode, bool(killed_why), wall, output)
    if not errors and not missing and not killed_why and proc.returncode == 0:
        return [o.value for o in outcomes]
    detail = "".join(f"\n--- rank {r} raised:\n{tb}" for r, tb in sorted(errors.items()))
    why = [f"ranks {missing} reported nothing"] if missing else []
    why += [f"killed: {killed_why}"] if killed_why else [f"mpiexec exited with {proc.returncode}"]
    raise RankFailure(f"{n}-rank MPI run of {fn.__module__}.{qualname}: {'; '.join(why)} after {wall:.1f} s"
                      f"{detail}\n--- output tail:\n{output[-TAIL_CHARS:]}")
