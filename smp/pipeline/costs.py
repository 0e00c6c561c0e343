"""Costs: how long each action takes, how many bytes it keeps alive, and what a message costs.

Every per-segment field takes either one number (the same for every segment) or one number per
segment of the chain. The default, ``Costs()``, is the unit model the theory uses: forward 1,
backward 2, of which the weight-gradient part W is 1 (so a split backward is I = 1 and W = 1, the
zero-bubble paper's F = I = W), one unit of activations per segment, and free messages.

A message (an activation forward or a gradient backward between two different ranks) takes
``latency + message_bytes[s] / bandwidth``; it overlaps with computation (asynchronous transfer)
and links are not contended. Messages between two segments on the same rank are free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from smp.errors import ScheduleError

__all__ = ["Costs", "SegmentCosts"]

PerSegment = float | Sequence[float]


def _expand(name: str, value: PerSegment, n: int, problems: list[str]) -> tuple[float, ...]:
    if isinstance(value, (int, float)):
        values = (float(value),) * n
    else:
        values = tuple(float(v) for v in value)
        if len(values) != n:
            problems.append(
                f"costs.{name} has {len(values)} values but the chain has {n} segments; "
                f"give one number or exactly {n}"
            )
            return (0.0,) * n
    if any(not math.isfinite(v) or v < 0 for v in values):
        problems.append(f"costs.{name}={list(values)}: every value must be a finite number >= 0")
    return values


@dataclass(frozen=True)
class Costs:
    """Per-segment times and bytes, and the message model.

    Attributes:
        forward: forward time of one microbatch through one segment.
        backward: full backward time (input gradient + weight gradient).
        backward_weight: the weight-gradient part W of ``backward``; a split backward runs
            I = ``backward - backward_weight`` then W = ``backward_weight``.
        activation_bytes: bytes one microbatch keeps alive in a segment from the start of its
            forward to the end of its backward (W, when split).
        message_bytes: bytes sent from segment ``s`` to ``s + 1`` (and its gradient back).
        latency: fixed time of one message.
        bandwidth: bytes per time unit of one link (``inf``: size does not matter).

    Example:
        >>> c = Costs(forward=[1, 2], backward=4, backward_weight=2)
        >>> c.resolve(2).forward
        (1.0, 2.0)
    """

    forward: PerSegment = 1.0
    backward: PerSegment = 2.0
    backward_weight: PerSegment = 1.0
    activation_bytes: PerSegment = 1.0
    message_bytes: PerSegment = 0.0
    latency: float = 0.0
    bandwidth: float = math.inf

    @classmethod
    def parse(cls, text: str) -> Costs:
        """Read ``"F,B,W"`` (the CLI's ``--costs``), e.g. ``"1,2,1"``; W may be left out (then B/2)."""
        try:
            values = [float(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = []
        if len(values) not in (2, 3):
            raise ScheduleError(
                f"costs={text!r}: expected 'F,B,W' (forward, full backward, its weight part), e.g. '1,2,1'"
            )
        weight = values[2] if len(values) == 3 else values[1] / 2
        costs = cls(forward=values[0], backward=values[1], backward_weight=weight)
        costs.resolve(1)
        return costs

    def resolve(self, num_segments: int) -> SegmentCosts:
        """Expand every field to one value per segment and check it.

        Raises:
            ScheduleError: listing every problem (wrong lengths, negative values, W > B, ...).
        """
        problems: list[str] = []
        fwd = _expand("forward", self.forward, num_segments, problems)
        bwd = _expand("backward", self.backward, num_segments, problems)
        wgt = _expand("backward_weight", self.backward_weight, num_segments, problems)
        act = _expand("activation_bytes", self.activation_bytes, num_segments, problems)
        msg = _expand("message_bytes", self.message_bytes, num_segments, problems)
        if any(w > b for w, b in zip(wgt, bwd, strict=True)):
            problems.append("costs.backward_weight must not exceed costs.backward (W is part of B)")
        if not (math.isfinite(self.latency) and self.latency >= 0):
            problems.append(f"costs.latency={self.latency}: must be a finite number >= 0")
        if not self.bandwidth > 0:
            problems.append(f"costs.bandwidth={self.bandwidth}: must be > 0 (inf for free transfers)")
        if problems:
            raise ScheduleError("invalid costs:\n" + "\n".join(f"  - {p}" for p in problems))
        message = tuple(self.latency + (b / self.bandwidth if b else 0.0) for b in msg)
        return SegmentCosts(fwd, bwd, tuple(b - w for b, w in zip(bwd, wgt, strict=True)), wgt, act, message)


@dataclass(frozen=True)
class SegmentCosts:
    """`Costs` expanded to one value per segment (what the simulator and the builders read).

    ``message[s]`` is the time of a message between segment ``s`` and ``s + 1`` in either direction.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    message: tuple[float, ...]
