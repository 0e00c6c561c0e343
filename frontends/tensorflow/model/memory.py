"""What a pipeline rank holds in memory, beside the placement's estimate of it.

The estimate comes from the variables' static shapes and their owners (known on every rank once
the placement is agreed): a rank's weights, the gradients of its trainable ones (they exist inside
the step, in smp's accumulators, which are emptied once read) and an Adam-like optimizer's two
slots per trainable variable. What a rank holds is counted from the variables' storage
(`residency.held_bytes`): a variable another rank owns was released and counts 0.

``memory_per_rank`` caps the estimate: a rank over it is a `PartitionMemoryError` on every rank
before any variable gets a value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from smp.errors import PartitionMemoryError
from smp.partition import format_bytes

from ..residency import held_bytes

SLOTS_PER_VARIABLE = 2  # Adam's moments: the estimate the torch report uses too (weights + grads + 2 slots)


def estimates(variables: Sequence[Any], owners: dict[int, int], pp_size: int) -> list[dict[str, float]]:
    """Per pipeline rank: ``weights``, ``gradients``, ``optimizer`` and ``total`` bytes (static shapes)."""
    out = [{"weights": 0.0, "gradients": 0.0, "optimizer": 0.0} for _ in range(pp_size)]
    for i, v in enumerate(variables):
        r = owners.get(i, 0)
        n = float(tf.as_dtype(v.dtype).size * int(v.shape.num_elements() or 0))
        out[r]["weights"] += n
        if v.trainable:
            out[r]["gradients"] += n
            out[r]["optimizer"] += SLOTS_PER_VARIABLE * n
    for e in out:
        e["total"] = e["weights"] + e["gradients"] + e["optimizer"]
    return out


def require_fit(per_rank: list[dict[str, float]], cap: int | None) -> None:
    """Raise, naming each rank over ``cap`` (``memory_per_rank``) with its estimate in parts."""
    if cap is None:
        return
    over = [(r, e) for r, e in enumerate(per_rank) if e["total"] > cap]
    if not over:
        return
    lines = [f"  rank {r}: {format_bytes(e['total'])} = weights {format_bytes(e['weights'])} + gradients "
             f"{format_bytes(e['gradients'])} + optimizer state {format_bytes(e['optimizer'])} (Adam's 2 slots)"
             for r, e in over]
    raise PartitionMemoryError(
        f"memory_per_rank={format_bytes(cap)}: the estimate of {len(over)} pipeline rank(s) exceeds it, before the "
        "first step:\n" + "\n".join(lines) + "\nFix: more partitions (pipeline_parallel_degree), optimize: 'memory' "
        "with auto_partition (balances variable bytes instead of compute), move layers to other partitions "
        "(smp.partition(i) blocks), or a larger memory_per_rank")


def memory_check(model: Any, optimizer: Any, owners: dict[int, int], pp_rank: int,
                 pp_size: int) -> dict[str, dict[str, float]]:
    """``{"held": {"weights", "optimizer"}, "estimate": {...}}`` for this rank (see the module doc)."""
    held = {"weights": float(held_bytes(model.variables)),
            "optimizer": float(held_bytes(optimizer.variables)) if optimizer is not None else 0.0}
    return {"held": held, "estimate": estimates(model.variables, owners, pp_size)[pp_rank]}
