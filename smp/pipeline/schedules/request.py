"""BuildRequest: everything a schedule builder is given, already checked by `build_plan`."""

from __future__ import annotations

from dataclasses import dataclass

from smp.pipeline.costs import SegmentCosts

__all__ = ["BuildRequest"]


@dataclass(frozen=True)
class BuildRequest:
    """The inputs of one build.

    Attributes:
        name: the registry key being built.
        num_ranks: pipeline ranks.
        num_microbatches: microbatches per step.
        chain: segment -> rank.
        active_microbatches: the in-flight cap to honour (``num_microbatches`` when none was set).
        capped: whether the caller set ``active_microbatches``.
        costs: segment costs given by the caller, or None (each builder documents its default).
    """

    name: str
    num_ranks: int
    num_microbatches: int
    chain: tuple[int, ...]
    active_microbatches: int
    capped: bool
    costs: SegmentCosts | None
