"""Zero-bubble schedules (Qi et al., 2401.10241): backward split into I (input grad) and W (weight grad).

I is on the critical path (the next rank waits for its gradient); W is not, so Ws are deferred
into what would otherwise be bubbles.
"""

from __future__ import annotations

from dataclasses import replace

from smp.pipeline.actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action, last_forward
from smp.pipeline.chains import vee_chain
from smp.pipeline.schedules.request import BuildRequest
from smp.pipeline.schedules.smp_v1 import build_interleaved
from smp.pipeline.schedules.template import Template, build_template
from smp.pipeline.validate import peak_held

__all__ = ["build_zb_h1", "build_zb_v", "merged_vee_chain"]


def build_zb_h1(request: BuildRequest) -> list[list[Action]]:
    """ZB-H1: 1F1B's warm-up and memory, with rank r deferring r weight-gradient passes.

    After the warm-up each round is F, I and, once r Ws are pending, the oldest W; the last r Ws
    fill the cool-down. With F = I = W the bubble is ``(p - 1) / (3 m)`` (a third of 1F1B's) and
    every rank holds at most p microbatches (1F1B's peak). 3 ranks, 4 microbatches, unit costs::

        time   0              5              10
        rank 0 F0|F1|F2|......I0|W0|F3|I1|W1|I2|W2|I3|W3|
        rank 1 ...F0|F1|...I0|F2|I1|W0|F3|I2|W1|I3|W2|W3|
        rank 2 ......F0|I0|F1|I1|F2|I2|W0|F3|I3|W1|W2|W3|

    On any chain the deferral of a rank is the number of segments before its first one.
    """
    return build_template(
        Template(depth=1, split_backward=True),
        num_ranks=request.num_ranks,
        num_microbatches=request.num_microbatches,
        chain=request.chain,
        active_microbatches=request.active_microbatches,
        label=request.name,
    )


def build_zb_v(request: BuildRequest) -> list[list[Action]]:
    """ZB-V: two segments per rank in a V (rank r runs segments r and 2p-1-r), I/W split.

    The order is the handcrafted one of the paper's section 6 as torch's ScheduleZBVZeroBubble
    writes it: rank r warms up with ``2(p-r)-1`` forwards of its first segment, then r pairs
    (second, first), then p-r rounds of (F, I, W) on its second segment, then alternates segments
    with F, I, W each, and drains. Each rank holds at most 2p segment activations, i.e. p
    microbatches of its whole share: 1F1B's peak. With F = I = W per segment and m >= 2p - 1 the
    bubble is half ZB-H1's. 2 ranks (chain ``0 1 1 0``), 3 microbatches::

        step rank0 rank1
        0    0F0   .
        1    0F1   1F0
        2    0F2   2F0
        3    3F0   1F1
        4    3I0   2F1
        5    3W0   2I0
        6    3F1   2W0
        7    3I1   1F2
        8    3W1   1I0
        9    0I0   1W0
        10   0W0   2F2
        11   3F2   2I1
        12   3I2   2W1
        13   3W2   1I1
        14   0I1   2I2
        15   0W1   1I2
        16   0I2   1W1
        17   0W2   2W2
        18   .     1W2

    An executor that runs a microbatch's consecutive segments on one rank as one visit records
    the V with its bottom merged (``0 1 0`` on 2 ranks, ``0 1 2 1 0`` on 3): that chain gets
    `_merged_vee_orders`. On any other chain, or with an ``active_microbatches`` cap below what
    this order holds (up to 2p - 1 microbatches on a rank, each with half its activations), it
    falls back to the ZB-H1 template on the same chain, which honours the cap.
    """
    p = request.num_ranks
    if p > 1 and request.chain == merged_vee_chain(p):
        return _merged_vee_orders(request)
    if request.chain != vee_chain(p, 2):
        return build_zb_h1(request)
    lists = _zbv_orders(p, request.num_microbatches)
    if peak_held(lists) > request.active_microbatches:
        return build_zb_h1(request)  # the template honours the cap on the same V
    return lists


