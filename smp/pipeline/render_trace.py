"""Chrome-trace JSON: open the timeline in Perfetto (ui.perfetto.dev) or chrome://tracing.

One process ("pipeline"), one thread per rank (named ``rank r``), one complete event (``"ph":
"X"``) per action with its kind as category and microbatch/segment as arguments. Trace times are
microseconds; simulated unit-cost timelines are shown with one unit = 1 ms.
"""

from __future__ import annotations

import json

from smp.pipeline.timeline import Timeline

__all__ = ["render_chrome_trace"]

_US_PER_UNIT = {"s": 1e6, "ms": 1e3, "us": 1.0, "unit": 1e3}


def render_chrome_trace(timeline: Timeline, *, us_per_unit: float | None = None) -> str:
    """The Trace Event Format JSON of ``timeline``.

    Args:
        timeline: the events (simulated or measured).
        us_per_unit: microseconds per timeline time unit; default from ``timeline.unit``
            (``s``, ``ms``, ``us``; ``unit`` = 1 ms).

    Example:
        >>> t = Timeline.from_records([(0, "F", 0, 0, 0.0, 1.0)])
        >>> json.loads(render_chrome_trace(t))["traceEvents"][-1]["dur"]
        1000.0
    """
    scale = us_per_unit if us_per_unit is not None else _US_PER_UNIT.get(timeline.unit, 1e3)
    origin = timeline.origin
    multi = timeline.multi_segment_ranks()
    events: list[dict[str, object]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": timeline.title or "pipeline"}}
    ]
    for r in range(timeline.num_ranks):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": r, "args": {"sort_index": r}})
    for e in sorted(timeline.events, key=lambda ev: (ev.start, ev.rank)):
        events.append(
            {
                "name": e.label(with_segment=e.rank in multi),
                "cat": e.kind,
                "ph": "X",
                "pid": 0,
                "tid": e.rank,
                "ts": (e.start - origin) * scale,
                "dur": (e.end - e.start) * scale,
                "args": {"microbatch": e.microbatch, "segment": e.segment, "kind": e.kind},
            }
        )
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, indent=None)
