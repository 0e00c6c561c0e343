"""The engine's view of the runtime: this rank's pipeline group, its transport, and object broadcasts.

Everything the engine needs from ``smp.tensorflow.runtime`` goes through here, so the engine is
bound to the runtime in one place.
"""

from __future__ import annotations

from typing import Any

import smp.state as smp_state
from smp.errors import NotInitializedError
from smp.topology import GroupKind

from .executor import Link

__all__ = ["current_link", "dp_broadcast_array", "pp_broadcast", "world_broadcast"]


def _runtime() -> Any:
    if not smp_state.current().initialized:
        raise NotInitializedError("smp.DistributedModel needs smp.init() first. Fix: call smp.init(config) "
                                  "at the top of the script, before the first step")
    from ..runtime.init import runtime

    return runtime()


def current_link() -> Link:
    """This rank's pipeline group and transport."""
    rt = _runtime()
    ranks = tuple(rt.group_ranks[GroupKind.PP])
    me = ranks.index(smp_state.current().rank)
    return Link(pp_rank=me, ranks=ranks, transport=rt.transport, max_tag=int(rt.transport.max_tag))


def pp_broadcast(obj: Any, what: str) -> Any:
    """``obj`` of pipeline rank 0 on every rank of this rank's pipeline group."""
    from ..runtime.mpi import bcast_object

    rt = _runtime()
    return bcast_object(rt.groups[GroupKind.PP], obj, 0, what, list(rt.group_ranks[GroupKind.PP]))


def world_broadcast(obj: Any, what: str) -> Any:
    """``obj`` of world rank 0 on every rank (pipeline rank 0 of DP replica 0)."""
    from ..runtime.mpi import bcast_object

    rt = _runtime()
    world = rt.groups[GroupKind.WORLD]
    return bcast_object(world, obj, 0, what, list(rt.group_ranks[GroupKind.WORLD]))



def dp_broadcast_array(array: Any, what: str) -> Any:
    """DP rank 0's ``array`` (shape and dtype known to every rank) on every rank of this rank's
    data-parallel group (the replicas of its pipeline stage), sent unpickled."""
    from ..runtime.mpi import bcast_array

    rt = _runtime()
    return bcast_array(rt.groups[GroupKind.DP], array, 0, what, list(rt.group_ranks[GroupKind.DP]))
