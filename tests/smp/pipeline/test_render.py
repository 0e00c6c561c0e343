"""Renderers: ASCII lanes, SVG and Chrome trace, from simulated and from measured timelines."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from smp.pipeline import Timeline, build_plan, render_ascii, render_chrome_trace, render_svg, simulate

SVG = "{http://www.w3.org/2000/svg}"


def test_ascii_lanes_to_scale() -> None:
    text = render_ascii(simulate(build_plan("1f1b", 2, 3)).timeline)
    assert text.splitlines() == [
        "time   0              5              10",
        "rank 0 F0|F1|......B0   |F2|B1   |...B2   |",
        "rank 1 ...F0|B0   |F1|B1   |F2|B2   |",
    ]


def test_ascii_shows_segments_on_multi_segment_ranks_and_cuts_labels() -> None:
    text = render_ascii(simulate(build_plan("zb_v", 2, 2)).timeline)
    assert "0F0|" in text and "3F0|" in text
    narrow = render_ascii(simulate(build_plan("1f1b", 2, 12)).timeline, columns_per_unit=2)
    assert "F|B10|" in narrow and "F11" not in narrow  # labels cut to their box


def test_svg_is_well_formed_with_a_box_per_action() -> None:
    result = simulate(build_plan("zb_h1", 3, 4))
    text = render_svg(result.timeline, subtitle="bubble <0.5> & more")
    root = ET.fromstring(text)
    boxes = [r for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]
    assert len(boxes) == len(result.timeline.events) == 3 * 4 * 3
    fills = {r.get("fill") for r in boxes}
    assert {"#4C72B0", "#2A9D8F", "#55A868"} <= fills  # F, I, W (even microbatches)
    labels = [t.text for t in root.iter(f"{SVG}text")]
    assert "rank 2" in labels and "3" in labels and "bubble <0.5> & more" in labels


def test_chrome_trace_opens_as_trace_event_format() -> None:
    timeline = simulate(build_plan("1f1b", 2, 2)).timeline
    data = json.loads(render_chrome_trace(timeline))
    complete = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == 8
    first = min(complete, key=lambda e: (e["ts"], e["tid"]))
    assert (first["name"], first["tid"], first["ts"], first["dur"]) == ("F0", 0, 0.0, 1000.0)
    names = {e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"rank 0", "rank 1"}


def test_measured_timelines_render_the_same_way() -> None:
    measured = Timeline.from_records(
        [(0, "F", 0, 0, 10.0, 10.5), (1, "F", 0, 1, 10.6, 11.0), (1, "B", 0, 1, 11.0, 11.9), (0, "B", 0, 0, 12.0, 13.0)],
        unit="s",
        title="step 7",
    )
    assert measured.origin == 10.0 and measured.makespan == 3.0
    trace = json.loads(render_chrome_trace(measured))
    starts = [e["ts"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert starts == pytest.approx([0.0, 600000.0, 1000000.0, 2000000.0])
    assert "rank 1" in render_ascii(measured)
    ET.fromstring(render_svg(measured))
