"""Each local rank on CPU cores of its own (frontends/torch/runtime/affinity.py)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from smp.torch.runtime.affinity import describe, host_slot, plan

from tests.helpers.spawn import run_ranks
from tests.torch.zoo import train_relu_loop

_CAN_BIND = hasattr(os, "sched_getaffinity") and os.path.isdir("/proc/self/task")
needs_two_cpus = pytest.mark.skipif(not _CAN_BIND or len(os.sched_getaffinity(0)) < 2,
                                    reason="binding 2 ranks needs Linux and 2 CPUs for this process")


def test_plan_gives_each_local_rank_an_equal_block() -> None:
    cpus = set(range(8))
    blocks = [plan(cpus, cpus, r, 4) for r in range(4)]
    assert blocks == [(0, 1), (2, 3), (4, 5), (6, 7)]
    # 7 CPUs over 3 ranks: 2 each, the last CPU left to nobody rather than one rank taking 3
    assert [plan(set(range(7)), set(range(7)), r, 3) for r in range(3)] == [(0, 1), (2, 3), (4, 5)]


def test_plan_keeps_smt_siblings_together() -> None:
    # Linux numbers the second hardware thread of core c as c + 4 on this 4-core, 8-thread host.
    def topology(cpu: int) -> tuple[int, int, int]:
        return 0, cpu % 4, cpu

    cpus = set(range(8))
    assert [plan(cpus, cpus, r, 2, topology) for r in range(2)] == [(0, 1, 4, 5), (2, 3, 6, 7)]


def test_plan_leaves_alone_what_it_cannot_bind_safely() -> None:
    cpus = set(range(4))
    assert plan({0, 1}, cpus, 0, 2) is None  # a launcher, numactl or taskset bound it already
    assert plan(set(range(2)), set(range(2)), 0, 3) is None  # more local ranks than CPUs
    assert plan(cpus, cpus, 0, 1) is None  # one rank on the host: nothing to share
    assert plan(cpus, cpus, 2, 2) is None  # a local rank outside the local size


def test_ranks_are_counted_per_host_name_not_per_launcher_agent() -> None:
    # Two agents on host a (ranks 0-1 and 2-3 both say local ranks 0, 1) and one on host b.
    hosts = ["a", "a", "a", "a", "b", "b"]
    assert [host_slot(hosts, r) for r in range(6)] == [(0, 4), (1, 4), (2, 4), (3, 4), (0, 2), (1, 2)]
    assert describe(hosts[:3] + ["b"], [(0,), (1,), (2, 3, 5), None]) == \
        "host a: rank 0 on CPUs 0, rank 1 on CPUs 1, rank 2 on CPUs 2-3,5; host b: rank 3 not bound"
    assert describe([f"h{r}" for r in range(6)], [(0,)] * 6, max_hosts=2).endswith("; 4 more host(s)")



def _masks() -> set[tuple[int, ...]]:
    """The CPU masks of this process's threads."""
    out = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            out.add(tuple(sorted(os.sched_getaffinity(int(tid)))))
        except OSError:
            continue
    return out


def _train(setup: str) -> dict[str, Any]:
    import smp.torch as smp

    if setup == "keep":
        os.environ["SMP_CPU_AFFINITY"] = "keep"
    elif setup == "taskset":
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    elif setup == "two agents":  # two torchrun agents of one rank each on this host: both say local rank 0 of 1
        os.environ.update({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    elif setup == "no thread count":  # a launcher that sets no OMP_NUM_THREADS (mpiexec, plain python)
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.pop(k, None)
    torch.set_num_threads(2)  # torch's own default on this 2-CPU host
    before = _masks()
    train_relu_loop(smp, 16, 1)
    during, threads = _masks(), torch.get_num_threads()  # the engine's threads exist by now
    smp.reset()
    return {"before": before, "during": during, "threads": threads, "after": _masks(),
            "threads_after": torch.get_num_threads()}


@needs_two_cpus
@pytest.mark.parametrize("setup", ["default", "two agents"])
def test_two_ranks_run_on_disjoint_cores_and_reset_gives_the_mask_back(setup: str) -> None:
    out = run_ranks(_train, 2, args=(setup,))
    everything = set(os.sched_getaffinity(0))
    for o in out:
        assert o["before"] == {tuple(sorted(everything))}
        assert len(o["during"]) == 1, f"threads of one rank on different masks: {o['during']}"
    mine = [set(next(iter(o["during"]))) for o in out]
    assert mine[0].isdisjoint(mine[1]) and mine[0] | mine[1] <= everything
    assert len(mine[0]) == len(mine[1]) == len(everything) // 2
    # torch's intra-op threads as the launch set them (the helper sets OMP_NUM_THREADS, as torchrun does):
    # their count decides how reductions split
    assert all(o["threads"] == 2 for o in out)
    assert all(o["after"] == o["before"] and o["threads_after"] == 2 for o in out)


@needs_two_cpus
def test_a_launch_without_a_thread_count_gets_one_thread_per_cpu_of_the_rank() -> None:
    # Two threads on a rank's one CPU take turns at every parallel region; smp.reset() gives the count back.
    for o in run_ranks(_train, 2, args=("no thread count",)):
        assert len(next(iter(o["during"]))) == 1 and o["threads"] == 1
        assert o["after"] == o["before"] and o["threads_after"] == 2


@needs_two_cpus
@pytest.mark.parametrize("setup", ["keep", "taskset"])
def test_binding_is_left_out_where_the_user_or_launcher_decides(setup: str) -> None:
    for o in run_ranks(_train, 2, args=(setup,)):
        assert o["during"] == o["before"], f"{setup}: smp changed the CPU mask"
        assert o["threads"] == 2
