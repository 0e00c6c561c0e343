"""SMP v1's dynamic schedules (`interleaved`, `simple`), GPipe and forward-only, as greedy rules.

SMP v1 decided at run time which microbatch runs next. Here the same rule is simulated with the
segment costs (`smp.pipeline.greedy`) and the order it produces becomes the static plan. Without
costs, every action takes one time unit and messages are free (see `build_interleaved` for why).
"""

from __future__ import annotations

from smp.pipeline.actions import BACKWARD, FORWARD, Action
from smp.pipeline.costs import Costs, SegmentCosts
from smp.pipeline.greedy import Ready, Rule, Unit, run_rule
from smp.pipeline.schedules.request import BuildRequest

__all__ = [
    "InterleavedRule",
    "WindowRule",
    "ForwardOnlyRule",
    "build_interleaved",
    "build_simple",
    "build_gpipe",
    "build_only_forward",
]


def _first_forward(rule: Rule, ready: Ready, cap: int) -> Unit | None:
    """The lowest ready forward; a new microbatch only while fewer than ``cap`` are in flight.

    Looking at the head is enough: the only new microbatch on offer is the next one to admit,
    whose index is above every admitted one, so it heads the queue only when it is alone.
    """
    head = ready.head(FORWARD)
    if head is None or (head[1] == 0 and rule.state.in_flight >= cap):
        return None
    return (FORWARD, *head)


class InterleavedRule(Rule):
    """SMP v1 ``interleaved``: backward first, lowest microbatch first, admission capped."""

    def __init__(self, active_microbatches: int) -> None:
        self.cap = active_microbatches

    def choose(self, rank: int, ready: Ready, now: float) -> Unit | None:
        head = ready.head(BACKWARD)
        if head is not None:
            return (BACKWARD, *head)
        return _first_forward(self, ready, self.cap)


