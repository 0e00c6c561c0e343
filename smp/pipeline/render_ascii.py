"""ASCII timeline: one lane per rank, time to scale, for terminals and logs.

Each action is a box as wide as its duration, labelled with its kind and microbatch (and segment
on ranks that run several), closed by ``|``; ``.`` is idle. 1F1B, 2 ranks, 3 microbatches, unit
costs (F = 1, B = 2), 3 columns per time unit::

    time   0              5              10
    rank 0 F0|F1|......B0   |F2|B1   |...B2   |
    rank 1 ...F0|B0   |F1|B1   |F2|B2   |
"""

from __future__ import annotations

import math

from smp.pipeline.timeline import Timeline, TimelineEvent

__all__ = ["render_ascii"]


def _label(event: TimelineEvent, multi: set[int]) -> str:
    return event.label(with_segment=event.rank in multi)


def render_ascii(timeline: Timeline, *, columns_per_unit: float | None = None, max_width: int = 200) -> str:
    """Draw ``timeline`` as text lanes (see the module docstring).

    Args:
        timeline: the events (simulated or measured).
        columns_per_unit: horizontal scale; default: wide enough for the longest label in the
            shortest event, but at most ``max_width`` columns in all.
        max_width: cap on the drawing width when the scale is chosen automatically.

    Returns:
        The drawing; labels that do not fit their box are cut.
    """
    multi = timeline.multi_segment_ranks()
    origin = timeline.origin
    span = timeline.makespan
    events = [e for e in timeline.events if e.end > e.start]
    if not events or span <= 0:
        return "\n".join(f"rank {r} (idle)" for r in range(timeline.num_ranks))
    if columns_per_unit is None:
        shortest = min(e.duration for e in events)
        longest_label = max(len(_label(e, multi)) for e in events)
        columns_per_unit = min((longest_label + 1) / shortest, max_width / span)
    scale = columns_per_unit
    width = max(1, round(span * scale))
    names = [f"rank {r}" for r in range(timeline.num_ranks)]
    pad = max(len(n) for n in names + ["time"]) + 1
    lines = ["time".ljust(pad) + _ruler(span, scale, width, origin)]
    for rank, lane_events in enumerate(timeline.by_rank()):
        lane = ["."] * width
        for e in lane_events:
            a = round((e.start - origin) * scale)
            b = max(a + 1, round((e.end - origin) * scale))
            box = b - a
            text = _label(e, multi)[: box - 1] if box > 1 else ""
            cells = text.ljust(box - 1) + "|"
            for i, ch in enumerate(cells):
                if a + i < width:
                    lane[a + i] = ch
        lines.append(names[rank].ljust(pad) + "".join(lane).rstrip("."))
    return "\n".join(line.rstrip() for line in lines)


def _ruler(span: float, scale: float, width: int, origin: float) -> str:
    """Time labels every few columns, at round values."""
    target = max(1.0, 10 / scale)  # about every 10 columns
    magnitude = 10 ** math.floor(math.log10(target))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= target)
    ruler = [" "] * (width + 12)
    t = 0.0
    while t <= span + 1e-9:
        text = f"{origin + t:g}"
        col = round(t * scale)
        if all(c == " " for c in ruler[col : col + len(text) + 1]):
            ruler[col : col + len(text)] = list(text)
        t += step
    return "".join(ruler).rstrip()
