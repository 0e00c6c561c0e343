"""smp.torch init, rank API, groups and object communication on real gloo process groups."""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.helpers.spawn import RankFailure, run_ranks
from tests.torch import zoo


def test_single_process_init_and_rank_api() -> None:
    import smp.torch as smp

    assert not smp.is_initialized()
    assert smp.pp_size() == 1 and smp.dp_size() == 1  # sizes are 1 before init (SMP v1)
    with pytest.raises(smp.exceptions.NotInitializedError):
        smp.rank()
    smp.init({"microbatches": 2})
    assert (smp.rank(), smp.size(), smp.pp_rank(), smp.tp_rank(), smp.dp_rank(), smp.mp_rank()) == (0, 1, 0, 0, 0, 0)
    assert smp.num_microbatches() == 2 and smp.state.cfg.microbatches == 2
    assert smp.get_dp_group() == [0] and smp.get_mp_group() == [0]
    assert smp.allgather("x", smp.WORLD) == ["x"]
    smp.barrier()
    smp.init({"microbatches": 2})  # idempotent
    with pytest.raises(smp.exceptions.DDPNotEnabledError, match="ddp: True"):
        smp.get_dp_process_group()
    assert smp.get_mp_process_group() is not None
    with pytest.raises(smp.exceptions.InvalidCommGroupError):
        smp.barrier(3)  # type: ignore[arg-type]


def test_config_error_before_any_process_group() -> None:
    import smp.torch as smp
    import torch.distributed as dist

    with pytest.raises(ValueError, match="microbatches"):
        smp.init({"microbatches": 0})
    assert not dist.is_initialized()


def _layout(config: dict) -> dict:
    import smp.torch as smp

    smp.init(config)
    return {
        "ranks": (smp.rank(), smp.pp_rank(), smp.tp_rank(), smp.rdp_rank(), smp.dp_rank(), smp.mp_rank()),
        "sizes": (smp.size(), smp.pp_size(), smp.tp_size(), smp.rdp_size(), smp.dp_size(), smp.mp_size()),
        "groups": (smp.get_pp_group(), smp.get_tp_group(), smp.get_rdp_group(), smp.get_dp_group(),
                   smp.get_mp_group()),
        "dp_allgather": smp.allgather(smp.rank(), smp.DP_GROUP),
        "tp_allgather": smp.allgather(smp.rank(), smp.TP_GROUP),
        "pg_sizes": [pg.size() for pg in (smp.get_pp_process_group(), smp.get_tp_process_group(),
                                          smp.get_rdp_process_group(), smp.get_dp_process_group(),
                                          smp.get_mp_process_group())],
    }


def test_four_ranks_pp2_tp2_groups_match_the_rank_map() -> None:
    from smp.topology import GroupKind, RankMap

    results = run_ranks(_layout, 4, args=({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2,
                                           "ddp": True, "placement_strategy": "spread"},))
    rm = RankMap(2, 2, 1, "spread")
    for r, res in enumerate(results):
        c = rm.coord(r)
        assert res["ranks"] == (r, c.pp_rank, c.tp_rank, c.rdp_rank, c.dp_rank, c.mp_rank)
        assert res["sizes"] == (4, 2, 2, 1, 2, 4)
        want = tuple(rm.group(k, r) for k in (GroupKind.PP, GroupKind.TP, GroupKind.RDP, GroupKind.DP, GroupKind.MP))
        assert res["groups"] == want
        assert res["dp_allgather"] == rm.group(GroupKind.DP, r)  # element i from the i-th member
        assert res["tp_allgather"] == rm.group(GroupKind.TP, r)
        assert res["pg_sizes"] == [2, 2, 1, 2, 4]