class WindowRule(Rule):
    """SMP v1 ``simple`` (and GPipe with one window): forwards of a window, then its backwards."""

    def __init__(self, window: int, num_microbatches: int, num_ranks: int, chain: tuple[int, ...]) -> None:
        self.window = window
        self.num_microbatches = num_microbatches
        self.local_segments = [chain.count(r) for r in range(num_ranks)]
        self.forwards_started: dict[tuple[int, int], int] = {}
        self.open_window = 0
        self.finished_in_window = 0

    def _forwards_left(self, rank: int, window: int) -> int:
        size = min(self.window, self.num_microbatches - window * self.window)
        return size * self.local_segments[rank] - self.forwards_started.get((rank, window), 0)

    def choose(self, rank: int, ready: Ready, now: float) -> Unit | None:
        # Heads suffice: ready backwards of a later window wait behind those of an earlier one,
        # and the next window's first microbatch heads the forwards only when it is alone.
        back = ready.head(BACKWARD)
        if back is not None and self._forwards_left(rank, back[0] // self.window) == 0:
            return (BACKWARD, *back)
        head = ready.head(FORWARD)
        if head is None or (head[1] == 0 and head[0] // self.window != self.open_window):
            return None
        return (FORWARD, *head)

    def on_start(self, rank: int, unit: Unit, now: float) -> None:
        kind, m, _ = unit
        if kind is FORWARD:
            key = (rank, m // self.window)
            self.forwards_started[key] = self.forwards_started.get(key, 0) + 1

    def on_end(self, rank: int, unit: Unit, now: float) -> None:
        kind, m, s = unit
        if kind is BACKWARD and s == 0:
            self.finished_in_window += 1
            size = min(self.window, self.num_microbatches - self.open_window * self.window)
            if self.finished_in_window == size:
                self.open_window += 1
                self.finished_in_window = 0


class ForwardOnlyRule(Rule):
    """Forwards only, lowest microbatch first, admission capped."""

    forward_only = True

    def __init__(self, active_microbatches: int) -> None:
        self.cap = active_microbatches

    def choose(self, rank: int, ready: Ready, now: float) -> Unit | None:
        return _first_forward(self, ready, self.cap)


def slot_costs(num_segments: int) -> SegmentCosts:
    """One time unit per action (F = B = I = W = 1), free messages: the default of the dynamic rules."""
    return Costs(forward=1.0, backward=1.0, backward_weight=0.5).resolve(num_segments)


def _run(rule: Rule, request: BuildRequest) -> list[list[Action]]:
    return run_rule(
        rule,
        num_ranks=request.num_ranks,
        num_microbatches=request.num_microbatches,
        chain=request.chain,
        costs=request.costs or slot_costs(len(request.chain)),
        label=request.name,
    )


def build_interleaved(request: BuildRequest) -> list[list[Action]]:
    """SMP v1 ``interleaved``: a ready backward first, lowest microbatch first, capped admission.

    On every rank a ready backward runs first (lowest microbatch); otherwise the lowest ready
    forward. The leader admits a new microbatch only while fewer than ``active_microbatches``
    are in flight (admitted, backward of segment 0 not finished).

    Which costs reproduce SMP v1's documented order: a backward exactly as long as a forward,
    free messages, and a backward finished at time t visible to a rank choosing at t. That is
    the default (one time unit per action, like torch's slot simulator). 3 ranks,
    ``active_microbatches=5`` (SMP v1's pp + 2), 8 microbatches, drawn by `render_ascii`::

        time   0              5              10             15             20
        rank 0 F0|F1|F2|F3|F4|B0|F5|B1|F6|B2|F7|B3|...B4|...B5|...B6|...B7|
        rank 1 ...F0|F1|F2|B0|F3|B1|F4|B2|F5|B3|F6|B4|F7|B5|...B6|...B7|
        rank 2 ......F0|B0|F1|B1|F2|B2|F3|B3|F4|B4|F5|B5|F6|B6|F7|B7|

    which is the SMP v1 code comment's ``gpu2: F0 B0 F1 B1 F2 B2``, ``gpu1: F0 F1 F2 B0 F3 B1``,
    ``gpu0: F0 F1 F2 F3 F4 B0 F5 B1``. At t = 4 rank 1 has B0 (finished by rank 2 at 4) and F3
    (finished by rank 0 at 4) ready and takes the backward; with B = 2F, B0 would arrive at 5
    and F3 would run first.
    """
    return _run(InterleavedRule(request.active_microbatches), request)


def build_simple(request: BuildRequest) -> list[list[Action]]:
    """SMP v1 ``simple``: windows of ``active_microbatches``, forwards of a window then its backwards.

    Every rank finishes its forwards of a window before any backward of it; the next window
    enters when the whole window is done. 2 ranks, 4 microbatches, ``active_microbatches=2``,
    one time unit per action::

        time   0              5              10
        rank 0 F0|F1|......B0|B1|F2|F3|......B2|B3|
        rank 1 ...F0|F1|B0|B1|......F2|F3|B2|B3|
    """
    return _run(WindowRule(request.active_microbatches, request.num_microbatches, request.num_ranks, request.chain), request)


def build_gpipe(request: BuildRequest) -> list[list[Action]]:
    """GPipe: fill, then drain (one window of all microbatches unless ``active_microbatches`` is set).

    2 ranks, 3 microbatches, one time unit per action::

        time   0              5
        rank 0 F0|F1|F2|......B0|B1|B2|
        rank 1 ...F0|F1|F2|B0|B1|B2|

    Every rank holds all m microbatches; the bubble is (p - 1) / m.
    """
    return _run(WindowRule(request.active_microbatches, request.num_microbatches, request.num_ranks, request.chain), request)


def build_only_forward(request: BuildRequest) -> list[list[Action]]:
    """Forward-only plan for evaluation steps: the lowest ready forward first.

    The leader admits a microbatch while fewer than ``active_microbatches`` have not finished
    their last forward, which shapes the order on chains that revisit a rank (the validator
    checks that no rank holds more between its first and last forward of a microbatch). On a
    linear chain each rank holds one microbatch at a time. 3 ranks, 5 microbatches::

        time   0              5
        rank 0 F0|F1|F2|F3|F4|
        rank 1 ...F0|F1|F2|F3|F4|
        rank 2 ......F0|F1|F2|F3|F4|
    """
    return _run(ForwardOnlyRule(request.active_microbatches), request)
