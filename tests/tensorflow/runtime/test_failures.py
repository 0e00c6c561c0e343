"""smp.tensorflow's failure protocol on real mpiexec jobs: a raising, a SIGKILLed, a frozen and a stalled rank.

The stalled rank's peer waits inside a ``tf.numpy_function`` of a ``tf.function`` (as the engine's
exchange ops do), where TF replaces the smp error by its own ``UnknownError``.

Each test measures seconds from the fault (a timestamp the faulty rank writes just before it) to
the end of the whole job, and checks what every rank reported.

A SIGKILLed rank ends an MPICH (Hydra) job at once, whatever smp does: Hydra kills the other
ranks (measured: ~0.2 s; ``-disable-auto-cleanup`` does not keep them alive, and MPICH's
``MPIR_CVAR_ENABLE_FT`` asserts inside MPI). So the heartbeat's "this peer is gone" is checked
with a frozen rank (SIGSTOP): alive as a process, silent as a peer.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests.helpers.mpi_spawn import run_mpi_ranks

pytest.importorskip("mpi4py")
pytest.importorskip("tensorflow")
pytestmark = pytest.mark.mpi


def _fault_at(stamp_dir: str) -> None:
    with open(os.path.join(stamp_dir, "fault"), "w") as f:
        f.write(repr(time.time()))


def _seconds_since_fault(stamp_dir: str) -> float:
    with open(os.path.join(stamp_dir, "fault")) as f:
        return time.time() - float(f.read())


def faulty_body(mode: str, stamp_dir: str, config: dict[str, object]) -> str:
    """Rank 1 faults (``mode``) after init and a barrier; rank 0 waits for an object from it."""
    import smp.tensorflow as smp
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()  # both imports done: the short comm_timeouts below time the fault, not the imports
    smp.init(config)
    smp.barrier()
    if smp.rank() == 1:
        time.sleep(0.3)  # rank 0 is waiting by now
        _fault_at(stamp_dir)
        if mode == "raise":
            raise ValueError("rank one fails on purpose")
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)
        if mode == "stall":
            time.sleep(600)
    if mode == "stall":  # rank 0 waits inside a TF op, as the engine's exchange ops do
        import numpy as np
        import tensorflow as tf
        from smp.tensorflow.runtime.init import runtime

        transport = runtime().transport
        step = tf.function(lambda: tf.numpy_function(
            lambda: transport.recv((4,), np.float32, 1, 9, "activation 0"), [], tf.float32, stateful=True))
        return str(step())
    return str(smp.recv_from(1, smp.RankType.WORLD_RANK))


def test_exception_on_a_follower_ends_every_rank_naming_it(tmp_path: pytest.TempPathFactory) -> None:
    run = run_mpi_ranks(faulty_body, 2, args=("raise", str(tmp_path), {"pipeline_parallel_degree": 2}),
                        timeout=90, expect_failure=True)
    took = _seconds_since_fault(str(tmp_path))
    rank0, rank1 = run.outcomes
    assert rank1.status == "error" and "ValueError: rank one fails on purpose" in rank1.traceback
    assert rank0.status == "error" and re.search(r"RemoteRankError: rank 1 \(pp_rank 1, rdp_rank 0; pid \d+ on host .+\) failed:", rank0.traceback), rank0.traceback
    assert "ValueError: rank one fails on purpose" in rank0.traceback  # with rank 1's traceback
    assert "[smp rank 0] ERROR stopping: rank 1 failed (RemoteRankError)" in run.output, run.tail()
    assert not run.killed and run.returncode == 1, (run.returncode, run.tail())
    assert took < 10, f"the job ended {took:.1f} s after rank 1 raised"
    print(f"exception on rank 1: job ended {took:.2f} s later, rc {run.returncode}")


def test_sigkilled_rank_ends_the_job_at_once(tmp_path: pytest.TempPathFactory) -> None:
    run = run_mpi_ranks(faulty_body, 2, args=("kill", str(tmp_path), {"pipeline_parallel_degree": 2}),
                        timeout=90, expect_failure=True)
    took = _seconds_since_fault(str(tmp_path))
    assert [o.status for o in run.outcomes] == ["missing", "missing"]  # Hydra killed rank 0 too
    assert "Killed (signal 9)" in run.output and run.returncode == 9 and not run.killed, (run.returncode, run.tail())
    assert took < 5, f"the job ended {took:.1f} s after rank 1 was killed"
    print(f"SIGKILL of rank 1: job ended {took:.2f} s later, rc {run.returncode}")


def test_frozen_rank_is_named_by_the_heartbeat(tmp_path: pytest.TempPathFactory) -> None:
    # comm_timeout 60 s: the heartbeat (dead after 2 s here), not the timeout, must name rank 1.
    run = run_mpi_ranks(faulty_body, 2, args=("freeze", str(tmp_path), {"pipeline_parallel_degree": 2,
                                                                         "comm_timeout": 60}),
                        timeout=90, expect_failure=True, env={"SMP_PEER_DEAD_AFTER_S": "2", "SMP_EXIT_GRACE_S": "1"})
    took = _seconds_since_fault(str(tmp_path))
    rank0, rank1 = run.outcomes
    assert rank1.status == "missing"
    assert rank0.status == "error" and "PeerLostError: rank 1 (pp_rank 1, rdp_rank 0; pid" in rank0.traceback, \
        rank0.traceback
    assert "is gone: its heartbeat stopped" in rank0.traceback
    assert "ending the job with MPI_Abort: rank(s) [1] still running" in run.output, run.tail()
    assert not run.killed and run.returncode != 0, (run.returncode, run.tail())
    assert took < 10, f"the job ended {took:.1f} s after rank 1 froze"
    print(f"SIGSTOP of rank 1: job ended {took:.2f} s later, rc {run.returncode}")


def test_stalled_rank_is_named_at_the_comm_timeout_and_the_job_ends(tmp_path: pytest.TempPathFactory) -> None:
    run = run_mpi_ranks(faulty_body, 2, args=("stall", str(tmp_path), {"pipeline_parallel_degree": 2,
                                                                        "comm_timeout": 2}),
                        timeout=90, expect_failure=True, env={"SMP_EXIT_GRACE_S": "2"})
    took = _seconds_since_fault(str(tmp_path))
    rank0, rank1 = run.outcomes
    assert rank1.status == "missing"  # asleep when rank 0's abort ended the job
    # TF turned the PeerStalledError raised inside its op into an UnknownError; the exit guard found it behind
    assert rank0.status == "error" and "UnknownError" in rank0.traceback, rank0.traceback
    assert "PeerStalledError: rank 1 (pp_rank 1, rdp_rank 0; pid" in rank0.traceback
    assert "did not answer rank 0 within 2 s" in rank0.traceback and "running its own code" in rank0.traceback
    assert "[smp rank 0] ERROR stopping: rank 1 failed (PeerStalledError) (it surfaced as " \
           "tensorflow.python.framework.errors_impl.UnknownError from a TensorFlow op)" in run.output, run.tail()
    assert "smp.errors.PeerStalledError: rank 1 (pp_rank 1" in run.output  # the core's hook printed the original
    assert "ending the job with MPI_Abort: rank(s) [1] still running" in run.output, run.tail()
    assert not run.killed and run.returncode != 0, (run.returncode, run.tail())
    # comm_timeout 2 s + exit grace 2 s, from the moment rank 1 stopped answering
    assert 3 < took < 10, f"the job ended {took:.1f} s after rank 1 stalled"
    print(f"stall of rank 1: job ended {took:.2f} s later, rc {run.returncode}")