def merged_vee_chain(p: int) -> tuple[int, ...]:
    """The V with its bottom rank's two segments as one: ``0 .. p-1 .. 0`` (``0 1 0`` on 2 ranks)."""
    return (*range(p), *range(p - 2, -1, -1))


def _merged_vee_orders(request: BuildRequest) -> list[list[Action]]:
    """The merged V: SMP v1's greedy rule (a ready backward first, lowest microbatch first) run on
    the segment costs, then each rank's backwards after its last forward split, their W last.

    On the V the first rank runs the first and the last segment, so the only idle time of a
    balanced split is the first segment's forward before the second rank starts and its backward
    after the second rank's last; the greedy order leaves no other gap (2 ranks, first and last
    segment a quarter of the model each: 8.3 microbatches' time for 8 against 9 for 1F1B on a
    2-stage split). The W actions at the end of the bottom rank then run beside the first rank's
    last backwards. The in-flight cap is the caller's, or 2p (the V's own peak).
    """
    cap = request.active_microbatches if request.capped else min(2 * request.num_ranks, request.num_microbatches)
    lists = build_interleaved(replace(request, active_microbatches=cap))
    out: list[list[Action]] = []
    for acts in lists:
        cool = last_forward(acts) + 1
        head, weights = list(acts[:cool]), []
        for a in acts[cool:]:
            if a.kind is BACKWARD:
                head.append(replace(a, kind=BACKWARD_INPUT))
                weights.append(replace(a, kind=BACKWARD_WEIGHT))
            else:
                head.append(a)
        out.append(head + weights)
    return out


def _zbv_orders(p: int, m: int) -> list[list[Action]]:
    # Built for max(2p-1, m) microbatches (enough to fill the V), then the missing ones are
    # dropped; what remains still runs because dropped microbatches take their dependencies along.
    n = max(2 * p - 1, m)
    return [[a for a in _zbv_rank(p, r, n) if a.microbatch < m] for r in range(p)]


def _zbv_rank(p: int, r: int, n: int) -> list[Action]:
    """Rank r's order for n microbatches (torch ScheduleZBVZeroBubble._calculate_single_rank_operations)."""
    segment = (r, 2 * p - 1 - r)  # chunk 0 on the way down, chunk 1 on the way back
    acts: list[Action] = []
    fwd_next, bwd_next = [0, 0], [0, 0]

    def fwd(chunk: int) -> None:
        acts.append(Action(FORWARD, fwd_next[chunk], segment[chunk]))
        fwd_next[chunk] += 1

    def bwd(chunk: int, weight_too: bool) -> None:
        acts.append(Action(BACKWARD_INPUT, bwd_next[chunk], segment[chunk]))
        if weight_too:
            acts.append(Action(BACKWARD_WEIGHT, bwd_next[chunk], segment[chunk]))
        bwd_next[chunk] += 1

    for _ in range(2 * (p - r) - 1):
        fwd(0)
    for _ in range(r):
        fwd(1)
        fwd(0)
    for _ in range(p - r):
        fwd(1)
        bwd(1, weight_too=True)
    while fwd_next[1] < fwd_next[0] or fwd_next[0] < n:
        if fwd_next[0] < n:
            fwd(0)
        bwd(0, weight_too=True)
        fwd(1)
        bwd(1, weight_too=True)
    weight_next = list(bwd_next)
    for _ in range(r):
        bwd(0, weight_too=False)
        bwd(1, weight_too=False)
    for _ in range(p - r):
        bwd(0, weight_too=False)
        acts.append(Action(BACKWARD_WEIGHT, weight_next[0], segment[0]))
        weight_next[0] += 1
    acts += [Action(BACKWARD_WEIGHT, i, segment[1]) for i in range(weight_next[1], bwd_next[1])]
    acts += [Action(BACKWARD_WEIGHT, i, segment[0]) for i in range(weight_next[0], bwd_next[0])]
    return acts
