"""The dependency walk: run every rank's action list in order, as far as the dependencies allow.

This is the one place that knows what an action waits for. The validator uses it to find orders
that cannot run (deadlocks, a backward before its forward), the grid uses it to place actions in
time steps, and the simulator uses it with real durations.

Dependencies of microbatch ``m`` in segment ``s`` of an ``S``-segment chain::

    F(m, s)      needs the activation of F(m, s-1)                 (s > 0)
    B/I(m, s)    needs F(m, s) and the input gradient of B/I(m, s+1) (s < S-1)
    W(m, s)      needs I(m, s)

A dependency produced on another rank is *remote*. In a compute-only plan a remote dependency is
met once its producer has finished (plus the message delay). In a lowered plan it is met only by
the matching receive earlier on the same rank, and a send and its receive run together when both
are at the head of their ranks' lists: the rendezvous of blocking point-to-point communication,
the strictest model (an order that runs under it also runs with buffered or non-blocking sends).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

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
)

__all__ = ["Key", "WalkResult", "Stuck", "walk", "data_deps", "produced_key", "matching_comm"]

# A produced value: ("F", m, s) = activation of segment s; ("G", m, s) = input gradient computed by
# B or I of segment s; ("W", m, s) = weight gradient done.
Key = tuple[str, int, int]


def data_deps(action: Action, num_segments: int) -> list[Key]:
    """The values a compute action consumes (see the module docstring)."""
    m, s = action.microbatch, action.segment
    kind = action.kind
    if kind is FORWARD:
        return [("F", m, s - 1)] if s > 0 else []
    if kind is BACKWARD or kind is BACKWARD_INPUT:
        deps: list[Key] = [("F", m, s)]
        if s < num_segments - 1:
            deps.append(("G", m, s + 1))
        return deps
    if kind is BACKWARD_WEIGHT:
        return [("G", m, s)]
    raise ValueError(f"{action} is not a compute action")


_TAG = {FORWARD: "F", BACKWARD: "G", BACKWARD_INPUT: "G", BACKWARD_WEIGHT: "W"}


def produced_key(action: Action) -> Key:
    """The value a compute action produces."""
    return (_TAG[action.kind], action.microbatch, action.segment)


def comm_key(action: Action) -> Key:
    """The value a message carries: a send's own segment, a receive's neighbour's."""
    m, s = action.microbatch, action.segment
    if action.kind is SEND_F:
        return ("F", m, s)
    if action.kind is RECV_F:
        return ("F", m, s - 1)
    if action.kind is SEND_B:
        return ("G", m, s)
    if action.kind is RECV_B:
        return ("G", m, s + 1)
    raise ValueError(f"{action} is not a message")


def matching_comm(action: Action, rank: int) -> Action:
    """The action the peer must run to complete this send or receive."""
    m, s = action.microbatch, action.segment
    if action.kind is SEND_F:
        return Action(RECV_F, m, s + 1, rank)
    if action.kind is RECV_F:
        return Action(SEND_F, m, s - 1, rank)
    if action.kind is SEND_B:
        return Action(RECV_B, m, s - 1, rank)
    return Action(SEND_B, m, s + 1, rank)


@dataclass(frozen=True)
class Stuck:
    """A rank that could not go on: its next action and why."""

    rank: int
    index: int
    reason: str
    needs: Key | None = None  # the value it waits for (compute actions)
    producer: int | None = None  # the rank that computes that value, if any


@dataclass
class WalkResult:
    """Start and end time of every action (per rank, list order) and what got stuck."""

    start: list[list[float]]
    end: list[list[float]]
    order: list[tuple[int, int]] = field(default_factory=list)  # (rank, index) in the order run
    stuck: list[Stuck] = field(default_factory=list)
    forced: list[tuple[int, int]] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """True when every action ran with its dependencies met."""
        return not self.stuck


