"""Which weight-gradient actions of a zero-bubble plan stay apart: the cool-down's.

A zero-bubble plan splits each backward into I (input gradient, which the previous rank waits for)
and W (weight gradient, which nobody waits for). A W pays off where it fills time the rank would
otherwise idle: in the cool-down, after the rank's last forward, while the ranks before it finish
their last backwards. Before that, every round of the rank has a forward to run, and moving a W
from right after its I to after the next one moves work without removing idle time. Running a
backward in two passes is not free (a frontend walks the graph, and the weight pass reads the
activations again: on CPU, an HF Llama half's input pass + weight pass took 12-16 % longer than
one backward), so `cooldown_weights` keeps the W
actions of the cool-down apart and folds every earlier one into its I as one whole backward (B).
Given the segment costs, it keeps apart only the last ones of the cool-down, as many as shorten
the step once the split's own cost (`SPLIT_COST`) is counted: two Ws deferred past the last I
pay off only where the ranks before have that much work left to overlap.

Example (2 ranks, 4 microbatches; ZB-H1 defers one W on rank 1)::

    >>> from smp.pipeline.registry import build_plan
    >>> plan = build_plan("zb_h1", num_ranks=2, num_microbatches=4)
    >>> print(plan.orders())
    rank 0: F0 F1 I0 W0 F2 I1 W1 F3 I2 W2 I3 W3
    rank 1: F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3
    >>> print(cooldown_weights(plan, ranks={1}).orders())
    rank 0: F0 F1 B0 F2 B1 F3 B2 B3
    rank 1: F0 B0 F1 B1 F2 I2 F3 I3 W2 W3
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

from smp.pipeline.actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, Action, last_forward
from smp.pipeline.costs import Costs
from smp.pipeline.plan import Plan
from smp.pipeline.simulate import timed_walk

__all__ = ["SPLIT_COST", "cooldown_weights"]

# A backward run as I then W against one whole backward (`benchmarks/bench_pipeline.py --model
# split`: 1.14 on CPU for an HF Llama half; 1.2 inside a pipeline step on 2 cores).
SPLIT_COST = 1.15


def cooldown_weights(plan: Plan, ranks: Collection[int], costs: Costs | None = None) -> Plan:
    """``plan`` with W apart only where ``ranks`` run it after their last forward.

    Every other W (all of them on ranks not in ``ranks``) joins its I as one B at the I's place.
    With ``costs``, only the Ws of the last k Is of each such rank's cool-down stay apart, for the
    k whose plan is the shortest under ``costs`` with split backwards `SPLIT_COST` times as long
    (the fewest on a tie).

    Args:
        plan: a compute-only plan (one without W actions comes back equal).
        ranks: the ranks whose executor can run a backward in two parts.
        costs: the segment costs to choose k with.
    """
    most = max((sum(a.kind is BACKWARD_WEIGHT for a in acts[last_forward(acts) + 1:])
                for rank, acts in plan.actions.items() if rank in ranks), default=0)
    if costs is None or most == 0:  # nothing to choose (no W to keep apart: every non-zero-bubble plan)
        return _apart(plan, ranks, None)
    resolved = costs.resolve(plan.num_segments)
    split = replace(resolved, backward_input=tuple(SPLIT_COST * i for i in resolved.backward_input),
                    backward_weight=tuple(SPLIT_COST * w for w in resolved.backward_weight))
    best: tuple[float, Plan] | None = None
    for k in range(most + 1):
        candidate = _apart(plan, ranks, k)
        _, _, ends, _ = timed_walk(candidate, split)
        span = max((e[-1] for e in ends if e), default=0.0)
        if best is None or span < best[0] - 1e-9:
            best = (span, candidate)
    assert best is not None
    return best[1]


def _apart(plan: Plan, ranks: Collection[int], keep: int | None) -> Plan:
    """``plan`` with the last ``keep`` (None: all) Ws after each of ``ranks``' last forward apart
    and every other W folded into its I."""
    actions: dict[int, list[Action]] = {}
    for rank, acts in plan.actions.items():
        late = [(a.microbatch, a.segment) for a in acts[last_forward(acts) + 1:] if a.kind is BACKWARD_WEIGHT]
        apart = set(late if keep is None else late[len(late) - keep:]) if rank in ranks else set()
        out: list[Action] = []
        for a in acts:
            key = (a.microbatch, a.segment)
            if a.kind is BACKWARD_WEIGHT and key not in apart:
                continue
            if a.kind is BACKWARD_INPUT and key not in apart:
                a = replace(a, kind=BACKWARD)
            out.append(a)
        actions[rank] = out
    return replace(plan, actions=actions)
