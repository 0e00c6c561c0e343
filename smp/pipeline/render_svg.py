"""SVG timeline: one lane per rank, a box per action coloured by kind, numbered by microbatch.

Self-contained SVG 1.1 (no scripts, no external fonts), so it opens in any browser and renders on
GitHub. Colours follow torch.distributed.pipelining's visualizer: forward blue, backward orange,
backward-input teal, backward-weight green, messages grey; odd microbatches are a lighter shade so
neighbouring boxes stay apart. Each box carries its microbatch number (``2:5`` = segment 2,
microbatch 5, on ranks that run several segments) and a tooltip.
"""

from __future__ import annotations

import math
from xml.sax.saxutils import escape

from smp.pipeline.timeline import Timeline

__all__ = ["render_svg", "KIND_COLORS"]

KIND_COLORS: dict[str, tuple[str, str]] = {
    # kind: (even microbatch, odd microbatch)
    "F": ("#4C72B0", "#7A9CD3"),
    "B": ("#DD8452", "#EFAA80"),
    "I": ("#2A9D8F", "#5CC2B5"),
    "W": ("#55A868", "#86C895"),
}
_MESSAGE = ("#9A9A9A", "#BDBDBD")
_OTHER = ("#B07AA1", "#CDA3C3")
_NAMES = {"F": "forward", "B": "backward", "I": "backward input", "W": "backward weight"}


def _nice_step(span: float, ticks: int = 10) -> float:
    raw = span / ticks if span > 0 else 1.0
    magnitude = 10.0 ** math.floor(math.log10(raw))
    return float(next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw))


def render_svg(
    timeline: Timeline,
    *,
    title: str | None = None,
    subtitle: str = "",
    width: int = 1000,
    lane_height: int = 30,
) -> str:
    """Draw ``timeline`` as an SVG document (see the module docstring).

    Args:
        timeline: the events (simulated or measured).
        title: heading; default ``timeline.title``.
        subtitle: a second line (e.g. the bubble fraction).
        width: picture width in pixels.
        lane_height: height of one rank's lane in pixels.

    Returns:
        The SVG text.
    """
    heading = timeline.title if title is None else title
    left, right, top = 70, 20, 58 if subtitle else 40
    lanes = max(timeline.num_ranks, 1)
    plot_w = width - left - right
    axis_y = top + lanes * lane_height + 4
    kinds_present = sorted({e.kind for e in timeline.events}, key=lambda k: ("FBIW".find(k) % 9, k))
    height = axis_y + 56
    span = timeline.makespan or 1.0
    origin = timeline.origin
    scale = plot_w / span
    multi = timeline.multi_segment_ranks()
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif">',
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="{left}" y="22" font-size="15" font-weight="bold">{escape(heading)}</text>',
    ]
    if subtitle:
        out.append(f'<text x="{left}" y="42" font-size="12" fill="#444">{escape(subtitle)}</text>')
    for r in range(timeline.num_ranks):
        y = top + r * lane_height
        out.append(f'<rect x="{left}" y="{y + 2}" width="{plot_w}" height="{lane_height - 4}" fill="#f1f1f1"/>')
        out.append(
            f'<text x="{left - 8}" y="{y + lane_height / 2 + 4:.1f}" font-size="12" text-anchor="end">rank {r}</text>'
        )
    for e in sorted(timeline.events, key=lambda ev: (ev.rank, ev.start)):
        x = left + (e.start - origin) * scale
        w = max((e.end - e.start) * scale, 0.5)
        y = top + e.rank * lane_height + 3
        h = lane_height - 6
        fill = KIND_COLORS.get(e.kind, _MESSAGE if e.kind.startswith(("SEND", "RECV")) else _OTHER)[e.microbatch % 2]
        label = f"{e.segment}:{e.microbatch}" if e.rank in multi else str(e.microbatch)
        tip = (
            f"rank {e.rank} {_NAMES.get(e.kind, e.kind)} microbatch {e.microbatch} segment {e.segment}: "
            f"{e.start - origin:g}-{e.end - origin:g} {timeline.unit}"
        )
        out.append(
            f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{h}" fill="{fill}" stroke="#ffffff" '
            f'stroke-width="1"><title>{escape(tip)}</title></rect>'
        )
        font = min(11.0, h * 0.6)
        for text in (label, str(e.microbatch)):  # drop the segment when the box is too narrow
            size = min(font, (w - 2) / (0.62 * len(text)))
            if size >= 7:
                label, font = text, size
                break
        else:
            label = ""
        if label:
            out.append(
                f'<text x="{x + w / 2:.2f}" y="{y + h / 2 + font * 0.36:.2f}" font-size="{font:.1f}" '
                f'text-anchor="middle" fill="#ffffff">{escape(label)}</text>'
            )
    out.append(f'<line x1="{left}" y1="{axis_y}" x2="{left + plot_w}" y2="{axis_y}" stroke="#333"/>')
    step = _nice_step(span)
    t = 0.0
    while t <= span + 1e-9:
        x = left + t * scale
        out.append(f'<line x1="{x:.2f}" y1="{axis_y}" x2="{x:.2f}" y2="{axis_y + 4}" stroke="#333"/>')
        out.append(f'<text x="{x:.2f}" y="{axis_y + 16}" font-size="10" text-anchor="middle">{origin + t:g}</text>')
        t += step
    out.append(f'<text x="{left + plot_w}" y="{axis_y + 30}" font-size="10" text-anchor="end">time ({escape(timeline.unit)})</text>')
    x = left
    for kind in kinds_present:
        fill = KIND_COLORS.get(kind, _MESSAGE if kind.startswith(("SEND", "RECV")) else _OTHER)[0]
        name = _NAMES.get(kind, kind)
        out.append(f'<rect x="{x}" y="{axis_y + 34}" width="12" height="12" fill="{fill}"/>')
        out.append(f'<text x="{x + 16}" y="{axis_y + 44}" font-size="11">{escape(kind)} = {escape(name)}</text>')
        x += 30 + 7 * len(f"{kind} = {name}")
    out.append("</svg>")
    return "\n".join(out) + "\n"
