"""Real launches: torchrun and mpiexec start examples/rank_map.py; env detection for OpenMPI/MPICH."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from smp.topology import GroupKind, RankMap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BIN = os.path.dirname(sys.executable)
LINE = re.compile(r"rank (\d+): pp=(\d+) tp=(\d+) rdp=(\d+) dp=(\d+) mp=(\d+) \| TP (\[.*?\]) PP (\[.*?\]) "
                  r"RDP (\[.*?\]) DP (\[.*?\]) MP (\[.*?\])")


def _run(cmd: list[str], timeout: float = 120) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _check(out: str, world: int, pp: int, tp: int, placement: str) -> None:
    rm = RankMap.from_world(world, pp, tp, placement)
    found = {}
    for m in LINE.finditer(out):
        found[int(m.group(1))] = m
    assert sorted(found) == list(range(world)), out
    for r, m in found.items():
        c = rm.coord(r)
        assert tuple(int(m.group(i)) for i in range(2, 7)) == (c.pp_rank, c.tp_rank, c.rdp_rank, c.dp_rank,
                                                                c.mp_rank)
        groups = [eval(m.group(i)) for i in range(7, 12)]  # noqa: S307 - our own printed lists
        assert groups == [rm.group(k, r) for k in (GroupKind.TP, GroupKind.PP, GroupKind.RDP, GroupKind.DP,
                                                     GroupKind.MP)]


def test_torchrun_four_ranks() -> None:
    out = _run([os.path.join(BIN, "torchrun"), "--nproc-per-node", "4", "examples/rank_map.py",
                "--placement", "spread"])
    _check(out, 4, 2, 2, "spread")


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["cluster", "spread", "DTP", "PDT", "PTD", "TDP"])
def test_torchrun_eight_ranks_worked_example_a(placement: str) -> None:
    out = _run([os.path.join(BIN, "torchrun"), "--nproc-per-node", "8", "examples/rank_map.py",
                "--placement", placement], timeout=180)
    _check(out, 8, 2, 2, placement)


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpiexec", path=BIN) is None, reason="mpiexec (mpich wheel) not installed")
def test_mpiexec_two_ranks() -> None:
    out = _run([os.path.join(BIN, "mpiexec"), "-n", "2", sys.executable, "examples/rank_map.py", "--pp", "2",
                "--tp", "1"])
    _check(out, 2, 2, 1, "cluster")
