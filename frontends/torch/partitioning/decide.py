"""The partition decision: which pipeline rank owns each module (module path -> pp_rank).

Three sources, in this order: the partition a checkpoint was saved with; automatic partitioning
(global rank 0 traces one microbatch, or reads the costs an earlier launch of the same model and
configuration traced (record.py), the core partitions the lowered module tree, the decision is
broadcast); manual scopes (``smp.partition``, ``smp.set_partition``, ``default_partition``).
The decision is data; applying it (freeing storage, dispatch, DP broadcast) is the model's job.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from torch import nn

import smp.state as smp_state
from smp.errors import PartitionMemoryError, SMPError
from smp.partition import MemoryBudget, PartitionReport, format_bytes
from smp.partition.report import memory_fixes

from . import record
from .scopes import manual_scopes
from .trace import auto_partition, in_flight, lower, rehome_sequential_stateless, rehome_split_layers, trace

__all__ = ["check_saved_partition", "decide_partition"]

logger = logging.getLogger("smp")


def check_saved_partition(module: nn.Module, assignment: dict[str, int],
                          caller: str = "resume_from_checkpoint") -> dict[str, int]:
    """A checkpoint's partition, checked against ``module``'s module paths (``caller`` names the API in errors)."""
    paths = {p for p, _ in module.named_modules()}
    if set(assignment) != paths:
        extra, missing = sorted(set(assignment) - paths), sorted(paths - set(assignment))
        raise SMPError(f"{caller}: the checkpoint's partition names other modules than this "
                       f"model has (only in the checkpoint: {extra[:5]}, only in the model: {missing[:5]}). "
                       f"Fix: build the same model as the one that was saved")
    return dict(assignment)


def _traced(module: nn.Module, cfg: Any, first_microbatch: Callable[[], Any],
            tracing: Callable[[], AbstractContextManager[Any]],
            traced_backward: Callable[[], list[tuple[Any, Any]]] | None) -> Any:
    """The trace of ``module``: recorded by an earlier launch of the same model and configuration, or made now."""
    key = getattr(first_microbatch, "record_key", None) or ""  # made by the step (step.py), once
    found = record.load(key) if key else None
    if found is not None:
        logger.info("automatic partition: the costs traced by an earlier launch of this model, step and "
                    "configuration are reused (%s; SMP_PARTITION_CACHE=off traces again)", found[1])
        return found[0]
    with tracing():
        tp = getattr(cfg, "tensor_parallel_degree", 1)
        tr = trace(module, first_microbatch, backward=traced_backward if tp == 1 else None)
    if key:
        record.save(key, tr)
    return tr


def decide_partition(module: nn.Module, cfg: Any, first_microbatch: Callable[[], Any],
                     tracing: Callable[[], AbstractContextManager[Any]],
                     traced_backward: Callable[[], list[tuple[Any, Any]]] | None = None,
                     ) -> tuple[dict[str, int], PartitionReport]:
    """(assignment, partition report) for ``module``; a collective under auto_partition.

    The report (every rank gets it) carries each rank's memory estimate; with ``memory_per_rank``
    a rank whose estimate exceeds it is a `PartitionMemoryError` on every rank, before any work.

    ``first_microbatch`` runs the step body on the first microbatch (for tracing); ``tracing()``
    is the context the model is traced in (``smp.is_tracing()`` is true inside);
    ``traced_backward()`` takes the ``model.backward`` calls the body made while tracing, which
    the trace then times. Under tensor parallelism the backward is not traced: only rank 0 traces,
    and a TP layer's backward would wait on its group.
    """
    if not cfg.auto_partition:
        scopes = manual_scopes(module, cfg)
        budget = MemoryBudget.build(cfg.pipeline_parallel_degree, in_flight(cfg), cfg.memory_per_rank)
        part = scopes.resolve(lower(module, None), budget=budget)
        if smp_state.current().rank == 0:
            logger.info("manual partition:\n%s", part.report())
        report = part.report()
        report.require_fit()  # every rank decides the same: each raises the same error
        return dict(part.assignment), report
    decision = None
    if smp_state.current().rank == 0:
        from ..model.delayed import has_delayed_params

        tr = None
        delayed = has_delayed_params(module)
        if delayed:
            logger.info("automatic partition: parameters are delayed (meta), so the model is not "
                        "traced; the partition follows parameter sizes and module counts")
        if not cfg.skip_tracing and not delayed:
            tr = _traced(module, cfg, first_microbatch, tracing, traced_backward)
        tree = lower(module, tr)
        try:
            part = auto_partition(tree, cfg)
            report = part.report()
            report.require_fit()
            decision = (rehome_split_layers(module, rehome_sequential_stateless(module, dict(part.assignment))),
                        report)
            logger.info("automatic partition:\n%s", report)
        except PartitionMemoryError as e:  # every rank raises it, not only the one that partitioned
            decision = str(e) if "memory_per_rank" in str(e) else \
                f"memory_per_rank={format_bytes(cfg.memory_per_rank)}: {e}\n{memory_fixes()}"
    from ..runtime.comm import WORLD, allgather

    decision = allgather(decision, WORLD)[0]
    if isinstance(decision, str):
        raise PartitionMemoryError(decision)
    assert decision is not None
    return decision