def walk(
    actions: Sequence[Sequence[Action]],
    chain: Sequence[int],
    *,
    duration: Callable[[Action], float] = lambda a: 1.0,
    delay: Callable[[Action, Key], float] = lambda a, k: 0.0,
    force: bool = False,
) -> WalkResult:
    """Run the per-rank lists (index = rank) and time them.

    Args:
        actions: per rank, the actions in execution order.
        chain: segment -> rank.
        duration: time of one action (1 per action gives the grid's time steps).
        delay: extra time before a remote value reaches ``action`` (compute-only plans).
        force: when every rank is stuck, run the head of the earliest-free rank anyway (recorded in
            ``forced``) so that every action gets a time; used to draw invalid plans.

    Returns:
        A `WalkResult`; ``stuck`` lists each rank that stopped and why (empty when the order runs).
    """
    num_ranks = len(actions)
    num_segments = len(chain)
    lowered = any(a.kind in COMM_KINDS for acts in actions for a in acts)
    start: list[list[float]] = [[0.0] * len(acts) for acts in actions]
    end: list[list[float]] = [[0.0] * len(acts) for acts in actions]
    ptr = [0] * num_ranks
    free = [0.0] * num_ranks
    produced: dict[Key, float] = {}  # global: value -> time it was produced
    local: list[dict[Key, float]] = [{} for _ in range(num_ranks)]  # lowered: value -> time on rank
    waiting: dict[Key, list[int]] = {}
    forced: list[tuple[int, int]] = []
    order: list[tuple[int, int]] = []
    queue: deque[int] = deque(range(num_ranks))
    queued = [True] * num_ranks

    def wake(rank: int) -> None:
        if not queued[rank]:
            queued[rank] = True
            queue.append(rank)

    def finish(rank: int, t0: float, t1: float) -> None:
        i = ptr[rank]
        order.append((rank, i))
        start[rank][i] = t0
        end[rank][i] = t1
        free[rank] = t1
        ptr[rank] = i + 1

    def publish(rank: int, key: Key, t: float) -> None:
        local[rank][key] = t
        produced[key] = t
        for r in waiting.pop(key, ()):
            wake(r)

    def compute_ready(rank: int, a: Action) -> float | None:
        """When compute action ``a`` can start on ``rank``; None (and a wait is registered) if never yet."""
        kind, m, s = a.kind, a.microbatch, a.segment
        t = free[rank]
        if kind is FORWARD:
            if s <= 0:
                return t
            deps: tuple[Key, ...] = (("F", m, s - 1),)
        elif kind is BACKWARD_WEIGHT:
            deps = (("G", m, s),)
        elif s < num_segments - 1:
            deps = (("F", m, s), ("G", m, s + 1))
        else:
            deps = (("F", m, s),)
        for key in deps:
            ks = key[2]
            if lowered or not 0 <= ks < num_segments or chain[ks] == rank:
                got = local[rank].get(key)
                extra = 0.0
            else:
                got = produced.get(key)
                extra = delay(a, key) if got is not None else 0.0
            if got is None:
                waiting.setdefault(key, []).append(rank)
                return None
            if got + extra > t:
                t = got + extra
        return t

    def step(rank: int, ignore_deps: bool) -> int:
        """Run the head of ``rank`` if it can run; return how many actions ran (0, 1 or 2)."""
        a = actions[rank][ptr[rank]]
        if a.kind in COMPUTE_KINDS:
            t0 = free[rank] if ignore_deps else compute_ready(rank, a)
            if t0 is None:
                return 0
            finish(rank, t0, t0 + duration(a))
            publish(rank, produced_key(a), free[rank])
            return 1
        key = comm_key(a)
        peer = a.peer if a.peer is not None and 0 <= a.peer < num_ranks else rank
        if ignore_deps:
            t = free[rank]
            finish(rank, t, t + duration(a))
            if a.kind in (RECV_F, RECV_B):
                publish(rank, key, free[rank])
            return 1
        if a.kind in (SEND_F, SEND_B) and key not in local[rank]:
            waiting.setdefault(key, []).append(rank)
            return 0
        want = matching_comm(a, rank)
        if peer == rank or ptr[peer] >= len(actions[peer]) or actions[peer][ptr[peer]] != want:
            return 0  # the peer completes the pair when it reaches `want`
        send_rank, recv_rank = (rank, peer) if a.kind in (SEND_F, SEND_B) else (peer, rank)
        if key not in local[send_rank]:
            return 0  # the sender reports it: it sends a value it has not computed
        t = max(free[rank], free[peer], local[send_rank][key])
        finish(rank, t, t + duration(a))
        finish(peer, t, t + duration(want))
        publish(recv_rank, key, free[recv_rank])
        wake(peer)
        return 2

    remaining = sum(len(acts) for acts in actions)
    while remaining:
        while queue:
            r = queue.popleft()
            queued[r] = False
            while ptr[r] < len(actions[r]):
                ran = step(r, ignore_deps=False)
                if not ran:
                    break
                remaining -= ran
        if not remaining or not force:
            break
        r = min((x for x in range(num_ranks) if ptr[x] < len(actions[x])), key=lambda x: (free[x], x))
        forced.append((r, ptr[r]))
        step(r, ignore_deps=True)
        remaining -= 1
        wake(r)
        for x in range(num_ranks):
            wake(x)
    unfinished = any(ptr[r] < len(actions[r]) for r in range(num_ranks))
    stuck = _diagnose(actions, chain, ptr, local, produced, lowered) if unfinished and not force else []
    return WalkResult(start, end, order, stuck, forced)


