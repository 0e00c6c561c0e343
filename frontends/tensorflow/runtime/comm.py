"""The SMP v1 rank API and object communication for TensorFlow (reference section 2.2).

Ranks: ``rank()``, ``pp_rank()``, ... and the groups as rank lists (``get_dp_group()``) come from the
core (`smp.runtime.ranks`, re-exported here). No process-group functions (SMP v1's TF API had
none). Objects: ``send`` / ``recv_from`` / ``broadcast`` (point to point, synchronous: a send
returns once the receiver has matched it), ``allgather`` / ``gather`` / ``barrier`` (collective
over a group's communicator). Every object travels pickled in one MPI message; every wait has the
comm_timeout and stops when another rank fails (mpi.py).

Example (2 ranks, pp 2)::

    import smp.tensorflow as smp
    smp.init({"pipeline_parallel_degree": 2})
    if smp.pp_rank() == 0:
        smp.send({"step": 1}, 1, smp.RankType.PP_RANK)
    else:
        assert smp.recv_from(0, smp.RankType.PP_RANK) == {"step": 1}
    assert smp.allgather(smp.rank(), smp.PP_GROUP) == [0, 1]
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
from mpi4py import MPI

import smp.state as smp_state
from smp.runtime.ranks import (
    DP_GROUP,
    MP_GROUP,
    PP_GROUP,
    RDP_GROUP,
    TP_GROUP,
    WORLD,
    CommGroup,
    RankType,
    dp_rank,
    dp_size,
    get_dp_group,
    get_mp_group,
    get_pp_group,
    get_rdp_group,
    get_tp_group,
    local_rank,
    local_size,
    mp_rank,
    mp_size,
    num_microbatches,
    pp_rank,
    pp_size,
    rank,
    rdp_rank,
    rdp_size,
    size,
    tp_rank,
    tp_size,
)
from smp.runtime.ranks import group_kind as _kind

from .init import runtime
from .mpi import allgather_objects, poll, wait_request

__all__ = [
    "DP_GROUP", "MP_GROUP", "OBJECT_TAG", "PP_GROUP", "RDP_GROUP", "TP_GROUP", "WORLD", "CommGroup", "RankType",
    "allgather", "barrier", "broadcast", "dp_barrier", "dp_rank", "dp_size", "gather", "get_dp_group",
    "get_mp_group", "get_pp_group", "get_rdp_group", "get_tp_group", "local_rank", "local_size", "mp_barrier",
    "mp_rank", "mp_size", "num_microbatches", "pp_barrier", "pp_rank", "pp_size", "rank", "rdp_barrier",
    "rdp_rank", "rdp_size", "recv_from", "send", "size", "tp_barrier", "tp_rank", "tp_size",
]

# The tag of object messages on the runtime's object communicator (SMP v1's value in smp.torch).
OBJECT_TAG = 0x5EED


class _ProbeWork:
    """Matches the next object message from ``src`` (``Improbe``); ``message`` is set once matched."""

    def __init__(self, comm: MPI.Comm, src: int) -> None:
        self.comm = comm
        self.src = src
        self.message: MPI.Message | None = None
        self.status = MPI.Status()

    def is_completed(self) -> bool:
        if self.message is None:
            self.message = self.comm.Improbe(source=self.src, tag=OBJECT_TAG, status=self.status)
        return self.message is not None

    def wait(self) -> None:
        if self.message is None:
            self.message = self.comm.Mprobe(source=self.src, tag=OBJECT_TAG, status=self.status)


def _global_rank(peer: int, rank_type: RankType) -> int:
    kind = _kind(rank_type)
    members = runtime().group_ranks[kind]
    if not isinstance(peer, (int, np.integer)) or not 0 <= peer < len(members):
        raise ValueError(f"{rank_type.name} {peer!r} does not exist: this rank's {kind.name} group has "
                         f"{len(members)} member(s) {members}")
    return members[int(peer)]


def _encode(obj: Any) -> np.ndarray:
    return np.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=np.uint8)


def send(obj: Any, dest_rank: int, rank_type: RankType) -> None:
    """Send a picklable object to ``dest_rank`` (read as ``rank_type``); returns once it is received.

    Raises:
        ValueError: ``dest_rank`` is not in this rank's group of that type, or is this rank.
    """
    dest = _global_rank(dest_rank, rank_type)
    if dest == rank():
        raise ValueError(f"smp.send to itself ({rank_type.name} {dest_rank} is this rank)")
    payload = _encode(obj)
    comm = runtime().object_comm
    wait_request(comm.Issend([payload, MPI.BYTE], dest, OBJECT_TAG), f"send of an object to rank {dest}", dest,
                 payload)


def recv_from(src_rank: int, rank_type: RankType) -> Any:
    """Receive the object sent by ``src_rank`` (read as ``rank_type``) with `send` or `broadcast`."""
    src = _global_rank(src_rank, rank_type)
    if src == rank():
        raise ValueError(f"smp.recv_from itself ({rank_type.name} {src_rank} is this rank)")
    probe = _ProbeWork(runtime().object_comm, src)
    poll(probe, f"recv of an object from rank {src}", src)
    assert probe.message is not None
    buf = np.empty(probe.status.Get_count(MPI.BYTE), dtype=np.uint8)
    probe.message.Recv([buf, MPI.BYTE])
    return pickle.loads(buf.tobytes())


def broadcast(obj: Any, group: CommGroup) -> None:
    """Send ``obj`` to every other member of ``group``; they call ``recv_from(this rank, ...)``.

    Returns once every receiver has matched (SMP v1: synchronous).
    """
    kind = _kind(group)
    me = rank()
    peers = [r for r in runtime().group_ranks[kind] if r != me]
    payload = _encode(obj)
    comm = runtime().object_comm
    requests = [comm.Issend([payload, MPI.BYTE], r, OBJECT_TAG) for r in peers]
    for r, request in zip(peers, requests):
        wait_request(request, f"broadcast of an object over {kind.name} to rank {r}", r, payload)


def allgather(obj: Any, group: CommGroup) -> list[Any]:
    """Element i of the result is the object of the i-th member of ``group``."""
    kind = _kind(group)
    rt = runtime()
    return allgather_objects(rt.groups[kind], obj, f"allgather over {kind.name}", rt.group_ranks[kind])


def gather(obj: Any, group: CommGroup, rank: int = 0) -> list[Any] | None:
    """Like `allgather`, but only the member with group rank ``rank`` gets the list (others: None)."""
    result = allgather(obj, group)
    members = runtime().group_ranks[_kind(group)]
    return result if members.index(smp_state.current().rank) == rank else None


def barrier(group: CommGroup = CommGroup.WORLD) -> None:
    """Wait until every member of ``group`` reaches the barrier."""
    kind = _kind(group)
    rt = runtime()
    if len(rt.group_ranks[kind]) == 1:
        return
    wait_request(rt.groups[kind].Ibarrier(), f"barrier over {kind.name}", rt.group_ranks[kind])


def pp_barrier() -> None:
    """Wait until every rank of this rank's pipeline (PP) group: the ranks that hold one copy of the model's partitions gets here (SMP v1 ``smp.pp_barrier``)."""
    barrier(CommGroup.PP_GROUP)


def tp_barrier() -> None:
    """Wait until every rank of this rank's tensor-parallel (TP) group gets here (SMP v1 ``smp.tp_barrier``)."""
    barrier(CommGroup.TP_GROUP)


def dp_barrier() -> None:
    """Wait until every rank of this rank's data-parallel (DP) group: the replicas of this rank's model part gets here (SMP v1 ``smp.dp_barrier``)."""
    barrier(CommGroup.DP_GROUP)


def rdp_barrier() -> None:
    """Wait until every rank of this rank's reduced data-parallel (RDP) group: the replicas of this rank's TP shard gets here (SMP v1 ``smp.rdp_barrier``)."""
    barrier(CommGroup.RDP_GROUP)


def mp_barrier() -> None:
    """Wait until every rank of this rank's model-parallel (MP) group: every rank holding a part of one model copy (PP x TP) gets here (SMP v1 ``smp.mp_barrier``)."""
    barrier(CommGroup.MP_GROUP)
