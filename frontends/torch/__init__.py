"""smp for PyTorch: ``import smp.torch as smp`` (was ``import smdistributed.modelparallel.torch as smp``)."""

import smp.state as _state_mod

from . import amp, exceptions
from .checkpointing.saving import load, resume_from_checkpoint, save, save_checkpoint
from .model import DistributedModel
from .model.creation import model_creation
from .model.delayed import delay_param_initialization
from .model.recompute import set_activation_checkpointing
from .optimizer import DistributedOptimizer
from .partitioning.scopes import partition, set_partition
from .patches.checkpoint import checkpoint
from .runtime.comm import (
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
    get_dp_process_group,
    get_mp_group,
    get_mp_process_group,
    get_pp_group,
    get_pp_process_group,
    get_rdp_group,
    get_rdp_process_group,
    get_tp_group,
    get_tp_process_group,
    get_world_process_group,
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
from .runtime.init import init, is_initialized, reset, shutdown
from .step import StepOutput, step
from .tp import (
    nn,
    set_tensor_parallelism,
    tensor_parallelism,
    tp_register,
    tp_register_with_module,
    transform,
)


def is_tracing() -> bool:
    """True while rank 0 traces the model for automatic partitioning (models may skip work then)."""
    model = _state_mod.current().model
    return bool(model is not None and model.tracing)

state = _state_mod.current()

__all__ = [
    "amp",
    "checkpoint",
    "delay_param_initialization",
    "DistributedModel",
    "DistributedOptimizer",
    "StepOutput",
    "is_tracing",
    "load",
    "model_creation",
    "resume_from_checkpoint",
    "save",
    "save_checkpoint",
    "partition",
    "set_activation_checkpointing",
    "set_partition",
    "step",
    "DP_GROUP",
    "MP_GROUP",
    "PP_GROUP",
    "RDP_GROUP",
    "TP_GROUP",
    "WORLD",
    "CommGroup",
    "RankType",
    "allgather",
    "barrier",
    "broadcast",
    "dp_barrier",
    "dp_rank",
    "dp_size",
    "exceptions",
    "gather",
    "get_dp_group",
    "get_dp_process_group",
    "get_mp_group",
    "get_mp_process_group",
    "get_pp_group",
    "get_pp_process_group",
    "get_rdp_group",
    "get_rdp_process_group",
    "get_tp_group",
    "get_tp_process_group",
    "get_world_process_group",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "mp_barrier",
    "mp_rank",
    "mp_size",
    "num_microbatches",
    "pp_barrier",
    "pp_rank",
    "pp_size",
    "rank",
    "rdp_barrier",
    "rdp_rank",
    "rdp_size",
    "recv_from",
    "reset",
    "send",
    "shutdown",
    "size",
    "state",
    "tp_barrier",
    "tp_rank",
    "tp_size",
    "nn",
    "set_tensor_parallelism",
    "tensor_parallelism",
    "tp_register",
    "tp_register_with_module",
    "transform",
]
