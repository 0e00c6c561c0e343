"""The pipeline engine: SMP v1's leader/follower execution of one step across a pipeline.

Every pipeline rank runs `Engine.run_step`. The step body runs on the leader (pp_rank 0), once per
microbatch, each microbatch in its own thread. When a microbatch's code calls a module owned by
another pipeline rank, the call becomes a request: the owner runs the module's forward in that
microbatch's thread on its side, keeps the autograd graph, and replies with the outputs. The
requester's side of the call is an autograd Function, so backward crosses back the same way: its
backward sends the output gradients to the owner, which runs backward on the kept graph and replies
with the input gradients. A microbatch is one logical thread of control hopping between ranks; a
thread waiting for a reply also serves the nested requests of its own microbatch (ping-pong
chains such as 0 -> 1 -> 0 -> 1 -> 0).

Which microbatch runs next on a rank is the `Baton`'s decision (order.py): the static plan from the
shared scheduler, built from the chain of ranks microbatch 0 visited on the first step, or SMP v1's
dynamic rule on the first step and whenever a step strays from the recorded chain.

Message kinds: forward request/reply, backward request/reply, error, done (the leader's results
for the followers), stop (end of a rank's sending), dynamic (a peer fell back to the dynamic rule).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from smp.errors import RemoteRankError, SMPError
from smp.pipeline.baton import BACKWARD, FORWARD, Baton

from ..runtime import failure
from .wire import Message, Transport, pack, unpack

logger = logging.getLogger("smp")

FWD_REQ, FWD_REP, BWD_REQ, BWD_REP, ERROR, DONE, STOP, DYNAMIC, TASK_END = range(1, 10)
# How often the dispatcher, between messages, checks for a failed or vanished peer (runtime/failure.py).
_POLL_S = 0.2

# The task a thread runs, set and cleared by `_task_main` around each task: scoped to one step,
# so there is nothing here for smp.reset() to drop.
_local = threading.local()

# Note [task lifetime]: a step's tasks must be freed by reference counting when the step ends.
# A tensor the step body computes from a cross-rank call (a loss, the logits the step returns)
# owns an autograd graph whose `_RemoteCall` node holds its ctx, and the ctx holds the call. If
# the call held its task strongly, task -> result -> graph -> ctx -> call -> task would be a cycle
# that runs through C++ autograd nodes, which the cyclic GC cannot traverse: every step's tasks,
# results and graphs (the full logits of every microbatch) would stay alive for good. So a call
# refers to its task weakly, and `run_step` drops the step's tasks before it returns.


def current_task() -> Task | None:
    """The microbatch task running on this thread, if any."""
    return getattr(_local, "task", None)


@dataclass
class Event:
    """One action as it ran: for measured timelines (``ordinal``: its index among the microbatch's
    actions of that kind on this rank)."""

    kind: str
    microbatch: int
    start: float
    end: float = 0.0
    ordinal: int = 0
    light: bool = False


@dataclass
class Task:
    """A microbatch's thread of control on this rank."""

    engine: Engine
    microbatch: int
    inbox: queue.SimpleQueue[Message] = field(default_factory=queue.SimpleQueue)
    saved: dict[tuple[int, int], tuple[list[torch.Tensor | None], list[torch.Tensor], list[bool]]] = field(
        default_factory=dict)
    calls: int = 0
    trail: list[int] = field(default_factory=list)
    chain: list[int] | None = None
    result: Any = None
    error: BaseException | None = None
    counts: dict[str, int] = field(default_factory=dict)
    in_light: bool = False
    grad_enabled: bool = True
    backward_called: bool = False


class _Worker:
    """A long-lived thread that runs one microbatch index's task every step.

    Threads are kept across steps on purpose: a fresh thread pays per-thread warm-up in the math
    libraries (measured: a GEMM-heavy forward ~20 % slower on a new thread than on a warm one).
    """

    def __init__(self, name: str) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        while True:
            self.jobs.get()()


class _Stop(Exception):
    """Unwinds a task thread when the step ends or fails elsewhere."""