def _diagnose(
    actions: Sequence[Sequence[Action]],
    chain: Sequence[int],
    ptr: list[int],
    local: list[dict[Key, float]],
    produced: dict[Key, float],
    lowered: bool,
) -> list[Stuck]:
    """Explain, for each rank that did not finish, what its next action waits for."""
    where: dict[Key, tuple[int, int]] = {}
    for rank, acts in enumerate(actions):
        for i, a in enumerate(acts):
            if a.is_compute:
                where.setdefault(produced_key(a), (rank, i))
    out: list[Stuck] = []
    num_segments = len(chain)
    for rank, acts in enumerate(actions):
        if ptr[rank] >= len(acts):
            continue
        a = acts[ptr[rank]]
        if a.is_comm:
            peer = a.peer if a.peer is not None else rank
            if a.kind in (SEND_F, SEND_B) and comm_key(a) not in local[rank]:
                reason = f"sends {_describe(comm_key(a))} before this rank has computed it"
            elif 0 <= peer < len(actions) and ptr[peer] < len(actions[peer]):
                reason = (
                    f"blocks until rank {peer} runs {matching_comm(a, rank)}, "
                    f"but rank {peer} is blocked at {actions[peer][ptr[peer]]}"
                )
            else:
                reason = f"blocks until rank {peer} runs {matching_comm(a, rank)}, which rank {peer} never runs"
            out.append(Stuck(rank, ptr[rank], reason))
            continue
        for key in data_deps(a, num_segments):
            here = not (0 <= key[2] < num_segments) or chain[key[2]] == rank
            have = key in local[rank] if (here or lowered) else key in produced
            if have:
                continue
            src = where.get(key)
            producer = None if src is None else src[0]
            if src is None:
                reason = f"needs {_describe(key)}, which no rank computes"
            elif src[0] == rank and src[1] > ptr[rank]:
                reason = f"needs {_describe(key)}, which this rank runs later (action #{src[1]})"
            elif lowered and not here:
                reason = f"needs {_describe(key)} from rank {src[0]} but has not received it"
            else:
                head = actions[src[0]][ptr[src[0]]] if ptr[src[0]] < len(actions[src[0]]) else None
                reason = f"needs {_describe(key)} from rank {src[0]}, which is blocked at {head}"
            out.append(Stuck(rank, ptr[rank], reason, key, producer))
            break
    return out


def _describe(key: Key) -> str:
    tag, m, s = key
    what = {"F": "the activation of", "G": "the input gradient of", "W": "the weight gradient of"}[tag]
    return f"{what} microbatch {m} in segment {s}"
