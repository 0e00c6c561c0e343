"""The 1F1B template: warm-up forwards, then one forward / one backward, then the rest of the backwards.

Every static schedule of the 1F1B family (PipeDream-Flush, Megatron interleaving, ZB-H1) is, on
each rank, the same three phases over two fixed sequences:

    forwards  = the rank's (microbatch, segment) pairs, depth-first in groups of ``g`` microbatches
                key (m // g, s, m % g): g microbatches through the rank's first segment, the same
                g through its next segment, ..., then the next group
    backwards = the same pairs, key (m // g, -s, m % g)

    warm-up   w forwards
    steady    repeat: next forward (if any), next backward
              (split backward: I, then the oldest W once more than ``defer`` Ws are pending)
    cool-down the Ws still pending

``g`` is torch's rounds rule: ``rounds = max(1, m // p)``, ``g = ceil(m / rounds)`` (Megatron's
``g = p`` when ``p`` divides ``m``). The warm-up depth is where the schedules differ::

    w[r] = position of F(0, last segment of r) in r's forward sequence
           + depth * (number of segments after r's last segment)

``depth`` 1 is 1F1B / ZB-H1 (linear chain: ``p - 1 - r``), 2 is Megatron's interleaved schedule
(``2 (p - 1 - r) + (v - 1) g``). An ``active_microbatches`` cap stops a forward that would hold
one microbatch too many (a pending W, then a backward, runs instead), and smaller groups are
tried when the natural one cannot fit.

For a chain the papers did not consider (a V, a tied head) the formula may be too shallow to
run. The builder then walks the plan, finds a rank blocked at a backward while another rank waits
for one of its activations, and deepens that rank's warm-up by the forwards it owes; it repeats
until the plan runs. Warm-ups only grow and the all-forwards-first extreme always runs, so this
terminates. Such plans are valid but not tuned: simulate them against ``gpipe`` or SMP's
``interleaved`` before choosing.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from smp.errors import ScheduleError
from smp.pipeline.actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action
from smp.pipeline.chains import segments_by_rank
from smp.pipeline.validate import peak_held
from smp.pipeline.walk import walk

__all__ = ["Template", "group_size", "build_template"]


def group_size(num_ranks: int, num_microbatches: int) -> int:
    """Microbatches per depth-first group (see the module docstring)."""
    rounds = max(1, num_microbatches // max(num_ranks, 1))
    return max(1, math.ceil(num_microbatches / rounds))


@dataclass(frozen=True)
class Template:
    """Parameters of the 1F1B template.

    Attributes:
        depth: warm-up forwards per segment after the rank's last one (1: 1F1B, 2: Megatron).
        split_backward: run I and W instead of B.
        defer: per rank, how many Ws may wait before the oldest runs (ZB-H1: the number of
            segments before the rank's first one; ignored without a split backward).
    """

    depth: int
    split_backward: bool = False
    defer: tuple[int, ...] = ()


def _rank_order(
    forwards: list[tuple[int, int]],
    backwards: list[tuple[int, int]],
    warmup: int,
    template: Template,
    defer: int,
    cap: int,
) -> tuple[list[Action], bool]:
    """One rank's actions; the flag says whether the cap shortened a phase."""
    out: list[Action] = []
    remaining: dict[int, int] = {}
    for m, _ in forwards:
        remaining[m] = remaining.get(m, 0) + (3 if template.split_backward else 2)
    held: set[int] = set()

    def emit(action: Action) -> None:
        m = action.microbatch
        held.add(m)
        remaining[m] -= 1
        if not remaining[m]:
            held.discard(m)
        out.append(action)

    def forward_fits(i: int) -> bool:
        return forwards[i][0] in held or len(held) < cap

    fi = 0
    done: set[tuple[int, int]] = set()

    def forward() -> None:
        nonlocal fi
        emit(Action(FORWARD, *forwards[fi]))
        done.add(forwards[fi])
        fi += 1

    while fi < warmup and forward_fits(fi):
        forward()
    capped = fi < warmup
    pending: deque[tuple[int, int]] = deque()

    def flush_weights() -> None:
        # A deferred W keeps its microbatch held; run them when the cap needs the room.
        while pending and not forward_fits(fi):
            emit(Action(BACKWARD_WEIGHT, *pending.popleft()))

    for m, s in backwards:
        if fi < len(forwards):
            flush_weights()
            if forward_fits(fi):
                forward()
            else:
                capped = True
        while (m, s) not in done:
            flush_weights()
            forward()  # may exceed the cap: the caller then tries smaller groups
        if template.split_backward:
            emit(Action(BACKWARD_INPUT, m, s))
            pending.append((m, s))
            while len(pending) > defer:
                emit(Action(BACKWARD_WEIGHT, *pending.popleft()))
        else:
            emit(Action(BACKWARD, m, s))
    while pending:
        emit(Action(BACKWARD_WEIGHT, *pending.popleft()))
    return out, capped


def build_template(
    template: Template,
    *,
    num_ranks: int,
    num_microbatches: int,
    chain: Sequence[int],
    active_microbatches: int,
    label: str,
) -> list[list[Action]]:
    """Per-rank action lists of ``template`` on ``chain`` (see the module docstring).

    With a cap below what the natural group size needs, smaller groups are tried (down to 1).

    Raises:
        ScheduleError: no group size gives an order that runs within ``active_microbatches``.
    """
    chain = tuple(chain)
    natural = group_size(num_ranks, num_microbatches)
    sizes = [natural]
    if active_microbatches < num_microbatches:
        sizes += list(range(min(natural - 1, active_microbatches), 0, -1))
    reason = ""
    for g in sizes:
        lists, reason = _attempt(template, num_ranks, num_microbatches, chain, active_microbatches, g)
        if lists is not None and peak_held(lists) <= active_microbatches:
            return lists
        if lists is not None:
            reason = f"it would hold {peak_held(lists)} microbatches on some rank"
    raise ScheduleError(
        f"schedule {label!r} cannot keep active_microbatches={active_microbatches} on chain "
        f"{','.join(map(str, chain))} with {num_microbatches} microbatches: {reason}. "
        "Raise active_microbatches, or use 'interleaved' or 'simple', which honour any cap"
    )


def _attempt(
    template: Template, num_ranks: int, M: int, chain: tuple[int, ...], cap: int, g: int
) -> tuple[list[list[Action]] | None, str]:
    """The template with group size ``g``, its warm-ups deepened until it runs (or why not)."""
    S = len(chain)
    segs = segments_by_rank(chain, num_ranks)
    units = [[(m, s) for m in range(M) for s in segs[r]] for r in range(num_ranks)]
    forwards = [sorted(u, key=lambda x: (x[0] // g, x[1], x[0] % g)) for u in units]
    backwards = [sorted(u, key=lambda x: (x[0] // g, -x[1], x[0] % g)) for u in units]
    warmup = [0] * num_ranks
    for r in range(num_ranks):
        if segs[r]:
            last = segs[r][-1]
            warmup[r] = min(len(forwards[r]), forwards[r].index((0, last)) + template.depth * (S - 1 - last))
    defer = template.defer or tuple(segs[r][0] if segs[r] else 0 for r in range(num_ranks))
    position = [{u: i for i, u in enumerate(f)} for f in forwards]
    while True:
        lists = []
        capped = [False] * num_ranks
        for r in range(num_ranks):
            acts, capped[r] = _rank_order(forwards[r], backwards[r], warmup[r], template, defer[r], cap)
            lists.append(acts)
        stuck = walk(lists, chain).stuck
        if not stuck:
            return lists, ""
        # A rank blocked at a backward while another rank waits for one of its activations
        # started its 1F1B phase too early: deepen it by the forwards it still owes before that
        # backward. Otherwise deepen every stuck rank by one.
        blocked = {p.rank: p.index for p in stuck}
        extra: dict[int, int] = {}
        for p in stuck:
            y = p.producer
            if p.needs is None or p.needs[0] != "F" or y is None or y not in blocked:
                continue
            if lists[y][blocked[y]].kind is FORWARD:
                continue
            done = sum(1 for a in lists[y][: blocked[y]] if a.kind is FORWARD)
            owed = position[y][(p.needs[1], p.needs[2])] + 1 - done
            extra[y] = max(extra.get(y, 1), owed)
        deeper = False
        for plan_of_steps in (sorted(extra.items()), [(r, 1) for r in sorted(blocked)]):
            for r, more in plan_of_steps:
                if warmup[r] < len(forwards[r]) and not capped[r]:
                    warmup[r] = min(len(forwards[r]), warmup[r] + more)
                    deeper = True
            if deeper:
                break
        if not deeper:
            return None, f"rank {stuck[0].rank} {stuck[0].reason}"
