"""smp.tensorflow's runtime on real MPI ranks: init, the rank API, object primitives, the transport, reset.

One launch at 2 ranks (pp 2) and one at 4 (pp 2 x dp 2, horovod) each run every check inside one
rank function (TensorFlow's import costs ~5 s per rank). One-process checks (config errors, the
torchrun refusal) run in the test process.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from tests.helpers.mpi_spawn import run_mpi_ranks

pytest.importorskip("tensorflow")
pytest.importorskip("mpi4py")

# (config, same text as smp.torch's): the last two break framework-specific rules (TF's data
# parallelism key is horovod; TF has no tensor parallelism).
BAD_CONFIGS: list[tuple[dict[str, Any], bool]] = [
    ({"pipeline_parallel_degree": 3}, True),                      # not a divisor of the world
    ({"microbatchs": 2, "pipeline_parallel_degree": 0}, True),    # unknown key (with a suggestion), bad value
    ({"pipeline_parallel_degree": 1}, False),                     # 2 replicas need data parallelism (horovod)
    ({"pipeline_parallel_degree": 1, "tensor_parallel_degree": 2, "horovod": True}, False),
]


def _check_config_errors(world: int) -> dict[int, str]:
    """Each bad config raises the core's SMPConfigError text (torch's where no TF rule applies), before any
    communicator, store or hook exists. Returns the texts by index in BAD_CONFIGS (valid at this world: left out)."""
    import sys

    import smp.tensorflow as smp

    from smp.config import resolve
    from smp.errors import SMPConfigError

    texts = {}
    hook = sys.excepthook
    for i, (bad, same_as_torch) in enumerate(BAD_CONFIGS):
        try:
            resolve(bad, world_size=world, framework="tensorflow")
            continue  # valid at this world size (pp 1 on one process)
        except SMPConfigError as e:
            core = str(e)
        with pytest.raises(SMPConfigError) as got:
            smp.init(bad)
        assert str(got.value) == core
        if same_as_torch:
            with pytest.raises(SMPConfigError) as torch_text:
                resolve(bad, world_size=world, framework="torch")
            assert str(got.value) == str(torch_text.value)
        assert not smp.is_initialized() and sys.excepthook is hook
        texts[i] = core
    return texts


def _exchange_ring(smp: Any, kind: Any, rank_type: Any, members: list[int]) -> tuple[Any, ...]:
    """send/recv_from around the group (group rank 0 sends first, the others receive first)."""
    me = members.index(smp.rank())
    n = len(members)
    if n == 1:
        with pytest.raises(ValueError, match="to itself"):
            smp.send("x", 0, rank_type)
        with pytest.raises(ValueError, match="does not exist"):
            smp.send("x", 1, rank_type)
        return ()
    msg = {"from": smp.rank(), "kind": kind.name, "payload": list(range(me + 3))}
    nxt, prev = (me + 1) % n, (me - 1) % n
    if me == 0:
        smp.send(msg, nxt, rank_type)
        got = smp.recv_from(prev, rank_type)
    else:
        got = smp.recv_from(prev, rank_type)
        smp.send(msg, nxt, rank_type)
    assert got == {"from": members[prev], "kind": kind.name, "payload": list(range(prev + 3))}
    return (kind.name, got["from"])


def _transport_checks(smp: Any, rt: Any, peer: int) -> dict[str, Any]:
    """isend/recv/flush with ``peer`` for every dtype TF uses, a message past the eager limit, errors."""
    import ml_dtypes
    import tensorflow as tf

    t = rt.transport
    me = smp.rank()
    dtypes = [np.float32, np.float64, np.int32, np.int64, np.bool_, np.float16, ml_dtypes.bfloat16,
              tf.bfloat16.as_numpy_dtype, np.uint8, np.complex64]
    sent = {}
    for i, dt in enumerate(dtypes):
        arr = (np.arange(24).reshape(2, 3, 4) * (me + 1) % 7).astype(dt)
        sent[i] = arr
        t.isend(arr, peer, tag=100 + i, what=f"array {i}")
        arr[...] = 0  # the transport sent a copy
    big = np.full((512, 512), float(me), dtype=np.float32)  # 1 MiB, far past MPICH's eager limit
    t.isend(big, peer, tag=1, what="big")  # both ranks send first: a blocking send would deadlock here
    got_big = t.recv((512, 512), np.float32, peer, tag=1, what="big")
    assert np.array_equal(got_big, np.full((512, 512), float(peer), dtype=np.float32))
    for i, dt in enumerate(dtypes):
        got = t.recv((2, 3, 4), dt, peer, tag=100 + i, what=f"array {i}")
        want = (np.arange(24).reshape(2, 3, 4) * (peer + 1) % 7).astype(dt)
        assert got.dtype == np.dtype(dt) and np.array_equal(got, want), (dt, got, want)
    scalar = np.float32(3.5 + me)
    t.isend(np.asarray(scalar), peer, tag=2, what="scalar")
    assert t.recv((), np.float32, peer, tag=2, what="scalar") == np.float32(3.5 + peer)
    t.isend(np.zeros(5, np.float32), peer, tag=3, what="wrong size")
    with pytest.raises(ValueError, match="disagree on the tensor's shape or dtype"):
        t.recv((4,), np.float32, peer, tag=3, what="wrong size")
    t.flush("end of the transport checks")
    assert t.pending == 0
    with pytest.raises(ValueError, match="outside 0..") as bad_tag:
        t.isend(np.zeros(1), peer, tag=t.max_tag + 1, what="bad tag")
    with pytest.raises(ValueError, match="does not exist"):
        t.recv((1,), np.float32, smp.size(), tag=0, what="bad peer")
    return {"max_tag": t.max_tag, "bad_tag": str(bad_tag.value)}


def _allreduce_checks(smp: Any, rt: Any) -> dict[str, list[float]]:
    import ml_dtypes

    from smp.topology import GroupKind

    t = rt.transport
    out = {}
    for kind in (GroupKind.WORLD, GroupKind.PP, GroupKind.DP, GroupKind.RDP, GroupKind.MP):
        members = rt.group_ranks[kind]
        x = np.array([smp.rank(), 1.0, 2.5], dtype=np.float32)
        mean = t.allreduce_mean(x, kind)
        assert mean.dtype == np.float32
        np.testing.assert_allclose(mean, [np.mean(members), 1.0, 2.5], rtol=1e-7)
        s = t.allreduce_sum(np.array([smp.rank() + 1], dtype=np.int32), kind)
        assert s.dtype == np.int32 and int(s[0]) == sum(m + 1 for m in members)
        bf = t.allreduce_mean(np.array([smp.rank(), 0.5], dtype=ml_dtypes.bfloat16), kind)
        assert bf.dtype == ml_dtypes.bfloat16 and np.allclose(bf.astype(np.float32), [np.mean(members), 0.5])
        out[kind.name] = mean.tolist()
    with pytest.raises(TypeError, match="floating-point"):
        t.allreduce_mean(np.ones(2, np.int32), GroupKind.DP)
    return out


def runtime_body(config: dict[str, Any], again: dict[str, Any]) -> dict[str, Any]:
    """Every runtime check on this rank (see the module docstring); returns what the test compares."""
    import smp.tensorflow as smp
    from mpi4py import MPI
    from smp.tensorflow.runtime.init import runtime

    from smp.errors import InvalidCommGroupError, NotInitializedError
    from smp.runtime.ranks import group_kind
    from smp.topology import GroupKind, RankMap

    world = MPI.COMM_WORLD.Get_size()
    me = MPI.COMM_WORLD.Get_rank()
    with pytest.raises(NotInitializedError):
        smp.rank()
    assert smp.size() == 1 and smp.pp_size() == 1
    if me == 0:  # only rank 0: a config error must come before any communication, or this would hang
        assert sorted(_check_config_errors(world)) == [0, 1, 2, 3]
    smp.init(config)
    smp.init(config)  # a second call is a no-op
    rt = runtime()
    rm = RankMap.from_world(world, config["pipeline_parallel_degree"], 1, smp.state.cfg.placement_strategy)
    c = rm.coord(me)
    ranks = {"rank": smp.rank(), "size": smp.size(), "local_rank": smp.local_rank(), "local_size": smp.local_size(),
             "pp_rank": smp.pp_rank(), "pp_size": smp.pp_size(), "tp_rank": smp.tp_rank(), "tp_size": smp.tp_size(),
             "rdp_rank": smp.rdp_rank(), "rdp_size": smp.rdp_size(), "dp_rank": smp.dp_rank(),
             "dp_size": smp.dp_size(), "mp_rank": smp.mp_rank(), "mp_size": smp.mp_size()}
    assert ranks == {"rank": me, "size": world, "local_rank": me, "local_size": world, "pp_rank": c.pp_rank,
                     "pp_size": rm.pp_size, "tp_rank": c.tp_rank, "tp_size": 1, "rdp_rank": c.rdp_rank,
                     "rdp_size": rm.rdp_size, "dp_rank": c.dp_rank, "dp_size": rm.dp_size, "mp_rank": c.mp_rank,
                     "mp_size": rm.mp_size}
    assert smp.num_microbatches() == config.get("microbatches", 1)
    assert os.environ["RANK"] == str(me) and os.environ["WORLD_SIZE"] == str(world)
    groups = {"pp": smp.get_pp_group(), "tp": smp.get_tp_group(), "rdp": smp.get_rdp_group(),
              "dp": smp.get_dp_group(), "mp": smp.get_mp_group()}
    assert groups == {"pp": rm.group(GroupKind.PP, me), "tp": rm.group(GroupKind.TP, me),
                      "rdp": rm.group(GroupKind.RDP, me), "dp": rm.group(GroupKind.DP, me),
                      "mp": rm.group(GroupKind.MP, me)}
    for kind in (GroupKind.WORLD, GroupKind.PP, GroupKind.TP, GroupKind.RDP, GroupKind.DP, GroupKind.MP):
        comm = rt.groups[kind]
        members = rt.group_ranks[kind]
        assert comm.Get_size() == len(members) and members[comm.Get_rank()] == me
    # object primitives: send/recv_from for every RankType, broadcast / allgather / barrier per group
    rings = [_exchange_ring(smp, group_kind(rt_), rt_, rt.group_ranks[group_kind(rt_)]) for rt_ in smp.RankType]
    gathered = {}
    for group in smp.CommGroup:
        members = rt.group_ranks[group_kind(group)]
        for root_index, root in enumerate(members):
            if root == me:
                smp.broadcast(("from", me, group.name), group)
            else:
                assert smp.recv_from(root_index, smp.RankType(int(group))) == ("from", root, group.name)
        gathered[group.name] = smp.allgather({"r": me}, group)
        assert gathered[group.name] == [{"r": m} for m in members]
        smp.barrier(group)
    smp.barrier()
    for fn in (smp.pp_barrier, smp.tp_barrier, smp.dp_barrier, smp.rdp_barrier, smp.mp_barrier):
        fn()
    with pytest.raises(InvalidCommGroupError, match="invalid communication group 7"):
        smp.barrier(7)  # type: ignore[arg-type]
    pp_peer = [r for r in rt.group_ranks[GroupKind.PP] if r != me][0]
    transport = _transport_checks(smp, rt, pp_peer)
    allreduce = _allreduce_checks(smp, rt)
    store = rt.store
    assert store.check([f"hb/{me}/where"])
    # reset, then init again with another layout in the same process
    smp.reset()
    assert not smp.is_initialized() and "RANK" not in os.environ
    with pytest.raises(NotInitializedError):
        smp.pp_rank()
    smp.init(again)
    rt2 = runtime()
    assert rt2.store is not store and not store._open  # closed by the reset, with every rank
    assert smp.pp_size() == again["pipeline_parallel_degree"]
    assert smp.allgather(me, smp.WORLD) == list(range(world))
    assert smp.allgather(me, smp.DP_GROUP) == smp.get_dp_group()
    mean = rt2.transport.allreduce_mean(np.array([float(me)]), GroupKind.DP)
    smp.barrier()
    smp.reset()
    return {"ranks": ranks, "groups": groups, "rings": rings, "gathered": gathered, "transport": transport,
            "allreduce": allreduce, "mean_after_reinit": float(mean[0])}


@pytest.mark.mpi
def test_runtime_2_ranks() -> None:
    out = run_mpi_ranks(runtime_body, 2, args=({"pipeline_parallel_degree": 2, "microbatches": 4},
                                               {"pipeline_parallel_degree": 1, "horovod": True}), timeout=120)
    assert [o["ranks"]["pp_rank"] for o in out] == [0, 1]
    assert out[0]["rings"] == [("WORLD", 1), ("PP", 1), (), (), (), ("MP", 1)]
    assert out[0]["gathered"]["PP_GROUP"] == [{"r": 0}, {"r": 1}] and out[1]["gathered"]["DP_GROUP"] == [{"r": 1}]
    assert out[0]["transport"]["max_tag"] >= 32767
    assert [o["mean_after_reinit"] for o in out] == [0.5, 0.5]  # pp 1 x dp 2 after the reset


@pytest.mark.mpi
def test_runtime_4_ranks_pp2_dp2() -> None:
    out = run_mpi_ranks(runtime_body, 4, args=({"pipeline_parallel_degree": 2, "horovod": True, "microbatches": 2},
                                               {"pipeline_parallel_degree": 4}), timeout=180)
    # default ("cluster") placement, pp 2 x rdp 2: each pipeline on adjacent ranks (0,1 and 2,3)
    assert [o["ranks"]["pp_rank"] for o in out] == [0, 1, 0, 1]
    assert [o["groups"]["pp"] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [o["groups"]["dp"] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert out[0]["allreduce"]["DP"] == [1.0, 1.0, 2.5] and out[3]["allreduce"]["PP"] == [2.5, 1.0, 2.5]
    assert out[1]["rings"] == [("WORLD", 0), ("PP", 0), (), ("RDP", 3), ("DP", 3), ("MP", 0)]
    assert [o["mean_after_reinit"] for o in out] == [0.0, 1.0, 2.0, 3.0]  # pp 4: dp groups of one


def test_init_errors_and_launch_refusal_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    import smp.tensorflow as smp

    from smp.errors import LaunchError

    texts = _check_config_errors(1)
    assert sorted(texts) == [0, 1, 3]
    assert "pipeline_parallel_degree" in texts[0] and "did you mean 'microbatches'" in texts[1]
    assert "no tensor parallelism" in texts[3]
    for name in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(LaunchError, match=r"not an MPI launch.*mpiexec -n 2 python"):
        smp.init()
    assert not smp.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "1")  # a one-process torchrun-style env is one process
    smp.init({"microbatches": 2})
    assert smp.size() == 1 and smp.num_microbatches() == 2 and smp.allgather("x", smp.WORLD) == ["x"]
    smp.reset()
    # Open MPI's variables are an MPI launch (RANK/WORLD_SIZE set by someone else do not count) ...
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    smp.init()
    assert runtime_of_this_process().launch.kind == "mpi" and smp.size() == 1
    smp.reset()
    # ... and one that does not match MPI.COMM_WORLD (another MPI's mpirun) is refused
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(LaunchError, match=r"rank 0 of 2, but MPI.COMM_WORLD is rank 0 of 1"):
        smp.init()
    assert not smp.is_initialized()


def runtime_of_this_process() -> Any:
    from smp.tensorflow.runtime.init import runtime

    return runtime()


def store_body() -> dict[str, Any]:
    """Three ranks race to publish a failure; one record wins everywhere; beats go to watchers only."""
    import threading

    from mpi4py import MPI
    from smp.tensorflow.runtime.store import MPIStore

    world = MPI.COMM_WORLD
    me = world.Get_rank()
    store = MPIStore(world.Dup(), watchers=[(me + 1) % 3], timeout_s=0.3)
    world.Barrier()
    go = threading.Event()
    answers: list[bytes] = []

    def publish(t: int) -> None:
        go.wait()
        answers.append(store.compare_set("failure", "", f"{me} failed {me}\ntraceback {me}.{t}"))

    threads = [threading.Thread(target=publish, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join()
    store.set(f"hb/{me}", "3\tgradient allreduce")  # to rank me+1 only
    store.set(f"hb/{me}/where", f"pid {me} on host h{me}")  # to every rank
    where = [store.get(f"hb/{r}/where").decode() for r in range(3)]
    beat_from = (me - 1) % 3
    beat = store.get(f"hb/{beat_from}")
    world.Barrier()
    try:
        store.get(f"hb/{(me + 1) % 3}")  # rank me+1 beats to rank me+2 only
        unseen = ""
    except TimeoutError as e:
        unseen = str(e)
    store.set(f"hb/{me}", "exited\t")  # the last beat goes to every rank
    world.Barrier()
    exited = store.get(f"hb/{(me + 1) % 3}")
    kept = store.get("failure")
    store.close()
    return {"answers": sorted(set(answers)), "kept": kept, "where": where, "beat": beat, "unseen": unseen,
            "exited": exited}


@pytest.mark.mpi
def test_mpi_store_first_failure_wins_on_every_rank() -> None:
    out = run_mpi_ranks(store_body, 3, timeout=90)
    kept = {o["kept"] for o in out}
    assert len(kept) == 1 and all(o["answers"] == [o["kept"]] for o in out), out
    assert next(iter(kept)).split(b" ")[1] == b"failed"
    assert all(o["where"] == ["pid 0 on host h0", "pid 1 on host h1", "pid 2 on host h2"] for o in out)
    assert all(o["beat"] == b"3\tgradient allreduce" for o in out)
    assert all("not set in the job's store" in o["unseen"] for o in out), out
    assert all(o["exited"] == b"exited\t" for o in out)
