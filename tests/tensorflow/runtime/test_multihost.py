"""smp.tensorflow across two hosts: pp2 x dp2 training and a failure, with no shared file system.

One machine stands in for two: Hydra's ``-launcher fork -hosts hosta:2,hostb:2`` starts one proxy
per host name, so MPICH numbers the ranks per host (``MPI_LOCALRANKID`` 0, 1 on each) and connects
the two hosts' ranks through its network module rather than shared memory, as on two machines.
Each rank points ``TMPDIR`` and ``SMP_JOB_DIR`` at a directory of its own, so nothing could work
through a shared directory: the failure protocol runs over MPI (runtime/store.py).
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from typing import Any

import pytest

from tests.helpers.mpi_spawn import run_mpi_ranks

pytestmark = pytest.mark.mpi

TWO_HOSTS = ("-launcher", "fork", "-hosts", "hosta:2,hostb:2")


def _private_tmp(root: str) -> str:
    """A temporary directory of this rank's own, as TMPDIR and SMP_JOB_DIR (before smp.init)."""
    from mpi4py import MPI

    mine = os.path.join(root, f"rank{MPI.COMM_WORLD.Get_rank()}")
    os.makedirs(mine, exist_ok=True)
    os.environ["TMPDIR"] = os.environ["SMP_JOB_DIR"] = mine
    tempfile.tempdir = None  # re-read TMPDIR
    return mine


def two_host_training(root: str) -> dict[str, Any]:
    import smp.tensorflow as smp

    from ..model import cases_v1

    mine = _private_tmp(root)
    smp.init(cases_v1.config(2, ddp=True))
    out = cases_v1._train(smp, None, cases_v1.SAVE_AFTER)
    out["local"] = (smp.local_rank(), smp.local_size())
    out["smp_in_tmp"] = [name for name in os.listdir(mine) if name.startswith("smp")]  # TF's autograph writes here
    return out


def test_pp2_dp2_across_two_hosts_matches_one_process(tmp_path: Any) -> None:
    from ..model.test_v1_script import _check_replicas

    got = run_mpi_ranks(two_host_training, 4, args=(str(tmp_path),), timeout=300, mpiexec_args=TWO_HOSTS)
    assert [g["local"] for g in got] == [(0, 2), (1, 2), (0, 2), (1, 2)]  # per host, not per job
    # pp2 x dp2, cluster placement: each pipeline on one host, the DP allreduce between the hosts.
    assert [(g["pp_rank"], g["dp_rank"]) for g in got] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    _check_replicas(got, got[0]["ref"], "ddp")
    assert all(g["smp_in_tmp"] == [] for g in got)  # the job's store is no directory


def failing_on_host_b(root: str, mode: str) -> None:
    """pp2 x dp2 training; rank 3 (pp_rank 1 of the second replica, on hostb) raises or freezes between steps."""
    from ..model.test_failure import train_then_fail

    _private_tmp(root)
    train_then_fail(root, faulty=3, mode=mode, ddp=True)


@pytest.mark.parametrize("mode", ["raise", "freeze"])
def test_a_failure_on_one_host_is_named_on_every_rank_without_a_shared_directory(tmp_path: Any, mode: str) -> None:
    env = {"SMP_PEER_DEAD_AFTER_S": "2", "SMP_EXIT_GRACE_S": "2"} if mode == "freeze" else None
    run = run_mpi_ranks(failing_on_host_b, 4, args=(str(tmp_path), mode), timeout=120, expect_failure=True,
                        mpiexec_args=TWO_HOSTS, env=env)
    took = time.time() - float((tmp_path / "fault").read_text())
    error = "RemoteRankError" if mode == "raise" else "PeerLostError"
    # Rank 3 names itself with its host; every survivor on either host names rank 3 (with its pid and host).
    named = re.compile(rf"{error}: rank 3 \(pp_rank 1, rdp_rank 1; pid \d+ on host [^)]+\) (failed|is gone)")
    for rank, outcome in enumerate(run.outcomes[:3]):
        if outcome.status == "missing":  # ended by the abort before it wrote its result: its log says why
            continue
        assert outcome.status == "error" and named.search(outcome.traceback), (rank, outcome.traceback)
    reported = [o for o in run.outcomes[:3] if o.status == "error"]
    assert reported, run.tail()
    assert len(re.findall(r"\[smp rank [012]\] ERROR stopping: rank 3 failed", run.output)) >= len(reported)
    if mode == "raise":
        assert "ValueError: rank 3 fails between steps on purpose" in run.outcomes[3].traceback
        assert all(o.status == "error" for o in run.outcomes), run.tail()
    assert not run.killed and run.returncode != 0, (run.returncode, run.tail())
    assert took < 10, f"the job ended {took:.1f} s after rank 3's fault"
    print(f"{mode} on rank 3 (hostb): every rank stopped {took:.1f} s later")
