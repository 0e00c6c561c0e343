"""Which process group a tensor-parallel layer splits over, and the checks on global sizes.

Every layer in `smp.torch.nn` takes an optional ``process_group``. Left out, it is smp's TP group
(``smp.torch.get_tp_process_group()``) once ``smp.init`` ran, and no group (tp size 1, plain
single-process math) before that, so the same layer code runs in a unit test and in a job.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from smp.errors import SMPError

__all__ = ["TPShardingError", "communicates", "divide", "resolve_group", "group_rank", "group_size", "shard_range"]


class TPShardingError(SMPError, ValueError):
    """A global size cannot be split evenly over the tensor-parallel group.

    Example:
        >>> divide(10, 4, "out_features")
        Traceback (most recent call last):
        ...
        smp.torch.nn.group.TPShardingError: out_features=10 is not divisible by tensor_parallel_degree=4...
    """


def resolve_group(process_group: Any = None) -> Any:
    """The group to use: ``process_group`` if given, else smp's TP group, else None (tp size 1)."""
    if process_group is not None:
        return process_group
    from smp.torch.runtime.init import is_initialized, runtime

    from smp.topology import GroupKind

    if is_initialized() and dist.is_initialized():
        return runtime().groups[GroupKind.TP]
    return None


def group_size(group: Any) -> int:
    """Number of ranks in ``group`` (1 for None)."""
    return 1 if group is None else int(dist.get_world_size(group))


def group_rank(group: Any) -> int:
    """This process's rank inside ``group`` (0 for None)."""
    return 0 if group is None else int(dist.get_rank(group))


def communicates(group: Any) -> bool:
    """Whether TP collectives over ``group`` run now: not for one rank, and not while rank 0 traces
    the model alone for automatic partitioning (its TP peers are not running the model, so a
    collective would wait forever; the trace only needs shapes and timings)."""
    if group_size(group) == 1:
        return False
    import smp.state as smp_state

    model = smp_state.current().model
    return not (model is not None and getattr(model, "_tracing", False))


def divide(size: int, tp: int, what: str) -> int:
    """``size // tp``, or a `TPShardingError` naming the size, the degree and the fix.

    Example:
        >>> divide(12, 2, "num_attention_heads")
        6
    """
    if size % tp:
        lower = max((d for d in range(1, tp + 1) if size % d == 0 and tp % d == 0), default=1)
        raise TPShardingError(
            f"{what}={size} is not divisible by tensor_parallel_degree={tp}. Fix: choose {what} as a "
            f"multiple of {tp}, or a tensor_parallel_degree that divides {size} (e.g. {lower}), or leave "
            "this module out of tensor parallelism (smp.set_tensor_parallelism(module, False)).")
    return size // tp


def shard_range(size: int, tp: int, rank: int, what: str) -> tuple[int, int]:
    """The ``[start, end)`` slice of a dimension of global ``size`` that tp rank ``rank`` owns.

    Example:
        >>> shard_range(8, 2, 1, "vocab_size")
        (4, 8)
    """
    part = divide(size, tp, what)
    return rank * part, (rank + 1) * part
