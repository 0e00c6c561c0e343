"""The SMP v1 rank API and object communication for PyTorch (reference section 2.2).

Ranks: ``rank()``, ``pp_rank()``, ... and the groups as rank lists (``get_dp_group()``) come from the
core (`smp.runtime.ranks`, re-exported here); the process groups (``get_dp_process_group()``) are
torch's. Objects: ``send``/``recv_from``/``broadcast`` (point to point, synchronous),
``allgather``/``gather``/``barrier`` (collective over a group). Every object travels pickled in a
uint8 tensor; every wait has the communication timeout and stops when another rank
fails (see failure.py).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

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
from smp.topology import GroupKind

from ..errors import DDPNotEnabledError
from .failure import wait
from .init import runtime

__all__ = [
    "DP_GROUP", "MP_GROUP", "OBJECT_TAG", "PP_GROUP", "RDP_GROUP", "TP_GROUP", "WORLD", "CommGroup", "RankType",
    "allgather", "barrier", "broadcast", "dp_barrier", "dp_rank", "dp_size", "gather", "get_dp_group",
    "get_dp_process_group", "get_mp_group", "get_mp_process_group", "get_pp_group", "get_pp_process_group",
    "get_rdp_group", "get_rdp_process_group", "get_tp_group", "get_tp_process_group", "get_world_process_group",
    "local_rank", "local_size", "mp_barrier", "mp_rank", "mp_size", "num_microbatches", "pp_barrier", "pp_rank",
    "pp_size", "rank", "rdp_barrier", "rdp_rank", "rdp_size", "recv_from", "send", "size", "tp_barrier",
    "tp_rank", "tp_size",
]

# A tag of its own keeps object messages apart from the pipeline's tensor messages.
OBJECT_TAG = 0x5EED


# --- process groups -----------------------------------------------------------------------------

def _process_group(kind: GroupKind, needs_ddp: bool = True) -> Any:
    rt = runtime()
    cfg = smp_state.current().cfg
    if needs_ddp and cfg is not None and not cfg.ddp:
        raise DDPNotEnabledError(
            f"get_{kind.name.lower()}_process_group() needs ddp: True in the smp config (as in SMP v1); "
            "add it, or use get_mp_process_group()")
    return rt.groups[kind]


def get_world_process_group() -> Any:
    """The ``torch.distributed`` process group of every rank (SMP v1 ``smp.get_world_process_group``)."""
    return _process_group(GroupKind.WORLD)


def get_pp_process_group() -> Any:
    """The ``torch.distributed`` process group of this rank's pipeline (PP) group: the ranks that hold one copy of the model's partitions (SMP v1 ``smp.get_pp_process_group``)."""
    return _process_group(GroupKind.PP)


def get_tp_process_group() -> Any:
    """The ``torch.distributed`` process group of this rank's tensor-parallel (TP) group (SMP v1 ``smp.get_tp_process_group``)."""
    return _process_group(GroupKind.TP)


def get_rdp_process_group() -> Any:
    """The ``torch.distributed`` process group of this rank's reduced data-parallel (RDP) group: the replicas of this rank's TP shard (SMP v1 ``smp.get_rdp_process_group``)."""
    return _process_group(GroupKind.RDP)


def get_dp_process_group() -> Any:
    """The ``torch.distributed`` process group of this rank's data-parallel (DP) group: the replicas of this rank's model part (SMP v1 ``smp.get_dp_process_group``)."""
    return _process_group(GroupKind.DP)


def get_mp_process_group() -> Any:
    """The ``torch.distributed`` process group of this rank's model-parallel (MP) group: every rank holding a part of one model copy (PP x TP) (SMP v1 ``smp.get_mp_process_group``)."""
    return _process_group(GroupKind.MP, needs_ddp=False)


# --- object communication -----------------------------------------------------------------------

def _encode(obj: Any) -> torch.Tensor:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _decode(t: torch.Tensor) -> Any:
    return pickle.loads(t.numpy().tobytes())


