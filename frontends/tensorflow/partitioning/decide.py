"""Which pipeline rank runs each traced op: manual (``smp.partition`` scopes) or automatic.

Rules (SMP v1 TF, reference section 4; issue 11 item 2):

- manual: the innermost ``smp.partition`` block of the op's name, else ``default_partition``;
- auto (``auto_partition: True``, the default): the auto-partitioner's choice
  (`..partitioning.auto.auto_partition`), made on pipeline rank 0 and broadcast;
- either way, an op that reads or writes a variable runs on the variable's *owner*: the partition
  of its first reading op in program order. A tied embedding read again on another partition is
  therefore read on the owner and sent (its gradient comes back to the owner).

Every rank traces the same program, so the op names agree; pipeline rank 0's decision is
broadcast and a rank whose trace has other op names fails naming the first difference.

Example (manual, pp=2; the embedding ``emb`` is variable 0, first read on 0 and read again by
the tied head inside ``smp.partition(1)``):
    >>> placement = decide(traced, pp_size=2, cfg=cfg, owners=None)
    >>> placement.owners[0], placement.op_partition["m_1/smp_partition_1/MatMul/ReadVariableOp"]
    (0, 0)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from smp.errors import InvalidPartitionIDError, PartitionError

from .scopes import scope_partition
from .trace import TracedCall

__all__ = ["Placement", "decide", "placement_table"]

logger = logging.getLogger("smp.tensorflow")


@dataclass
class Placement:
    """The decision for one trace.

    Attributes:
        op_partition: op name -> partition, for every op of ``TracedCall.ops``.
        owners: variable index (in ``model.variables``) -> the partition that owns it.
        method: "manual" or "auto".
    """

    op_partition: dict[str, int]
    owners: dict[int, int]
    method: str


def _manual(traced: TracedCall, default_partition: int) -> dict[str, int]:
    return {op.name: (p if (p := scope_partition(op.name)) is not None else default_partition)
            for op in traced.ops}


def _auto(traced: TracedCall, pp_size: int, cfg: Any) -> dict[str, int]:
    try:
        from .auto import auto_partition
    except ImportError as e:
        raise PartitionError(
            "auto_partition=True needs smp.tensorflow's automatic partitioner, which is not available "
            f"({e}). Fix: set 'auto_partition': False and place ops with smp.partition(i) "
            "(with 'default_partition' for the rest)") from e
    return dict(auto_partition(traced.ops, traced.var_of_read, pp_size, cfg))


def decide(traced: TracedCall, *, pp_size: int, cfg: Any, owners: dict[int, int] | None,
           broadcast: Any = None, is_root: bool = True) -> Placement:
    """Assign every op of ``traced`` to a partition and every variable it touches to an owner.

    Args:
        traced: the trace.
        pp_size: pipeline_parallel_degree.
        cfg: the resolved config (``auto_partition``, ``default_partition``).
        owners: variable owners fixed by an earlier trace of the same model (a second call
            signature keeps them), or None for the first trace.
        broadcast: ``broadcast(obj) -> obj`` over the pipeline group (pipeline rank 0's value
            wins), or None at pp=1.
        is_root: this rank is pipeline rank 0 (only it runs the auto-partitioner).

    Raises:
        InvalidPartitionIDError: a partition index is outside ``[0, pp_size)``.
        PartitionError: ranks traced different programs, or a variable's owner changed.
    """
    method = "auto" if cfg.auto_partition and pp_size > 1 else "manual"
    if pp_size == 1:
        proposal = {op.name: 0 for op in traced.ops}
    elif method == "auto":
        proposal = _auto(traced, pp_size, cfg) if is_root else {}
    else:
        default = cfg.default_partition if cfg.default_partition is not None else 0
        proposal = _manual(traced, default)
    if broadcast is not None:
        proposal = _agree(proposal, traced, broadcast, method)
    bad = sorted({p for p in proposal.values() if not (isinstance(p, int) and 0 <= p < pp_size)})
    if bad:
        raise InvalidPartitionIDError(
            f"ops were placed on partition(s) {bad}, outside [0, {pp_size}) for pipeline_parallel_degree="
            f"{pp_size}. Fix: use smp.partition(0..{pp_size - 1}) and a default_partition below {pp_size}")
    fixed = dict(owners or {})
    new_owners: dict[int, int] = {}
    for op in traced.ops:
        var = traced.var_of_op.get(op.name)
        if var is None:
            continue
        owner = new_owners.setdefault(var, fixed.get(var, proposal[op.name]))
        proposal[op.name] = owner
    return Placement(op_partition=proposal, owners={**fixed, **new_owners}, method=method)


def _agree(proposal: dict[str, int], traced: TracedCall, broadcast: Any, method: str) -> dict[str, int]:
    """Pipeline rank 0's decision, checked against this rank's op names."""
    chosen: dict[str, int] = broadcast(proposal)
    mine = [op.name for op in traced.ops]
    missing = [n for n in mine if n not in chosen]
    extra = [n for n in chosen if n not in set(mine)]
    if missing or extra:
        raise PartitionError(
            f"this rank traced a different DistributedModel.call than pipeline rank 0 ({method} placement): "
            f"ops only here: {missing[:3]}, ops only on rank 0: {extra[:3]}. Fix: make call() build the same "
            "ops on every rank (no rank-dependent Python branches inside call())")
    return dict(chosen)


def placement_table(traced: TracedCall, placement: Placement, pp_size: int) -> str:
    """A per-partition summary (op count, variables owned) for the log and for errors."""
    lines = [f"{'partition':>9} {'ops':>6} {'variables':>9}"]
    for p in range(pp_size):
        n_ops = sum(1 for v in placement.op_partition.values() if v == p)
        n_vars = sum(1 for v in placement.owners.values() if v == p)
        lines.append(f"{p:>9} {n_ops:>6} {n_vars:>9}")
    return "\n".join(lines)
