"""The pipeline engine: SMP v1's leader/follower execution of one step across a pipeline.

Every pipeline rank runs `Engine.run_step`. The step body runs on the leader (pp_rank 0), once per
microbatch, each microbatch in its own thread. When a microbatch's code calls a module owned by
another pipeline rank, the call becomes a request: the owner runs the module's forward in that
microbatch's thread on its side and keeps the outputs, with their autograd graph, for the rest of
the microbatch. The reply carries only their metadata: the caller gets a `RemoteTensor` for each
(refs.py), so an output that the caller's code only passes on to the next module on the same rank
never comes back (SMP v1's ``fast_mode``). A value moves when something reads it: the caller
fetches it, and the fetched tensor is an autograd node (`_Fetch`) whose backward sends its
gradient to the owner, which runs backward on its kept graph and replies with the gradients of
the tensors the caller had sent it. Outputs a caller read right away on an earlier step come back
in the reply itself (no extra round trip). A tensor sent to the same rank again in the same
microbatch unchanged (rotary embeddings, masks) travels once.

A microbatch is one logical thread of control hopping between ranks; a thread waiting for a reply
also serves the nested requests of its own microbatch (ping-pong chains such as 0 -> 1 -> 0 -> 1).

Which microbatch runs next on a rank is the `Baton`'s decision (smp.pipeline.baton): the static
plan from the shared scheduler, built from the chain of ranks microbatch 0 visited on the first
step, or SMP v1's dynamic rule on the first step and whenever a step strays from the recorded
chain. An action is what a microbatch does on a rank while it holds the baton; the chain lists the
actions in order. A reply that carries no values keeps the owner's action open ("an open run"):
the caller's next call to the same rank continues it, and only the caller doing work of its own
(a torch op on a reference, a module of its own, a fetch, ``model.backward``, the step's end) or
calling a third rank ends it. So a Hugging Face decoder loop whose second half of layers sits on
rank 1 records the chain 0 -> 1 -> 0, not one hop per layer.

The calling side of a cross-rank call is requester.py, the called side owner.py, a microbatch's
state task.py; this module holds the baton, the dispatch of messages and the step.

Message kinds (wire.py): forward request/reply, backward request/reply, fetch request/reply, end of an open
run, end of a microbatch (the owners free its values), error, done (the leader's results for the
followers), stop (end of a rank's sending), dynamic (a peer fell back to the dynamic rule).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from smp.errors import RemoteRankError, SMPError
from smp.pipeline.baton import BACKWARD, FORWARD, WEIGHT, Baton

from ..runtime import failure
from .local import current_task, set_task
from .owner import Owner
from .refs import resolve
from .requester import Requester
from .task import Task
from .wire import (
    BWD_REQ,
    DONE,
    DYNAMIC,
    END_RUN,
    ERROR,
    FETCH,
    FWD_BATCH,
    FWD_REP,
    FWD_REQ,
    MB_END,
    REPLIES,
    STOP,
    TASK_END,
    Costs,
    Message,
    Transport,
    pack,
    unpack,
)
from .workers import Workers

__all__ = ["Engine", "Event", "current_task"]

logger = logging.getLogger("smp")
# How often the dispatcher, between messages, checks for a failed or vanished peer (runtime/failure.py).
_POLL_S = 0.2


# Note [task lifetime]: a step's tasks must be freed by reference counting when the step ends.
# A tensor the step body computes from a fetched value (a loss, the logits the step returns)
# owns an autograd graph whose `_Fetch` node holds its ctx. If the ctx held its task strongly,
# task -> values -> graph -> ctx -> task would be a cycle that runs through C++ autograd nodes,
# which the cyclic GC cannot traverse: every step's tasks, values and graphs would stay alive for
# good. So fetches (and references) refer to their task weakly, and `run_step` drops the step's
# tasks before it returns.


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


class _Stop(Exception):
    """Unwinds a task thread when the step ends or fails elsewhere."""


class Engine(Requester, Owner):
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
        self._workers = Workers()
        # smp's own work on this rank in the last step (wire.Costs): messages, calls made, requests served.
        self.costs = transport.costs
        weakref.finalize(self, self._workers.close, 0.0)  # collected without smp.reset
        # pp_rank -> microbatches the leader finished that its next message there reports (`_end_microbatch`).
        self._ended: dict[int, list[int]] = {}
        self._ended_lock = threading.Lock()
        # (kind, ordinal) of this rank's actions that are short relative to its others: they run
        # without the baton, next to the holder (see `mark_light`).
        self.light: set[tuple[str, int]] = set()
        self.strict_order = False
        # Outputs (by call, index) this rank read as soon as the call returned: later steps ask the
        # owner to send them with the reply.
        self.eager: dict[tuple[int, str], set[int]] = {}
        # Keep outputs where they were computed (SMP v1 fast_mode); False ships every output back
        # with the reply (for A/B measurements).
        self.keep_remote = True
        # Per (call number, module): the arguments' signature and the reply of the last open-run call.
        self.predicted: dict[tuple[int, str], tuple[bytes, dict[str, Any]]] = {}

    # --- baton with timeline -----------------------------------------------------------------

    def _acquire(self, task: Task, kind: str, *, new: bool = False) -> None:
        """Take this rank's baton for the task's next ``kind`` action (a light one runs beside the holder)."""
        assert self.baton is not None
        ordinal = task.counts.get(kind, 0)
        task.counts[kind] = ordinal + 1
        light = (kind, ordinal) in self.light and not new and self.baton.acquire_light(kind, task.microbatch)
        task.in_light = light
        if not light:
            self.baton.acquire(kind, task.microbatch, new=new)
        task.holding = True
        if kind != WEIGHT:  # a weight-gradient action is no visit: control stays with the caller
            task.trail.append(self.pp_rank)
        ev = Event(kind, task.microbatch, time.time(), ordinal=ordinal, light=light)
        self._open[task.microbatch] = ev
        self.events.append(ev)

    def _release(self, task: Task, *, finished: bool = False) -> None:
        assert self.baton is not None
        task.holding = False
        ev = self._open.pop(task.microbatch, None)
        if ev is not None and not ev.end:
            ev.end = time.time()
        if task.in_light:
            task.in_light = False
            self.baton.release_light(finished_mb=task.microbatch if finished else None)
            return
        self.baton.release(finished=finished)

    def _ends(self, task: Task) -> None:
        """Mark the end of the task's current action before its last message leaves (the release
        follows): the peer may act on that message, and finish, before this thread runs again."""
        ev = self._open.get(task.microbatch)
        if ev is not None:
            ev.end = time.time()

    def _kind(self, task: Task) -> str:
        return BACKWARD if task.backward_called else FORWARD

    def _end_run(self, task: Task, closing: int | None = None) -> bool:
        """Close the peer's open action for this microbatch (its next work is not a call to it).

        Calls sent without waiting are first acknowledged by their owner (Note [calls that do not
        wait]): it processes messages in order, so the acknowledgement comes after any reply that
        differed from the expected one, which `_serve` turns into an error. Any reply from that
        owner to a later request acknowledges them as well (`_serve`), so a run that ends with a
        call that waits (a loss whose value comes back) needs no acknowledgement of its own.

        With ``closing``, the caller's next message to that pp_rank is a request that closes the
        run and whose reply acknowledges (Note [backward of a reference]): nothing is sent to it
        here. Returns whether ``closing`` held the open run.
        """
        closed = task.run_with is not None and task.run_with == closing
        if closed:
            task.run_with = None
        for owner in sorted(set(task.ahead.values()) - {closing}):
            close = task.run_with == owner
            if close:
                task.run_with = None
            ack = ("ack", owner, task.calls)
            self._send(owner, END_RUN, task.microbatch, {"close": close, "ack": ack})
            self._serve(task, until=ack, peer=owner)
            task.ahead = {cid: o for cid, o in task.ahead.items() if o != owner}
        if task.run_with is not None:
            self._send(task.run_with, END_RUN, task.microbatch, {"close": True, "ack": None})
            task.run_with = None
        return closed

    def settle(self, task: Task) -> None:
        """Before this microbatch does work on this rank: close any open run elsewhere, hold our baton."""
        self._end_run(task)
        if not task.holding:
            self._acquire(task, self._kind(task))

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

    def _send(self, pp_dst: int, kind: int, mb: int, body: Any, tensors: Sequence[torch.Tensor] = ()) -> None:
        task = current_task()
        if task is not None:
            if task.outbox:
                self._flush(task)  # queued calls go first: a peer sees one microbatch's messages in order
            task.peers.add(pp_dst)
        ended: Sequence[int] = ()
        if self._ended:  # no lock on the common path: an end seen late rides on the next message
            with self._ended_lock:
                ended = self._ended.pop(pp_dst, ())
        self.transport.send(self.pp_ranks[pp_dst], kind, mb, body, list(tensors), ended)

    def _end_microbatch(self, task: Task) -> None:
        """The leader finished a microbatch: its peers may free what they kept for it.

        A peer this microbatch talked to hears it with our next message to it (which comes soon:
        the next microbatch talks to it too), one send less per microbatch; any other peer (a third
        rank the microbatch reached through another) gets an `MB_END` now. At the step's end the
        peers free everything anyway.
        """
        for pp in range(len(self.pp_ranks)):
            if pp == self.pp_rank:
                continue
            if pp in task.peers:
                with self._ended_lock:
                    self._ended.setdefault(pp, []).append(task.microbatch)
            else:
                self._send(pp, MB_END, task.microbatch, None)

    def _next(self, task: Task) -> Message:
        """The task's next message to act on (raises queue.Empty after the timeout).

        Note [requests that wait for the one before]: while this task handles a request its caller
        sent without waiting (Note [calls that do not wait]), it may serve messages itself (the
        module called a third rank, or back). What that caller sent after the request belongs
        after it (calls that use its outputs, the end of the run and its acknowledgement), so it
        waits until the request is done. Replies do not wait: the request may need them. A request
        the caller waits for is different: what the caller sends meanwhile is nested in it (a call
        back into this rank from a module of the caller's) and is served at once.
        """
        while True:
            for i, waiting in enumerate(task.deferred):  # the first of each peer is its earliest
                if not task.handling.get(waiting.src_pp):
                    return task.deferred.pop(i)
            msg = task.inbox.get(timeout=self.timeout_s)
            src = msg.src_pp
            if msg.kind not in REPLIES and (task.handling.get(src) or any(m.src_pp == src for m in task.deferred)):
                task.deferred.append(msg)
                continue
            return msg

    def _serve(self, task: Task, until: Any, peer: int | None = None) -> Message:
        """Wait for the reply ``until`` from pp_rank ``peer`` (or, with None, serve until the step ends)."""
        if task.outbox:
            self._flush(task)
        while True:
            try:
                msg = self._next(task)
            except queue.Empty:
                what = f"microbatch {task.microbatch} on pp_rank {self.pp_rank} waited for "
                if peer is not None:
                    raise failure.stalled_error(self.pp_ranks[peer], what + f"the reply of pp_rank {peer}",
                                                self.timeout_s) from None
                raise failure.timeout_error(what + "a pipeline message", self._peer_ranks(), self.timeout_s) from None
            kind = msg.kind
            if kind == FWD_REP and msg.body["id"] in task.ahead:
                task.ahead.pop(msg.body["id"])  # the owner replies to such a call only when it differs
                if msg.body.get("modified"):
                    raise SMPError(
                        f"microbatch {task.microbatch}: a module on pp_rank {msg.src_pp} changed one of its inputs "
                        f"in place (call {msg.body['id']}), which it did not on the last step; smp sent that call "
                        "without waiting for its reply, so the caller's tensor cannot follow. Fix: set "
                        "\"fast_mode\": False in the config, or make the module change its inputs on every step or never")
                raise SMPError(
                    f"microbatch {task.microbatch}: a module on pp_rank {msg.src_pp} returned outputs of other "
                    "shapes or structure, or called other pipeline ranks, than on the last step for the same "
                    f"arguments (call {msg.body['id']}); smp sent that call without waiting for its reply. Fix: "
                    "set \"fast_mode\": False in the config for models whose module outputs or calls change "
                    "with the values of their inputs")
            if kind in REPLIES:
                if until is None or msg.body["id"] != until:
                    raise RuntimeError(f"unexpected reply {msg.body['id']} for microbatch {task.microbatch}")
                if task.ahead:  # the peer handled every call we sent it before this request, as expected
                    task.ahead = {cid: o for cid, o in task.ahead.items() if o != msg.src_pp}
                return msg
            if kind == FWD_REQ or kind == BWD_REQ or kind == FWD_BATCH:
                if task.run_with == msg.src_pp:
                    task.run_with = None  # the peer released its baton to send us this request
                ahead = kind == FWD_BATCH or (kind == FWD_REQ and msg.body.get("ahead"))
                if ahead:
                    task.handling[msg.src_pp] = task.handling.get(msg.src_pp, 0) + 1
                start, compute, served = time.thread_time(), 0.0, 1
                try:
                    if kind == FWD_REQ:
                        compute = self._handle_forward(task, msg)
                    elif kind == BWD_REQ:
                        compute = self._handle_backward(task, msg)
                    else:
                        at = 0
                        for body, count in msg.body:
                            compute += self._handle_forward(task, Message(FWD_REQ, msg.src, msg.microbatch, body,
                                                                          msg.tensors[at:at + count], msg.src_pp))
                            at += count
                        served = len(msg.body)
                finally:
                    if ahead:
                        task.handling[msg.src_pp] -= 1
                self._served(task, served, time.thread_time() - start, compute)
            elif kind == FETCH:
                start = time.thread_time()
                self._handle_fetch(task, msg)
                self._served(task, 1, time.thread_time() - start, 0.0)
            elif kind == END_RUN:
                if msg.body["close"] and task.holding:
                    self._release(task)
                if msg.body["ack"] is not None:  # every call before it ran as the caller expected
                    self._send(msg.src_pp, FWD_REP, task.microbatch, {"id": msg.body["ack"]})
            elif kind == MB_END:
                task.free()
            elif kind == DONE:
                raise _Stop()
            elif kind == ERROR:
                raise RemoteRankError(msg.body["rank"], msg.body["text"], msg.body.get("who", ""))
            else:
                raise RuntimeError(f"unexpected message kind {kind} for microbatch {task.microbatch}")

    def _served(self, task: Task, requests: int, seconds: float, compute: float) -> None:
        """Count ``requests`` handled in ``seconds`` of CPU, ``compute`` of them the modules' own."""
        task.handled_s += seconds  # a call of this task that served requests while it waited counts less
        self.costs.count(served=requests, serve_s=seconds - compute)

    # --- step ----------------------------------------------------------------------------------

    def backward(self, tensors: Any, grad_tensors: Any = None) -> None:
        """``model.backward`` inside a step: ends the microbatch's forward, runs its backward."""
        task = current_task()
        if task is None:
            torch.autograd.backward(tensors, grad_tensors)
            return
        root = self._remote_root(tensors, grad_tensors)
        if root is None:
            tensors, grad_tensors = resolve((tensors, grad_tensors))
            self.settle(task)
            task.chain = list(task.trail)
            task.backward_called = True
            self._release(task)
            self._acquire(task, BACKWARD)
            torch.autograd.backward(tensors, grad_tensors)
            return
        ref, grad = root
        self._backward_of_reference(task, ref, grad)

    def _task_main(self, task: Task, body: Callable[[], Any] | None) -> None:
        set_task(task)
        torch.set_grad_enabled(task.grad_enabled)
        try:
            if body is not None:  # leader: run the step body for this microbatch
                self._acquire(task, FORWARD, new=True)
                task.result = resolve(body())  # values computed elsewhere come here to be returned
                self.settle(task)
                if task.chain is None:
                    task.chain = list(task.trail)
                self._end_microbatch(task)
                task.free()
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
            set_task(None)
            self.transport.inbox.put(Message(TASK_END, -1, task.microbatch, None, []))

    def run_step(self, bodies: Sequence[Callable[[], Any]] | None, num_microbatches: int, baton: Baton,
                 grad_enabled: bool, done_payload: Callable[[list[Any]], Any] | None = None) -> tuple[list[Any], Any]:
        """Run one step. The leader passes one body per microbatch; followers pass None.

        Returns:
            The per-microbatch results (on every rank) and the leader's extra payload.
        """
        self.baton = baton
        self.tasks = {}
        self._ended = {}
        self.costs = self.transport.costs = Costs()
        self.events = []
        self._open = {}
        leader = bodies is not None
        results: list[Any] = [None] * num_microbatches
        payload: Any = None
        running = 0
        error: BaseException | None = None
        lock = threading.Lock()
        last_rx = [time.monotonic()]

        def spawn(mb: int, body: Callable[[], Any] | None) -> Task:
            nonlocal running
            with lock:
                task = Task(self, mb, grad_enabled=grad_enabled)
                self.tasks[mb] = task
                running += 1
                self._workers.submit(mb, lambda: self._task_main(task, body))
            return task

        def route(msg: Message) -> bool:
            """On the receiver thread: hand a microbatch's message straight to its task."""
            msg.src_pp = self.pp_ranks.index(msg.src)
            for mb in msg.ended:  # before the message: it may open the next microbatch (`_end_microbatch`)
                ended = self.tasks.get(mb)
                if ended is not None:
                    ended.inbox.put(Message(MB_END, msg.src, mb, None, [], msg.src_pp))
            if msg.kind in (ERROR, DONE, DYNAMIC):
                return False
            last_rx[0] = time.monotonic()
            task = self.tasks.get(msg.microbatch) or spawn(msg.microbatch, None)
            task.inbox.put(msg)
            return True

        self.transport.start(STOP, route)

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
                if time.monotonic() - max(last_message, last_rx[0]) > self.timeout_s + 5 * _POLL_S:
                    error = failure.timeout_error(f"pp_rank {self.pp_rank} waited for a pipeline message", peers,
                                                  self.timeout_s)
                    break
                continue
            last_message = time.monotonic()
            if isinstance(msg, BaseException):
                error = msg
                break
            if msg.kind == TASK_END:
                with lock:
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
                error = RemoteRankError(msg.body["rank"], msg.body["text"], msg.body.get("who", ""))
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
            self.transport.abandon(STOP, self.timeout_s)
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
            ch = failure.channel()
            who = ch.who() if ch is not None else ""
            for pp in range(len(self.pp_ranks)):
                if pp != self.pp_rank:
                    try:
                        self._send(pp, ERROR, -1, {"rank": self.pp_ranks[self.pp_rank], "text": text, "who": who})
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
