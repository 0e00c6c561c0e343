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

from smp.pipeline.actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action
from smp.pipeline.plan import Plan

__all__ = ["cooldown_weights"]


def cooldown_weights(plan: Plan, ranks: Collection[int]) -> Plan:
    """``plan`` with W apart only where ``ranks`` run it after their last forward.

    Every other W (all of them on ranks not in ``ranks``) joins its I as one B at the I's place.

    Args:
        plan: a compute-only plan (one without W actions comes back equal).
        ranks: the ranks whose executor can run a backward in two parts.
    """
    actions: dict[int, list[Action]] = {}
    for rank, acts in plan.actions.items():
        last_forward = max((i for i, a in enumerate(acts) if a.kind is FORWARD), default=-1)
        apart = {(a.microbatch, a.segment) for i, a in enumerate(acts)
                 if a.kind is BACKWARD_WEIGHT and i > last_forward} if rank in ranks else set()
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
