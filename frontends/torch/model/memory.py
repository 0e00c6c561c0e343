"""What a pipeline rank holds in memory, beside the partition report's estimate of it.

Counted from the tensors' storage (not RSS): the rank's parameters, their gradients, and the
optimizer's state (fp32 masters included). A parameter another rank owns was freed at partitioning
and counts 0; a view counts its base once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from smp.partition import PartitionReport, format_bytes

logger = logging.getLogger("smp")

HELD_KINDS = ("weights", "gradients", "optimizer")


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None and meta tensors count 0)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and not t.is_meta:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def held_bytes(module: nn.Module, optimizer: Any) -> dict[str, float]:
    """Bytes this rank holds in weights, gradients and optimizer state (scalar states such as Adam's
    ``step`` are left out)."""
    state = [v for s in (optimizer.state.values() if optimizer is not None else ())
             for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    masters = getattr(optimizer, "master_weights", None)
    if masters is not None:
        state += [m for p, m in masters.pairs if m is not p]
    params = list(module.parameters())
    return {"weights": float(storage_bytes(params)), "gradients": float(storage_bytes(p.grad for p in params)),
            "optimizer": float(storage_bytes(state))}


def memory_check(module: nn.Module, optimizer: Any, report: PartitionReport | None,
                 pp_rank: int) -> dict[str, dict[str, float]]:
    """``{"held": ..., "estimate": ...}`` for this rank; ``estimate`` is empty without a report."""
    estimate = report.rank_memory(pp_rank) if report is not None else {}
    return {"held": held_bytes(module, optimizer), "estimate": estimate}


def log_memory(check: dict[str, dict[str, float]], pp_rank: int) -> None:
    """One INFO line: what the rank holds against the estimate (nothing without an estimate)."""
    held, est = check["held"], check["estimate"]
    if not est:
        return
    logger.info("memory of pp_rank %d after the first step: weights %s, gradients %s, optimizer state %s "
                "(partition estimate: %s, %s, %s, plus %s of activations in flight)", pp_rank,
                *(format_bytes(held[k]) for k in HELD_KINDS),
                *(format_bytes(est[k]) for k in (*HELD_KINDS, "activations")))
