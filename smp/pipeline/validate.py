"""Validator: check a plan can run as written, and show the grid with the failing cells marked.

Checks, all collected before raising once (STYLE.md habits 12-13):

1. Shape: ranks, microbatches, chain, cap are sane; every action names a segment of the chain
   that runs on its own rank and a microbatch in range; messages name the right peer.
2. Completeness: every (microbatch, segment) has exactly one forward and, unless the plan is
   forward-only, exactly one backward: a B, or an I and a W.
3. Messages (lowered plans): every activation and gradient that crosses ranks has exactly one send
   and one receive; none crosses between segments on the same rank.
4. Order: the dependency walk (`smp.pipeline.walk`) runs every list to the end: each forward after
   its input, each backward after its forward and its gradient, each W after its I, and, in a
   lowered plan, each send meets its receive under blocking point-to-point (no deadlock).
5. In-flight cap: no rank holds more than ``active_microbatches`` microbatches, where a
   microbatch is held from its first to its last compute action on that rank. On the leader this
   is exactly SMP v1's admission count, and every other rank holds a subset of it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from smp.errors import ScheduleError
from smp.pipeline.actions import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    COMM_KINDS,
    COMPUTE_KINDS,
    FORWARD,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    ActionKind,
)
from smp.pipeline.chains import check_chain
from smp.pipeline.grid import format_grid
from smp.pipeline.plan import Plan
from smp.pipeline.walk import walk

__all__ = ["PlanProblem", "check_plan", "validate_plan", "peak_held"]

_SHOWN = 25  # problems printed in full; the rest are counted


@dataclass(frozen=True)
class PlanProblem:
    """One reason a plan is invalid; ``rank``/``index`` locate the cell when there is one."""

    message: str
    rank: int | None = None
    index: int | None = None

    def __str__(self) -> str:
        return self.message


def _expected_peer(action: Action, chain: tuple[int, ...]) -> int | None:
    s = action.segment
    other = {SEND_F: s + 1, RECV_F: s - 1, SEND_B: s - 1, RECV_B: s + 1}[action.kind]
    return chain[other] if 0 <= other < len(chain) else None


def check_plan(plan: Plan) -> list[PlanProblem]:
    """Every problem of ``plan`` (empty when it is valid). See the module docstring."""
    problems: list[PlanProblem] = []
    if plan.num_ranks < 1:
        problems.append(PlanProblem(f"num_ranks={plan.num_ranks}: must be >= 1"))
    if plan.num_microbatches < 1:
        problems.append(PlanProblem(f"num_microbatches={plan.num_microbatches}: must be >= 1"))
    if plan.active_microbatches < 1:
        problems.append(PlanProblem(f"active_microbatches={plan.active_microbatches}: must be >= 1"))
    problems += [PlanProblem(p) for p in check_chain(plan.chain, max(plan.num_ranks, 0))]
    extra = sorted(r for r in plan.actions if not 0 <= r < plan.num_ranks)
    if extra:
        problems.append(PlanProblem(f"actions given for rank(s) {extra} outside 0..{plan.num_ranks - 1}"))
    if problems:
        return problems
    problems += _check_actions(plan)
    if not problems:
        problems += _check_order(plan)
    problems += _check_cap(plan)
    return problems


def _check_actions(plan: Plan) -> list[PlanProblem]:
    out: list[PlanProblem] = []
    chain, S, M = plan.chain, plan.num_segments, plan.num_microbatches
    lowered = plan.is_lowered
    seen: Counter[tuple[ActionKind, int, int]] = Counter()
    backward_ok = not plan.forward_only
    for rank in range(plan.num_ranks):
        for i, a in enumerate(plan.actions[rank]):
            kind, m, s = a.kind, a.microbatch, a.segment
            key = (kind, m, s)
            seen[key] += 1
            if 0 <= s < S and chain[s] == rank and 0 <= m < M and seen[key] == 1 and (
                (kind in COMPUTE_KINDS and a.peer is None and (backward_ok or kind is FORWARD))
                or (kind in COMM_KINDS and _expected_peer(a, chain) == a.peer != rank)
            ):
                continue  # the common case: nothing to report
            out += _action_problems(plan, rank, i, a, seen[key])
    missing: list[str] = []
    for m in range(M):
        for s in range(S):
            needed = [FORWARD]
            if not plan.forward_only:
                split = seen[(BACKWARD_INPUT, m, s)] or seen[(BACKWARD_WEIGHT, m, s)]
                if split and seen[(BACKWARD, m, s)]:
                    out.append(PlanProblem(f"microbatch {m} segment {s} has both B and I/W; use one", chain[s]))
                needed += [BACKWARD_INPUT, BACKWARD_WEIGHT] if split else [BACKWARD]
            if lowered:
                needed += _messages(plan, s)
            missing += [f"{s}{k.value}{m}" for k in needed if not seen[(k, m, s)]]
    if missing:
        head = ", ".join(missing[:12]) + (f", ... ({len(missing)} in all)" if len(missing) > 12 else "")
        out.append(PlanProblem(f"missing actions: {head}"))
    return out


def _action_problems(plan: Plan, rank: int, i: int, a: Action, times_seen: int) -> list[PlanProblem]:
    """What is wrong with one action (called only for actions that fail the quick check)."""
    chain, S, M = plan.chain, plan.num_segments, plan.num_microbatches
    where = f"rank {rank} action #{i} ({a})"
    if not 0 <= a.segment < S:
        return [PlanProblem(f"{where}: segment {a.segment} is not in the chain (0..{S - 1})", rank, i)]
    out: list[PlanProblem] = []
    if chain[a.segment] != rank:
        out.append(PlanProblem(f"{where}: segment {a.segment} runs on rank {chain[a.segment]}, not here", rank, i))
    if not 0 <= a.microbatch < M:
        out.append(PlanProblem(f"{where}: microbatch {a.microbatch} is not in 0..{M - 1}", rank, i))
    if plan.forward_only and a.kind is not FORWARD and a.kind not in (SEND_F, RECV_F):
        out.append(PlanProblem(f"{where}: a forward-only plan has no backward work", rank, i))
    if a.is_compute and a.peer is not None:
        out.append(PlanProblem(f"{where}: a compute action has no peer", rank, i))
    if a.is_comm:
        peer = _expected_peer(a, chain)
        if peer is None:
            out.append(PlanProblem(f"{where}: there is no segment on the other side of this message", rank, i))
        elif peer == rank:
            out.append(PlanProblem(f"{where}: segments on the same rank exchange nothing; remove it", rank, i))
        elif a.peer != peer:
            out.append(PlanProblem(f"{where}: the peer of this message is rank {peer}", rank, i))
    if times_seen > 1:
        out.append(PlanProblem(f"{where}: runs twice", rank, i))
    return out


def _messages(plan: Plan, s: int) -> list[ActionKind]:
    """The message kinds segment ``s`` of a lowered plan must run for each microbatch."""
    chain, kinds = plan.chain, []
    if s + 1 < len(chain) and chain[s + 1] != chain[s]:
        kinds += [SEND_F] + ([] if plan.forward_only else [RECV_B])
    if s > 0 and chain[s - 1] != chain[s]:
        kinds += [RECV_F] + ([] if plan.forward_only else [SEND_B])
    return kinds


def _check_order(plan: Plan) -> list[PlanProblem]:
    result = walk(plan.rank_lists(), plan.chain)
    what = "deadlock or order error" if plan.is_lowered else "order error"
    return [PlanProblem(f"{what}: rank {s.rank} action #{s.index} {s.reason}", s.rank, s.index) for s in result.stuck]


def _check_cap(plan: Plan) -> list[PlanProblem]:
    out: list[PlanProblem] = []
    for rank in range(plan.num_ranks):
        acts = plan.actions.get(rank, [])
        last: dict[int, int] = {}
        for i, a in enumerate(acts):
            if a.is_compute:
                last[a.microbatch] = i
        held: set[int] = set()
        for i, a in enumerate(acts):
            if not a.is_compute:
                continue
            held.add(a.microbatch)
            if len(held) > plan.active_microbatches:
                out.append(
                    PlanProblem(
                        f"rank {rank} action #{i} ({a}): {len(held)} microbatches in flight "
                        f"({sorted(held)}), above active_microbatches={plan.active_microbatches}",
                        rank,
                        i,
                    )
                )
                break
            if last[a.microbatch] == i:
                held.discard(a.microbatch)
    return out


def peak_held(actions: Sequence[Sequence[Action]]) -> int:
    """Most microbatches any rank holds (from its first to its last compute action there)."""
    peak = 0
    for acts in actions:
        last = {a.microbatch: i for i, a in enumerate(acts) if a.is_compute}
        held: set[int] = set()
        for i, a in enumerate(acts):
            if a.is_compute:
                held.add(a.microbatch)
                peak = max(peak, len(held))
                if last[a.microbatch] == i:
                    held.discard(a.microbatch)
    return peak


def validate_plan(plan: Plan) -> None:
    """Raise if ``plan`` is invalid; the message lists every problem and shows the marked grid.

    Raises:
        ScheduleError: when `check_plan` finds anything.

    Example:
        >>> from smp.pipeline import parse_grid
        >>> bad = parse_grid('''
        ... plan custom ranks=2 microbatches=1 active=1 chain=0,1
        ... step rank0 rank1
        ... 0    0F0   1B0
        ... 1    0B0   1F0
        ... ''')
        >>> try:
        ...     validate_plan(bad)
        ... except ValueError as err:
        ...     print(str(err).splitlines()[2])
          - order error: rank 1 action #0 needs the activation of microbatch 0 in segment 1, which this rank runs later (action #1)
    """
    problems = check_plan(plan)
    if not problems:
        return
    lines = [f"invalid plan {plan.name!r} ({len(problems)} problem(s)):"]
    lines += [f"  - {p}" for p in problems[:_SHOWN]]
    if len(problems) > _SHOWN:
        lines.append(f"  ... and {len(problems) - _SHOWN} more")
    marks = {
        (p.rank, p.index): p.message
        for p in problems
        if p.rank is not None and p.index is not None and 0 <= p.rank < plan.num_ranks
    }
    if plan.num_ranks >= 1 and all(0 <= r < plan.num_ranks for r in plan.actions):
        try:
            lines += ["", format_grid(plan, {k: "see above" for k in marks}).split("\n\n")[0]]
        except (IndexError, KeyError, ValueError):
            pass  # a plan too broken to draw: the list above says why
    raise ScheduleError("\n".join(lines))
