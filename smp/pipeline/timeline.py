"""Timeline: what ran where and when, as start/end times; the input of every renderer.

The simulator produces one; so will the PyTorch executor from measured times of a real step
(`Timeline.from_records`), so the same pictures show plans and measurements.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["TimelineEvent", "Timeline"]


@dataclass(frozen=True)
class TimelineEvent:
    """One action that ran: on which rank, what, for which microbatch and segment, from when to when.

    ``kind`` is an `ActionKind` value (``"F"``, ``"B"``, ``"I"``, ``"W"``, ``"SEND_F"``, ...) or
    any other short label a measured trace uses.
    """

    rank: int
    kind: str
    microbatch: int
    segment: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        """``end - start``."""
        return self.end - self.start

    def label(self, with_segment: bool = False) -> str:
        """``F3``, or ``2F3`` with the segment."""
        return f"{self.segment}{self.kind}{self.microbatch}" if with_segment else f"{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class Timeline:
    """Events of one pipeline step.

    Attributes:
        num_ranks: lanes to draw (ranks with no event are drawn empty).
        events: the events, in any order.
        unit: the time unit, for axis labels (``"unit"`` for simulated unit costs, ``"ms"``, ``"s"``).
        title: a caption for pictures.

    Example:
        >>> t = Timeline.from_records([(0, "F", 0, 0, 0.0, 1.0), (1, "F", 0, 1, 1.0, 2.0)])
        >>> t.num_ranks, t.makespan
        (2, 2.0)
    """

    num_ranks: int
    events: tuple[TimelineEvent, ...]
    unit: str = "unit"
    title: str = ""

    @classmethod
    def from_records(
        cls,
        records: Iterable[tuple[int, str, int, int, float, float]],
        *,
        num_ranks: int | None = None,
        unit: str = "unit",
        title: str = "",
    ) -> Timeline:
        """Build from ``(rank, kind, microbatch, segment, start, end)`` tuples (e.g. measured)."""
        events = tuple(
            TimelineEvent(int(r), str(k), int(m), int(s), float(a), float(b)) for r, k, m, s, a, b in records
        )
        lanes = max((e.rank for e in events), default=-1) + 1
        return cls(num_ranks=max(lanes, num_ranks or 0), events=events, unit=unit, title=title)

    @property
    def origin(self) -> float:
        """Earliest start (0 for simulated timelines)."""
        return min((e.start for e in self.events), default=0.0)

    @property
    def makespan(self) -> float:
        """Latest end minus `origin`."""
        return max((e.end for e in self.events), default=0.0) - self.origin

    def by_rank(self) -> list[list[TimelineEvent]]:
        """Events per rank, sorted by start time."""
        lanes: list[list[TimelineEvent]] = [[] for _ in range(self.num_ranks)]
        for e in self.events:
            lanes[e.rank].append(e)
        for lane in lanes:
            lane.sort(key=lambda e: (e.start, e.end))
        return lanes

    def multi_segment_ranks(self) -> set[int]:
        """Ranks that ran more than one segment (their labels need the segment)."""
        seen: dict[int, set[int]] = {}
        for e in self.events:
            seen.setdefault(e.rank, set()).add(e.segment)
        return {r for r, segs in seen.items() if len(segs) > 1}