class _RemoteCall(torch.autograd.Function):
    """The requester's side of a cross-rank module call, visible to autograd."""

    @staticmethod
    def forward(ctx: Any, call: dict[str, Any], anchor: torch.Tensor, *tensors: torch.Tensor) -> Any:  # noqa: ARG004
        engine: Engine = call["engine"]
        outs, flags = engine._forward_exchange(call, tensors)
        ctx.call = call
        ctx.needs = [t.requires_grad for t in tensors]
        ctx.flags = flags
        ctx.mark_non_differentiable(*[o for o, f in zip(outs, flags) if not f])
        ctx.set_materialize_grads(False)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        call = ctx.call
        engine: Engine = call["engine"]
        sent = [g if f else None for g, f in zip(grads, ctx.flags)]
        in_grads = engine._backward_exchange(call, sent, ctx.needs)
        return (None, None, *in_grads)


_ANCHOR = torch.empty(0, requires_grad=True)


def _call_task(call: dict[str, Any]) -> Task:
    """The task a cross-rank call belongs to (held weakly: see Note [task lifetime])."""
    task: Task | None = call["task"]()
    if task is None:
        raise SMPError(
            f"backward reached the cross-rank call of module {call['path']!r} after its @smp.step call ended; "
            "the pipeline runs a microbatch's backward only inside the step. Fix: call model.backward(loss) "
            "inside the @smp.step function (outputs returned with detach_outputs=False cannot be "
            "backpropagated through the pipeline afterwards)")
    return task