def _global_rank(peer: int, rank_type: RankType) -> int:
    kind = _kind(rank_type)
    members = runtime().group_ranks[kind]
    if not 0 <= peer < len(members):
        raise ValueError(f"{rank_type.name} {peer} does not exist: this rank's {kind.name} group has "
                         f"{len(members)} member(s) {members}")
    return members[peer]


def send(obj: Any, dest_rank: int, rank_type: RankType) -> None:
    """Send a picklable object to ``dest_rank`` (read as ``rank_type``); returns once received."""
    dest = _global_rank(dest_rank, rank_type)
    if dest == rank():
        raise ValueError(f"smp.send to itself ({rank_type.name} {dest_rank} is this rank)")
    payload = _encode(obj)
    header = torch.tensor([payload.numel()], dtype=torch.int64)
    wait(dist.isend(header, dest, tag=OBJECT_TAG), "send of an object header", dest, p2p=True)
    if payload.numel():
        wait(dist.isend(payload, dest, tag=OBJECT_TAG), "send of an object", dest, p2p=True)


def recv_from(src_rank: int, rank_type: RankType) -> Any:
    """Receive the object sent by ``src_rank`` (read as ``rank_type``) with send or broadcast."""
    src = _global_rank(src_rank, rank_type)
    header = torch.empty(1, dtype=torch.int64)
    wait(dist.irecv(header, src, tag=OBJECT_TAG), "recv of an object header", src, p2p=True)
    payload = torch.empty(int(header.item()), dtype=torch.uint8)
    if payload.numel():
        wait(dist.irecv(payload, src, tag=OBJECT_TAG), "recv of an object", src, p2p=True)
    return _decode(payload)


def broadcast(obj: Any, group: CommGroup) -> None:
    """Send ``obj`` to every other member of ``group``; they call ``recv_from(this rank, ...)``."""
    kind = _kind(group)
    me = rank()
    payload = _encode(obj)
    header = torch.tensor([payload.numel()], dtype=torch.int64)
    peers = [r for r in runtime().group_ranks[kind] if r != me]
    works = [dist.isend(header, r, tag=OBJECT_TAG) for r in peers]
    if payload.numel():
        works += [dist.isend(payload, r, tag=OBJECT_TAG) for r in peers]
    for w in works:
        wait(w, f"broadcast over {kind.name}", peers, p2p=True)


def allgather(obj: Any, group: CommGroup) -> list[Any]:
    """Element i of the result is the object of the i-th member of ``group``."""
    kind = _kind(group)
    rt = runtime()
    members = rt.group_ranks[kind]
    if len(members) == 1:
        return [obj]
    pg = rt.groups[kind]
    payload = _encode(obj)
    n = torch.tensor([payload.numel()], dtype=torch.int64)
    sizes = [torch.empty(1, dtype=torch.int64) for _ in members]
    wait(dist.all_gather(sizes, n, group=pg, async_op=True), f"allgather over {kind.name}", members)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    out = [torch.empty(longest, dtype=torch.uint8) for _ in members]
    wait(dist.all_gather(out, padded, group=pg, async_op=True), f"allgather over {kind.name}", members)
    # torch orders a subgroup's members by global rank; our group lists are in group-rank order.
    by_global = dict(zip(sorted(members), zip(out, sizes)))
    return [_decode(by_global[r][0][: int(by_global[r][1].item())]) for r in members]


def gather(obj: Any, group: CommGroup, rank: int = 0) -> list[Any] | None:
    """Like allgather, but only the member with group rank ``rank`` gets the list (others: None)."""
    result = allgather(obj, group)
    members = runtime().group_ranks[_kind(group)]
    return result if members.index(smp_state.current().rank) == rank else None


def barrier(group: CommGroup = CommGroup.WORLD) -> None:
    """Wait until every member of ``group`` reaches the barrier."""
    kind = _kind(group)
    rt = runtime()
    if len(rt.group_ranks[kind]) == 1:
        return
    t = torch.zeros(1)
    wait(dist.all_reduce(t, group=rt.groups[kind], async_op=True), f"barrier over {kind.name}",
         rt.group_ranks[kind])


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