def _p2p() -> list:
    import smp.torch as smp
    import torch

    smp.init({"pipeline_parallel_degree": 2, "ddp": True})
    out = []
    if smp.pp_rank() == 0:
        smp.send({"t": torch.arange(3), "s": "hi"}, 1, smp.RankType.PP_RANK)
        if smp.rank() == 0:
            smp.broadcast([smp.rank(), "all"], smp.WORLD)
    else:
        got = smp.recv_from(0, smp.RankType.PP_RANK)
        out.append((got["t"].tolist(), got["s"]))
    if smp.rank() != 0:
        out.append(smp.recv_from(0, smp.RankType.WORLD_RANK))
    gathered = smp.gather(smp.rank() * 10, smp.WORLD, rank=0)
    out.append(gathered)
    big = smp.allgather(torch.full((1000,), float(smp.rank())), smp.WORLD)
    out.append([float(t.sum()) for t in big])
    for barrier in (smp.pp_barrier, smp.dp_barrier, smp.mp_barrier, smp.tp_barrier, smp.rdp_barrier):
        barrier()
    return out


def test_object_primitives_across_four_ranks() -> None:
    res = run_ranks(_p2p, 4, timeout=60)
    # cluster placement with pp=2: pipelines {0,1} and {2,3}.
    assert res[0] == [[0, 10, 20, 30], [0.0, 1000.0, 2000.0, 3000.0]]
    assert res[1][:2] == [([0, 1, 2], "hi"), [0, "all"]]
    assert res[1][2] is None and res[3][2] is None
    assert res[3][0] == ([0, 1, 2], "hi")


def _fail_on_rank_1() -> str:
    import smp.torch as smp

    smp.init({"pipeline_parallel_degree": 2, "comm_timeout": 60.0})
    if smp.rank() == 1:
        raise ValueError("boom in user code on rank 1")
    start = time.monotonic()
    try:
        smp.barrier()
    except smp.exceptions.RemoteRankError as e:
        assert e.rank == 1 and "boom in user code" in str(e)
        return f"stopped after {time.monotonic() - start:.1f}s"
    return "barrier returned"


def test_failure_on_one_rank_stops_the_others_with_its_error() -> None:
    res = run_ranks(_fail_on_rank_1, 2, expect_failure=True, timeout=60)
    assert res[1][0] == "error" and "boom in user code on rank 1" in res[1][1]
    assert res[0][0] == "ok" and res[0][1].startswith("stopped after")
    assert float(res[0][1].split()[-1][:-1]) < 30  # far below the 60 s comm timeout


def _wait_for_nobody() -> None:
    import smp.torch as smp

    smp.init({"pipeline_parallel_degree": 2, "comm_timeout": 2.0})
    if smp.rank() == 0:
        smp.recv_from(1, smp.RankType.PP_RANK)  # rank 1 never sends
    else:
        time.sleep(4)


def test_a_wait_times_out_with_a_message_naming_the_peer() -> None:
    # Rank 1 is alive (sleeping) but never sends: named as stalled, with the config key to raise.
    res = run_ranks(_wait_for_nobody, 2, expect_failure=True, timeout=60)
    assert res[0][0] == "error"
    assert "PeerStalledError: rank 1 (pp_rank 1, tp_rank 0, rdp_rank 0" in res[0][1]
    assert "did not answer rank 0 within 2 s" in res[0][1] and "comm_timeout" in res[0][1]
    assert "recv of an object header" in res[0][1]


def _barrier_while_rank_1_sleeps() -> None:
    import smp.torch as smp

    smp.init({"comm_timeout": 3.0, "ddp": True})  # pp=1: both ranks are one DP group
    if smp.rank() == 0:
        smp.barrier(smp.DP_GROUP)
    else:
        time.sleep(6)  # alive, beating, but never joins the barrier


def test_a_collective_timeout_names_the_member_that_is_not_in_it() -> None:
    res = run_ranks(_barrier_while_rank_1_sleeps, 2, expect_failure=True, timeout=60)
    assert res[0][0] == "error" and res[1][0] == "ok"
    assert "PeerStalledError: rank 1 (pp_rank 0, tp_rank 0, rdp_rank 1" in res[0][1]
    assert "barrier over DP" in res[0][1] and "running its own code, not waiting on a peer" in res[0][1]


def _heartbeat_threads() -> list[str]:
    import threading

    return sorted(t.name for t in threading.enumerate() if t.name.startswith("smp-heartbeat"))


