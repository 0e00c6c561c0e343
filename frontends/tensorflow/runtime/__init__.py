"""The TensorFlow runtime: `init` and the MPI communicators, the rank API, the transport, the failure protocol.

- `init`: ``smp.init`` / ``smp.reset``, `TFRuntime` (this process's communicators, store, transport);
- `comm`: the SMP v1 rank API and object communication (``send``, ``broadcast``, ``allgather``, ...);
- `transport`: tensor messages (non-blocking sends, failure-aware receives, allreduce) for the engine;
- `store`, `failure`: the job's store (a copy per rank, over MPI) and the core failure protocol
  bound to it, and how a failing mpiexec job ends;
- `mpi`: MPI requests as the core's work handles, timed object collectives.

The function ``init`` is exported under the submodule's name: code inside smp.tensorflow imports
``from smp.tensorflow.runtime.init import runtime`` (a ``from`` import finds the module), never
``import smp.tensorflow.runtime.init as m`` (that would bind the function).
"""

from .comm import (
    DP_GROUP,
    MP_GROUP,
    PP_GROUP,
    RDP_GROUP,
    TP_GROUP,
    WORLD,
    CommGroup,
    RankType,
    allgather,
    barrier,
    broadcast,
    dp_barrier,
    dp_rank,
    dp_size,
    gather,
    get_dp_group,
    get_mp_group,
    get_pp_group,
    get_rdp_group,
    get_tp_group,
    local_rank,
    local_size,
    mp_barrier,
    mp_rank,
    mp_size,
    num_microbatches,
    pp_barrier,
    pp_rank,
    pp_size,
    rank,
    rdp_barrier,
    rdp_rank,
    rdp_size,
    recv_from,
    send,
    size,
    tp_barrier,
    tp_rank,
    tp_size,
)
from .init import init, is_initialized, reset

__all__ = [
    "DP_GROUP", "MP_GROUP", "PP_GROUP", "RDP_GROUP", "TP_GROUP", "WORLD", "CommGroup", "RankType", "allgather",
    "barrier", "broadcast", "dp_barrier", "dp_rank", "dp_size", "gather", "get_dp_group", "get_mp_group",
    "get_pp_group", "get_rdp_group", "get_tp_group", "init", "is_initialized", "local_rank", "local_size",
    "mp_barrier", "mp_rank", "mp_size", "num_microbatches", "pp_barrier", "pp_rank", "pp_size", "rank",
    "rdp_barrier", "rdp_rank", "rdp_size", "recv_from", "reset", "send", "size", "tp_barrier", "tp_rank",
    "tp_size",
]
