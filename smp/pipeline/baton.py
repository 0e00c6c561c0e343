"""Which microbatch runs next on this rank: follow a static plan, or SMP v1's dynamic rule.

Microbatches are tasks (threads); each needs the rank's baton to run an *action*: everything a
microbatch does on this rank between control arriving (a request, a reply, the step body starting,
``model.backward``) and control leaving. Only the baton holder runs.

- Plan mode: the baton goes to the task whose (kind, microbatch) is the next action of this rank's
  plan, in order. A task asking for an action its microbatch's planned sequence does not have next
  (the model visited ranks in another order than the recorded chain) switches the rank to
  dynamic mode, and the engine tells its peers.
- Dynamic mode (SMP v1): ``interleaved`` runs a ready backward first, then forwards, lowest
  microbatch first, admitting new microbatches while fewer than ``active_microbatches`` are in
  flight; ``simple`` runs forwards first and admits microbatches in windows of ``active_microbatches``.

Framework-free on purpose: it only sees (kind, microbatch) pairs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from smp.errors import CommTimeoutError

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"  # WEIGHT: a split backward's weight gradients (zero bubble)

# Note [one wake-up per release]: a rank's microbatch threads all wait for the baton, up to one per
# microbatch (16 on the h512 Llama of benchmarks/bench_sweep.py), and a step hands it over at every
# action. With one condition for all, each release woke every waiting thread to find the one whose
# turn it is: each of them takes the lock and the GIL and goes back to sleep, on the core that the
# next action's kernels need. In plan mode the next holder is known (the plan's next action), so a
# release wakes only its thread; dynamic mode, light actions and the fallback still wake all.


class Baton:
    """The per-rank run token and the policy that hands it out.

    Args:
        plan: this rank's actions as (kind, microbatch) pairs, or None for dynamic mode.
        policy: "interleaved" or "simple" (dynamic mode and fallback).
        active_microbatches: the in-flight cap for admitting new microbatches (leader only).
        timeout_s: longest wait for the baton before failing (a plan that cannot progress).
        on_fallback: called once when plan mode turns dynamic (with the reason).
    """

    def __init__(self, plan: Sequence[tuple[str, int]] | None, policy: str, active_microbatches: int,
                 timeout_s: float, on_fallback: Callable[[str], None] | None = None,
                 expected: Sequence[tuple[str, int]] | None = None,
                 light_plan: Sequence[tuple[str, int]] = (), stall_s: float | None = None) -> None:
        # One lock, one condition per waiting microbatch: in plan mode a release wakes only the
        # thread whose action is next (Note [one wake-up per release]); light actions wait on `_cv`.
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._turns: dict[int, threading.Condition] = {}
        self.plan = list(plan) if plan is not None else None
        self.policy = policy
        self.active = max(1, active_microbatches)
        self.timeout_s = timeout_s
        # In plan mode, how long the baton may sit free with microbatches waiting before the plan is
        # given up: a microbatch that skips a planned visit to this rank (data-dependent control
        # flow) is invisible here, and the dynamic rule serves whoever is ready.
        self.stall_s = stall_s
        self._changed = time.monotonic()
        self.on_fallback = on_fallback
        self.cursor = 0
        self.holder: int | None = None
        self.waiting: dict[int, tuple[str, bool]] = {}
        self.started: set[int] = set()
        self.finished: set[int] = set()
        self.order: list[tuple[str, int]] = []  # what actually ran, for tests and timelines
        self.fallback_reason: str | None = None
        self._expected: dict[int, list[str]] = {}
        self.light_plan = list(light_plan)
        self.light_cursor = 0
        self.light_running = False
        if self.plan is not None:
            # Every action of each microbatch on this rank, light ones included (``expected``),
            # in order: an action out of this sequence means the chain changed.
            for kind, mb in (expected if expected is not None else self.plan):
                self._expected.setdefault(mb, []).append(kind)

    def next_planned(self, mb: int) -> str | None:
        """The kind of microbatch ``mb``'s next planned action on this rank (None: none, or no plan).

        An owner asks it after a backward: ``WEIGHT`` next means the plan runs that backward's weight
        gradients as an action of their own (zero bubble).
        """
        with self._cv:
            expected = self._expected.get(mb) if self.plan is not None else None
            return expected[0] if expected else None

    @property
    def dynamic(self) -> bool:
        return self.plan is None

    def go_dynamic(self, reason: str) -> None:
        with self._cv:
            self._go_dynamic_locked(reason, notify_peers=False)

    def _go_dynamic_locked(self, reason: str, notify_peers: bool) -> None:
        if self.plan is None:
            return
        self.plan = None
        self.fallback_reason = reason
        self._wake_all()
        if notify_peers and self.on_fallback is not None:
            self.on_fallback(reason)

    def _plan_allows(self, kind: str, mb: int) -> bool:
        assert self.plan is not None
        if self.cursor >= len(self.plan):
            self._go_dynamic_locked(f"microbatch {mb} asked for {kind} after the plan ended", True)
            return False
        return self.plan[self.cursor] == (kind, mb)

    def _check_expected(self, kind: str, mb: int) -> None:
        expected = self._expected.get(mb)
        if not expected or expected[0] != kind:
            want = expected[0] if expected else "nothing"
            self._go_dynamic_locked(f"microbatch {mb} asked for {kind} where the plan expects {want}", True)
        else:
            expected.pop(0)

    def _dynamic_allows(self, kind: str, mb: int, new: bool) -> bool:
        if new and any(m not in self.started for m in range(mb)):
            # New microbatches are admitted in index order (SMP v1), whatever order their threads
            # reach the baton in: TP peers in other pipelines and buffers depend on it.
            return False
        if new:
            in_flight = len(self.started - self.finished)
            if self.policy == "simple":
                unfinished = [m for m in self.started if m not in self.finished]
                window = (min(unfinished) if unfinished else mb) // self.active
                if mb // self.active != window and unfinished:
                    return False
                if in_flight >= self.active:
                    return False
            elif in_flight >= self.active:
                return False
        first = BACKWARD if self.policy != "simple" else FORWARD
        mine = (0 if kind == first else 1, mb)
        for other, (okind, onew) in self.waiting.items():
            if other == mb:
                continue
            if onew and not self._admissible(other):
                continue
            if (0 if okind == first else 1, other) < mine:
                return False
        return True

    def _admissible(self, mb: int) -> bool:
        in_flight = len(self.started - self.finished)
        return in_flight < self.active

    def acquire(self, kind: str, mb: int, *, new: bool = False) -> None:
        """Block until microbatch ``mb`` may run its next ``kind`` action on this rank."""
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            turn = self._turns.get(mb)
            if turn is None:  # once per microbatch, not per action
                turn = self._turns[mb] = threading.Condition(self._lock)
            if self.plan is not None:
                self._check_expected(kind, mb)
            self.waiting[mb] = (kind, new)
            try:
                while True:
                    if self.holder is None:
                        if self.plan is not None:
                            if self._plan_allows(kind, mb):
                                self.cursor += 1
                                break
                        elif self._dynamic_allows(kind, mb, new):
                            break
                    now = time.monotonic()
                    if (self.plan is not None and self.stall_s is not None and self.holder is None
                            and now - self._changed > self.stall_s):
                        self._go_dynamic_locked(
                            f"the baton stayed free {now - self._changed:.1f} s while microbatches "
                            f"{sorted(self.waiting)} waited for planned action {self.cursor} "
                            f"({self.plan[self.cursor] if self.cursor < len(self.plan) else 'end'})", True)
                        continue
                    left = deadline - now
                    if left <= 0:
                        raise CommTimeoutError(
                            f"microbatch {mb} waited {self.timeout_s:g} s to run {kind} on this rank "
                            f"(plan position {self.cursor}, holder {self.holder}, waiting {sorted(self.waiting)})")
                    turn.wait(min(left, 1.0, self.stall_s or 1.0))
            finally:
                del self.waiting[mb]
            self.holder = mb
            self._changed = time.monotonic()
            if new:
                self.started.add(mb)
            self.order.append((kind, mb))

    def acquire_light(self, kind: str, mb: int) -> bool:
        """Start a light action beside the baton holder, in the plan's order of light actions.

        Light actions run one at a time among themselves and in plan order, so a module in a light
        segment (a BatchNorm, say) still sees the microbatches in the same order as planned. Returns
        False in dynamic mode (or when the step left the plan): run it as a normal action then.
        """
        deadline = time.monotonic() + self.timeout_s
        with self._cv:
            if self.plan is None:
                return False
            self._check_expected(kind, mb)
            while True:
                if self.plan is None or self.light_cursor >= len(self.light_plan):
                    if self.plan is not None:
                        self._go_dynamic_locked(f"microbatch {mb} asked for a light {kind} after the plan ended", True)
                    return False
                if not self.light_running and self.light_plan[self.light_cursor] == (kind, mb):
                    break
                if (kind, mb) not in self.light_plan[self.light_cursor:]:
                    self._go_dynamic_locked(f"microbatch {mb} asked for a light {kind} the plan does not have", True)
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeoutError(f"microbatch {mb} waited {self.timeout_s:g} s to run a light {kind}")
                self._cv.wait(min(left, 1.0))
            self.light_running = True
            self.order.append((kind, mb))
            return True

    def release_light(self, *, finished_mb: int | None = None) -> None:
        with self._cv:
            self.light_running = False
            self.light_cursor += 1
            if finished_mb is not None:
                self.finished.add(finished_mb)
            self._wake_all()

    def release(self, *, finished: bool = False) -> None:
        """Give the baton back; ``finished`` marks the holder's microbatch as done (leader)."""
        with self._cv:
            if finished and self.holder is not None:
                self.finished.add(self.holder)
            self.holder = None
            self._changed = time.monotonic()
            if self.plan is not None and self.cursor < len(self.plan):
                turn = self._turns.get(self.plan[self.cursor][1])
                if turn is not None:
                    turn.notify_all()
            else:
                self._wake_all()

    def _wake_all(self) -> None:
        """Wake every waiting thread (the caller holds the lock): dynamic mode decides among them all."""
        self._cv.notify_all()
        for turn in self._turns.values():
            turn.notify_all()