class Engine:
    """Runs steps for one model on one pipeline.

    Args:
        transport: messages among this pipeline's ranks.
        pp_ranks: global ranks of the pipeline, by pp_rank.
        pp_rank: this rank's pp_rank.
        run_local: ``run_local(path, span, args, kwargs)`` runs a module (or a span of an
            ``nn.Sequential``'s children) that this rank owns.
        timeout_s: longest wait for any message.
    """

    def __init__(self, transport: Transport, pp_ranks: Sequence[int], pp_rank: int,
                 run_local: Callable[[str, tuple[int, int] | None, tuple[Any, ...], dict[str, Any]], Any],
                 timeout_s: float) -> None:
        self.transport = transport
        self.pp_ranks = list(pp_ranks)
        self.pp_rank = pp_rank
        self.run_local = run_local
        self.timeout_s = timeout_s
        self.tasks: dict[int, Task] = {}
        self.baton: Baton | None = None
        self.events: list[Event] = []
        self._open: dict[int, Event] = {}
        self._workers: dict[int, _Worker] = {}
        # (kind, ordinal) of this rank's actions that are short relative to its others: they run
        # without the baton, next to the holder (see `mark_light`).
        self.light: set[tuple[str, int]] = set()
        self.strict_order = False

    # --- baton with timeline -----------------------------------------------------------------

    def _acquire(self, task: Task, kind: str, *, new: bool = False) -> None:
        assert self.baton is not None
        ordinal = task.counts.get(kind, 0)
        task.counts[kind] = ordinal + 1
        light = (kind, ordinal) in self.light and not new and self.baton.acquire_light(kind, task.microbatch)
        task.in_light = light
        if not light:
            self.baton.acquire(kind, task.microbatch, new=new)
        ev = Event(kind, task.microbatch, time.time(), ordinal=ordinal, light=light)
        self._open[task.microbatch] = ev
        self.events.append(ev)

    def _release(self, task: Task, *, finished: bool = False) -> None:
        assert self.baton is not None
        ev = self._open.pop(task.microbatch, None)
        if ev is not None:
            ev.end = time.time()
        if task.in_light:
            task.in_light = False
            self.baton.release_light(finished_mb=task.microbatch if finished else None)
            return
        self.baton.release(finished=finished)

    @staticmethod
    def durations(events: Sequence[Event]) -> dict[tuple[str, int], float]:
        """Median seconds of each (kind, ordinal) action of this rank in ``events``."""
        by: dict[tuple[str, int], list[float]] = {}
        for e in events:
            if e.end:
                by.setdefault((e.kind, e.ordinal), []).append(e.end - e.start)
        return {k: sorted(v)[len(v) // 2] for k, v in by.items()}

    def mark_light(self, durations: dict[tuple[str, int], float], share: float = 0.15) -> set[tuple[str, int]]:
        """Choose the light actions from this rank's measured (kind, ordinal) durations.

        A microbatch's short stop on a rank between two long actions of other ranks (the leader's
        loss between the last stage's forward and backward, a parent's glue between two children on
        another rank) would otherwise wait for whatever long action holds the baton, and the
        other ranks wait with it. Actions whose median time is below ``share`` of this rank's
        longest kind of action run beside the baton holder instead; they cost the holder little.
        """
        top = max(durations.values(), default=0.0)
        # The leader's first forward admits a new microbatch: that one always follows the plan.
        self.light = {k for k, v in durations.items() if top > 0 and v < share * top
                      and not (self.pp_rank == 0 and k == (FORWARD, 0))}
        return self.light

    # --- requester side ------------------------------------------------------------------------

    def remote_forward(self, owner: int, path: str, span: tuple[int, int] | None, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> Any:
        """Call a module owned by pipeline rank ``owner`` from the current microbatch task."""
        task = current_task()
        assert task is not None
        skeleton, tensors = pack((args, kwargs))
        task.calls += 1
        call = {"engine": self, "owner": owner, "path": path, "span": span, "skeleton": skeleton,
                "id": (self.pp_rank, task.calls), "task": weakref.ref(task),  # Note [task lifetime]
                "grad": torch.is_grad_enabled()}
        if call["grad"]:
            outs = _RemoteCall.apply(call, _ANCHOR, *tensors)
        else:
            outs, _ = self._forward_exchange(call, tensors)
        return unpack(call["out_skeleton"], list(outs))

    def _send(self, pp_dst: int, kind: int, mb: int, body: Any, tensors: Sequence[torch.Tensor] = ()) -> None:
        self.transport.send(self.pp_ranks[pp_dst], kind, mb, body, list(tensors))

    def _forward_exchange(self, call: dict[str, Any], tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor],
                                                                                               list[bool]]:
        task = _call_task(call)
        body = {"id": call["id"], "path": call["path"], "span": call["span"], "skeleton": call["skeleton"],
                "grad": call["grad"], "trail": task.trail, "needs": [t.requires_grad for t in tensors]}
        self._send(call["owner"], FWD_REQ, task.microbatch, body, tensors)
        self._release(task)
        reply = self._serve(task, until=call["id"], peer=call["owner"])
        task.trail = reply.body["trail"] + [self.pp_rank]
        call["out_skeleton"] = reply.body["skeleton"]
        return reply.tensors, reply.body["flags"]

    def _backward_exchange(self, call: dict[str, Any], grads: Sequence[torch.Tensor | None],
                           needs: Sequence[bool]) -> list[torch.Tensor | None]:
        task = _call_task(call)
        mask = [g is not None for g in grads]
        self._send(call["owner"], BWD_REQ, task.microbatch, {"id": call["id"], "mask": mask},
                   [g for g in grads if g is not None])
        self._release(task)
        reply = self._serve(task, until=call["id"], peer=call["owner"])
        it = iter(reply.tensors)
        got = [next(it) if m else None for m in reply.body["mask"]]
        return [g if need else None for g, need in zip(got, needs)]

    # --- owner side ------------------------------------------------------------------------------

    def _handle_forward(self, task: Task, msg: Message) -> None:
        body = msg.body
        leaves: list[torch.Tensor | None] = []
        tensors = []
        for t, need in zip(msg.tensors, body["needs"]):
            if need and body["grad"]:
                t = t.requires_grad_(True)
                leaves.append(t)
            else:
                leaves.append(None)
            tensors.append(t)
        args, kwargs = unpack(body["skeleton"], tensors)
        task.trail = body["trail"] + [self.pp_rank]
        with torch.set_grad_enabled(body["grad"]):
            out = self.run_local(body["path"], body["span"], args, kwargs)
        skeleton, outs = pack(out)
        flags = [body["grad"] and o.requires_grad for o in outs]
        if any(flags):
            task.saved[body["id"]] = (leaves, outs, flags)
        self._send(msg.src_pp, FWD_REP, task.microbatch, {"id": body["id"], "skeleton": skeleton,
                                                           "flags": flags, "trail": task.trail},
                   [o.detach() for o in outs])
        self._release(task)

    def _handle_backward(self, task: Task, msg: Message) -> None:
        body = msg.body
        leaves, outs, flags = task.saved.pop(body["id"], ([], [], []))
        it = iter(msg.tensors)
        grads = [next(it) if m else None for m in body["mask"]]
        pairs = [(o, g) for o, g, f in zip(outs, grads, flags) if f and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        in_grads = [leaf.grad if leaf is not None else None for leaf in leaves]
        mask = [g is not None for g in in_grads]
        self._send(msg.src_pp, BWD_REP, task.microbatch, {"id": body["id"], "mask": mask},
                   [g for g in in_grads if g is not None])
        self._release(task)

    def _serve(self, task: Task, until: tuple[int, int] | None, peer: int | None = None) -> Message:
        """Wait for the reply ``until`` from pp_rank ``peer`` (or, with None, serve until the step ends)."""
        while True:
            try:
                msg = task.inbox.get(timeout=self.timeout_s)
            except queue.Empty:
                what = f"microbatch {task.microbatch} on pp_rank {self.pp_rank} waited for "
                if peer is not None:
                    raise failure.stalled_error(self.pp_ranks[peer], what + f"the reply of pp_rank {peer}",
                                                self.timeout_s) from None
                raise failure.timeout_error(what + "a pipeline message", self._peer_ranks(), self.timeout_s) from None
            kind = msg.kind
            if kind == FWD_REP or kind == BWD_REP:
                if until is None or msg.body["id"] != until:
                    raise RuntimeError(f"unexpected reply {msg.body['id']} for microbatch {task.microbatch}")
                self._acquire(task, FORWARD if kind == FWD_REP else BACKWARD)
                return msg
            if kind == FWD_REQ:
                self._acquire(task, FORWARD)
                self._handle_forward(task, msg)
            elif kind == BWD_REQ:
                self._acquire(task, BACKWARD)
                self._handle_backward(task, msg)
            elif kind == DONE:
                raise _Stop()
            elif kind == ERROR:
                raise RemoteRankError(msg.body["rank"], msg.body["text"])
            else:
                raise RuntimeError(f"unexpected message kind {kind} for microbatch {task.microbatch}")

    # --- step ----------------------------------------------------------------------------------

    def backward(self, tensors: Any, grad_tensors: Any = None) -> None:
        """``model.backward`` inside a step: ends the microbatch's forward, runs its backward."""
        task = current_task()
        if task is None:
            torch.autograd.backward(tensors, grad_tensors)
            return
        task.chain = list(task.trail)
        task.backward_called = True
        self._release(task)
        self._acquire(task, BACKWARD)
        torch.autograd.backward(tensors, grad_tensors)

    def _task_main(self, task: Task, body: Callable[[], Any] | None) -> None:
        _local.task = task
        torch.set_grad_enabled(task.grad_enabled)
        try:
            if body is not None:  # leader: run the step body for this microbatch
                self._acquire(task, FORWARD, new=True)
                task.trail = [self.pp_rank]
                task.result = body()
                if task.chain is None:
                    task.chain = list(task.trail)
                self._release(task, finished=True)
            else:
                self._serve(task, until=None)
        except _Stop:
            pass
        except BaseException as e:  # noqa: BLE001 - reported by the dispatcher
            task.error = e
            if self.baton is not None and self.baton.holder == task.microbatch:
                self._release(task)
        finally:
            _local.task = None
            self.transport.inbox.put(Message(TASK_END, -1, task.microbatch, None, []))

    def run_step(self, bodies: Sequence[Callable[[], Any]] | None, num_microbatches: int, baton: Baton,
                 grad_enabled: bool, done_payload: Callable[[list[Any]], Any] | None = None) -> tuple[list[Any], Any]:
        """Run one step. The leader passes one body per microbatch; followers pass None.

        Returns:
            The per-microbatch results (on every rank) and the leader's extra payload.
        """
        self.baton = baton
        self.tasks = {}
        self.events = []
        self._open = {}
        leader = bodies is not None
        self.transport.start(STOP)
        results: list[Any] = [None] * num_microbatches
        payload: Any = None
        running = 0
        error: BaseException | None = None

        def spawn(mb: int, body: Callable[[], Any] | None) -> Task:
            nonlocal running
            task = Task(self, mb, grad_enabled=grad_enabled)
            self.tasks[mb] = task
            running += 1
            worker = self._workers.get(mb)
            if worker is None:
                worker = self._workers[mb] = _Worker(f"smp-mb{mb}")
            worker.jobs.put(lambda: self._task_main(task, body))
            return task

        if leader:
            assert bodies is not None
            for mb, body in enumerate(bodies):
                spawn(mb, body)
        finished_followers = False
        peers = self._peer_ranks()
        last_message = time.monotonic()
        while True:
            if leader and running == 0:
                break
            if finished_followers and running == 0:
                break
            try:
                msg = self.transport.inbox.get(timeout=_POLL_S)
            except queue.Empty:
                msg = None
            if msg is None:
                try:
                    failure.check_peers(peers, f"the pipeline step on pp_rank {self.pp_rank}")
                except RemoteRankError as e:
                    error = e
                    break
                # A little later than the tasks' own limit, so a task waiting for one named peer reports first.
                if time.monotonic() - last_message > self.timeout_s + 5 * _POLL_S:
                    error = failure.timeout_error(f"pp_rank {self.pp_rank} waited for a pipeline message", peers,
                                                  self.timeout_s)
                    break
                continue
            last_message = time.monotonic()
            if isinstance(msg, BaseException):
                error = msg
                break
            if msg.kind == TASK_END:
                running -= 1
                task = self.tasks[msg.microbatch]
                if task.error is not None and error is None:
                    error = task.error
                    break
                continue
            msg.src_pp = self.pp_ranks.index(msg.src)
            if msg.kind == DYNAMIC:
                baton.go_dynamic(msg.body)
                self._log_fallback(f"{msg.body} (seen on pp_rank {msg.src_pp})")
                continue
            if msg.kind == ERROR:
                error = RemoteRankError(msg.body["rank"], msg.body["text"])
                break
            if msg.kind == DONE:
                results, payload = unpack(msg.body["skeleton"], msg.tensors)
                finished_followers = True
                for task in self.tasks.values():
                    task.inbox.put(msg)
                if running == 0:
                    break
                continue
            task = self.tasks.get(msg.microbatch) or spawn(msg.microbatch, None)
            task.inbox.put(msg)
        if error is not None:
            # A dropped connection is the failure of the peer behind it, not of this rank.
            error = failure.translate(error, f"the pipeline step on pp_rank {self.pp_rank}", peers)
            self._fail(error)
            raise error
        if leader:
            results = [self.tasks[mb].result for mb in range(num_microbatches)]
            payload = done_payload(results) if done_payload is not None else None
            skeleton, tensors = pack((results, payload))
            for pp in range(len(self.pp_ranks)):
                if pp != self.pp_rank:
                    self._send(pp, DONE, -1, {"skeleton": skeleton}, tensors)
        self.tasks = {}  # Note [task lifetime]
        self.transport.stop(STOP, self.timeout_s)
        return results, payload

    def _peer_ranks(self) -> list[int]:
        """Global ranks of the other members of this pipeline."""
        return [r for i, r in enumerate(self.pp_ranks) if i != self.pp_rank]

    def _fail(self, error: BaseException) -> None:
        """Tell the peers (unless the error came from one) and unblock our task threads."""
        failure.publish_failure(error)  # a stall is published in the silent peer's name
        if not isinstance(error, RemoteRankError):
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            for pp in range(len(self.pp_ranks)):
                if pp != self.pp_rank:
                    try:
                        self._send(pp, ERROR, -1, {"rank": self.pp_ranks[self.pp_rank], "text": text})
                    except Exception:  # noqa: BLE001 - the peer may be gone already
                        pass
        stop = Message(DONE, -1, -1, None, [])
        for task in self.tasks.values():
            task.inbox.put(stop)

    def _log_fallback(self, reason: str) -> None:
        if not getattr(self, "_fallback_logged", False):
            self._fallback_logged = True
            logger.warning("this step left the recorded chain: %s; SMP v1's dynamic order is used", reason)

    def notify_dynamic(self, reason: str) -> None:
        """Tell the pipeline peers this rank left the static plan (and log it once).

        With ``strict_order`` (tensor parallelism: TP peers in other pipelines must run the very
        same order, which the timing-dependent dynamic rule cannot promise) this is an error.
        """
        if self.strict_order:
            raise SMPError(
                f"this step left the recorded chain ({reason}); with tensor_parallel_degree > 1 every TP peer "
                "must run the same order, which smp's dynamic fallback cannot guarantee. Fix: keep the chain of "
                "ranks a microbatch visits the same in every step (no data-dependent module calls across ranks), "
                "or use a separate @smp.step function for each path")
        self._log_fallback(reason)
        for pp in range(len(self.pp_ranks)):
            if pp != self.pp_rank:
                self._send(pp, DYNAMIC, -1, reason)
