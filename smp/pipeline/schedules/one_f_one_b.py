"""1F1B (PipeDream-Flush) and Megatron's interleaved 1F1B, as instances of the 1F1B template.

Both are static: the order does not depend on costs (see `smp.pipeline.schedules.template`).
"""

from __future__ import annotations

from smp.pipeline.actions import Action
from smp.pipeline.schedules.request import BuildRequest
from smp.pipeline.schedules.template import Template, build_template

__all__ = ["build_1f1b", "build_interleaved_1f1b"]


def _build(request: BuildRequest, depth: int) -> list[list[Action]]:
    return build_template(
        Template(depth=depth),
        num_ranks=request.num_ranks,
        num_microbatches=request.num_microbatches,
        chain=request.chain,
        active_microbatches=request.active_microbatches,
        label=request.name,
    )


def build_1f1b(request: BuildRequest) -> list[list[Action]]:
    """1F1B / PipeDream-Flush: rank r warms up with min(p - r, m) forwards, then alternates.

    Rank r holds at most ``min(p - r, m)`` microbatches; the bubble is ``(p - 1) / m`` like
    GPipe's, at a fraction of its memory. 4 ranks, 6 microbatches, unit costs (F = 1, B = 2),
    drawn by `render_ascii` (``.`` is idle)::

        time   0              5              10             15             20             25
        rank 0 F0|F1|F2|F3|..................B0   |F4|B1   |F5|B2   |...B3   |...B4   |...B5   |
        rank 1 ...F0|F1|F2|............B0   |F3|B1   |F4|B2   |F5|B3   |...B4   |...B5   |
        rank 2 ......F0|F1|......B0   |F2|B1   |F3|B2   |F4|B3   |F5|B4   |...B5   |
        rank 3 .........F0|B0   |F1|B1   |F2|B2   |F3|B3   |F4|B4   |F5|B5   |

    On a chain that revisits ranks,
    each rank orders its forwards depth-first in groups (as `build_interleaved_1f1b`) with this
    shallower warm-up: ``position of F(0, last local segment) + segments after it``.
    """
    return _build(request, depth=1)


def build_interleaved_1f1b(request: BuildRequest) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B: v segments per rank, depth-first groups of g microbatches.

    Warm-up ``2 (p - 1 - r) + (v - 1) g`` forwards on rank r (torch's ScheduleInterleaved1F1B,
    whose group size rule we share), then one forward / one backward. The bubble is
    ``(p - 1) / (v m)``; rank 0 holds ``p + (p - 1) / v`` microbatches' worth of activations. 2 ranks,
    chain ``0 1 0 1`` (v = 2), 4 microbatches, as a grid of unit steps (segment, kind, microbatch)::

        step rank0 rank1
        0    0F0   .
        1    0F1   1F0
        2    2F0   1F1
        3    2F1   3F0
        4    0F2   3B0
        5    2B0   3F1
        6    0F3   3B1
        7    2B1   1F2
        8    2F2   1B0
        9    0B0   1F3
        10   2F3   1B1
        11   0B1   3F2
        12   .     3B2
        13   2B2   3F3
        14   .     3B3
        15   2B3   1B2
        16   0B2   1B3
        17   0B3   .

    Here ``g = 2``: microbatches 0 and 1 go through segment 0 then segment 2 before microbatch 2
    starts; rank 0 warms up with 4 forwards.
    With one segment per rank it is 1F1B with this deeper warm-up (``2 (p - 1 - r)``).
    """
    return _build(request, depth=2)
