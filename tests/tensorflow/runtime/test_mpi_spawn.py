"""tests/helpers/mpi_spawn.py itself: values by rank, a raising rank, a silent rank, the timeout (no TensorFlow)."""

from __future__ import annotations

import os
import time

import pytest

from tests.helpers.mpi_spawn import RankFailure, run_mpi_ranks

pytestmark = pytest.mark.mpi


def rank_and_env(x: int) -> tuple[int, int, int, str | None, str]:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    return comm.Get_rank(), comm.Get_size(), x, os.environ.get("RANK"), os.environ["TF_ENABLE_ONEDNN_OPTS"]


def rank1_raises() -> int:
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 1:
        raise KeyError("rank one broke")
    return 0


def rank1_sleeps() -> int:
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 1:
        time.sleep(600)
    return 0


def test_values_by_rank_and_clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "5")  # a torchrun-style variable in the parent never reaches the ranks
    got = run_mpi_ranks(rank_and_env, 2, args=(7,), timeout=60)
    assert got == [(0, 2, 7, None, "0"), (1, 2, 7, None, "0")]


def test_raising_rank_is_reported_with_its_traceback() -> None:
    with pytest.raises(RankFailure, match=r"(?s)rank 1 raised:.*KeyError: 'rank one broke'"):
        run_mpi_ranks(rank1_raises, 2, timeout=60)
    run = run_mpi_ranks(rank1_raises, 2, timeout=60, expect_failure=True)
    assert [o.status for o in run.outcomes] == ["ok", "error"]
    assert "rank1_raises" in run.outcomes[1].traceback and run.returncode != 0
    print(f"raising rank: rc {run.returncode}, killed {run.killed}, {run.wall_s:.1f} s")


def test_timeout_names_the_silent_rank_and_dumps_stacks() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"(?s)ranks \[1\] reported nothing.*did not finish within 8 s.*rank1_sleeps"):
        run_mpi_ranks(rank1_sleeps, 2, timeout=8)  # the stacks are dumped at 5 s: slow starts on a loaded box
    assert time.monotonic() - t0 < 14