def _heartbeat_lifetime() -> tuple[list[str], list[str]]:
    import smp.torch as smp

    smp.init({"pipeline_parallel_degree": 2, "comm_timeout": 30.0})
    during = _heartbeat_threads()
    smp.barrier()
    smp.reset()
    return during, _heartbeat_threads()


def test_the_heartbeat_thread_runs_from_init_to_reset_only() -> None:
    for rank, (during, after_reset) in enumerate(run_ranks(_heartbeat_lifetime, 2, timeout=90)):
        assert during == [f"smp-heartbeat-{rank}"] and after_reset == []


def _finish_early_on_rank_0() -> str:
    import smp.torch as smp
    from smp.torch.runtime import failure

    smp.init({"pipeline_parallel_degree": 2, "comm_timeout": 60.0})
    smp.barrier()
    if smp.rank() == 0:
        return "done"  # the process exits normally: its heartbeat key says so
    time.sleep(failure.DEAD_AFTER_S + 3 * failure.HEARTBEAT_S + 2.5)
    failure.check_peers(None, "work that needs no peer")  # an exited rank is not a lost one
    with pytest.raises(smp.exceptions.RemoteRankError) as left:
        failure.check_peers([0], "a barrier with rank 0")  # ... until a wait needs it
    assert "left the job" in str(left.value) and "a barrier with rank 0" in str(left.value)
    return "ok"


def test_a_rank_that_finished_normally_is_not_reported_dead() -> None:
    assert run_ranks(_finish_early_on_rank_0, 2, timeout=90) == ["done", "ok"]


def _train_mlp(config: dict) -> list[float]:
    import smp.torch as smp
    import torch

    from tests.torch import zoo

    smp.init({"microbatches": 2, "auto_partition": False, "default_partition": 0, "comm_timeout": 60.0,
              **config})
    net = zoo.build("mlp")
    model = smp.DistributedModel(net)
    net.place(smp.pp_size(), smp.set_partition)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return zoo.train_losses(model, opt, zoo.train_step("mlp"), zoo.batches("mlp", 2))


def _microbatch_threads() -> list[str]:
    import threading

    return sorted(t.name for t in threading.enumerate() if t.name.startswith("smp-mb"))


def _reinit_after_reset() -> tuple[list[list[float]], list[list[str]]]:
    import smp.torch as smp

    runs, left = [], []
    for config in ({"pipeline_parallel_degree": 2}, {"pipeline_parallel_degree": 1, "ddp": True},
                   {"pipeline_parallel_degree": 2}):
        runs.append(_train_mlp(config))
        smp.reset()
        left.append(_microbatch_threads())
        if os.environ["RANK"] == "0":
            time.sleep(2.0)  # rank 1 reaches the next init (and its heartbeat) first
    return runs, left


def test_init_after_reset_runs_again_in_the_same_processes() -> None:
    """Note [re-init]: a second init used to find the first one's store keys (same group names) and
    hang, and a peer read the reset's exit mark as "rank 0 left the job". And a reset ends the
    model's microbatch threads: each model used to leave one per microbatch behind."""
    ref, _ = zoo.reference("mlp", steps=2)
    for runs, left in run_ranks(_reinit_after_reset, 2, timeout=120):
        assert left == [[], [], []]
        assert runs[0] == runs[2]  # the same run again, in new process groups
        for losses in runs:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6)


def _raise_everywhere() -> None:
    raise RuntimeError("plain failure")


def test_harness_reraises_child_traceback() -> None:
    with pytest.raises(RankFailure, match="plain failure"):
        run_ranks(_raise_everywhere, 2)


def _hang() -> None:
    time.sleep(600)


def test_harness_times_out_instead_of_hanging(capfd: pytest.CaptureFixture[str]) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure, match="did not finish within 3 s"):
        run_ranks(_hang, 2, timeout=3)
    assert time.monotonic() - start < 30
    # Before they are killed, the stuck ranks print where they are.
    err = capfd.readouterr().err
    assert err.count("in _hang") == 2, err

