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

Message kinds: forward request/reply, backward request/reply, fetch request/reply, end of an open
run, end of a microbatch (the owners free its values), error, done (the leader's results for the
followers), stop (end of a rank's sending), dynamic (a peer fell back to the dynamic rule).
"""

from __future__ import annotations

import logging
import pickle
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
from .local import current_task, set_task
from .refs import RemoteTensor, resolve
from .wire import Cached, Message, Out, Ref, Slot, Transport, map_structure, pack, unpack

logger = logging.getLogger("smp")

(FWD_REQ, FWD_REP, BWD_REQ, BWD_REP, ERROR, DONE, STOP, DYNAMIC, TASK_END, FETCH, FETCH_REP, END_RUN,
 MB_END) = range(1, 14)
_REPLIES = (FWD_REP, BWD_REP, FETCH_REP)
# How often the dispatcher, between messages, checks for a failed or vanished peer (runtime/failure.py).
_POLL_S = 0.2

# Note [task lifetime]: a step's tasks must be freed by reference counting when the step ends.
# A tensor the step body computes from a fetched value (a loss, the logits the step returns)
# owns an autograd graph whose `_Fetch` node holds its ctx. If the ctx held its task strongly,
# task -> values -> graph -> ctx -> task would be a cycle that runs through C++ autograd nodes,
# which the cyclic GC cannot traverse: every step's tasks, values and graphs would stay alive for
# good. So fetches (and references) refer to their task weakly, and `run_step` drops the step's
# tasks before it returns.

LeafId = tuple[int, int, int]  # (sender pp_rank, sender's call number, slot): a tensor a rank received


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
    calls: int = 0
    trail: list[int] = field(default_factory=list)
    chain: list[int] | None = None
    result: Any = None
    error: BaseException | None = None
    counts: dict[str, int] = field(default_factory=dict)
    in_light: bool = False
    grad_enabled: bool = True
    backward_called: bool = False
    holding: bool = False  # holds this rank's baton
    run_with: int | None = None  # the peer whose action stays open for this microbatch's next call
    # Owner side: outputs kept for callers (key -> tensor with its graph), tensors received (by
    # LeafId), and the kept outputs a caller fetched with a gradient to come.
    values: dict[Any, torch.Tensor] = field(default_factory=dict)
    leaves: dict[LeafId, torch.Tensor] = field(default_factory=dict)
    exported: set[Any] = field(default_factory=set)
    # Caller side: calls sent without waiting (Note [calls that do not wait]): id -> the reply expected.
    ahead: dict[Any, dict[str, Any]] = field(default_factory=dict)
    # Caller side, per destination pp_rank: the gradient-carrying tensors sent (LeafId, tensor), in
    # order, and every tensor sent (id -> (weakref, version, needs grad, LeafId)) so a repeat travels as `Cached`.
    sent: dict[int, list[tuple[LeafId, torch.Tensor]]] = field(default_factory=dict)
    cache: dict[int, dict[int, tuple[Any, int, bool, LeafId]]] = field(default_factory=dict)

    def free(self) -> None:
        """Drop what this microbatch kept for others (its step part is over)."""
        self.values.clear()
        self.leaves.clear()
        self.exported.clear()
        self.sent.clear()
        self.cache.clear()


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


class _Fetch(torch.autograd.Function):
    """A value fetched from the rank that computed it, visible to autograd on the fetching rank.

    Its inputs are the tensors this microbatch sent that rank so far (the value can depend only on
    those); its backward sends the value's gradient to the owner, which backpropagates through its
    kept graph and returns the gradients of those tensors.
    """

    @staticmethod
    def forward(ctx: Any, info: dict[str, Any], anchor: torch.Tensor, *deps: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        ctx.info = info
        ctx.set_materialize_grads(False)
        value: torch.Tensor = info.pop("data")
        return value

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> Any:
        info = ctx.info
        if grad is None:
            return (None, None, *[None] * len(info["deps"]))
        engine: Engine = info["engine"]
        return (None, None, *engine._backward_exchange(info, grad))


_ANCHOR = torch.empty(0, requires_grad=True)


class _Alias(torch.autograd.Function):
    """``x``'s storage as a new non-leaf whose gradient goes to ``x`` as it is now.

    The owner hands a received tensor to the module through one, so a module that changes its
    input in place (``nn.ReLU(inplace=True)``) may, as in one process; the received leaf still
    collects the gradient. The caller keeps one of each tensor it sent before that tensor is
    changed in place, so later fetches still send that tensor's gradient to its old history.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return grad


def _info_task(info: dict[str, Any]) -> Task:
    """The task a fetched value belongs to (held weakly: see Note [task lifetime])."""
    task: Task | None = info["task"]()
    if task is None:
        raise SMPError(
            f"backward reached an output of module {info['path']!r} (computed on pp_rank {info['owner']}) after "
            "its @smp.step call ended; the pipeline runs a microbatch's backward only inside the step. Fix: call "
            "model.backward(loss) inside the @smp.step function (outputs returned with detach_outputs=False cannot "
            "be backpropagated through the pipeline afterwards)")
    return task


def _ref_or_value(x: Any, peer: int) -> Any:
    """What of ``x`` goes to pp_rank ``peer``: a `Ref` to a value ``peer`` holds (unchanged since it
    made it), else ``x`` itself, a reference owned elsewhere fetched here first."""
    if isinstance(x, RemoteTensor):
        if x.owner == peer and x.unchanged():
            return Ref(x.key)
        return x.get()
    return x


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
        assert self.baton is not None
        ordinal = task.counts.get(kind, 0)
        task.counts[kind] = ordinal + 1
        light = (kind, ordinal) in self.light and not new and self.baton.acquire_light(kind, task.microbatch)
        task.in_light = light
        if not light:
            self.baton.acquire(kind, task.microbatch, new=new)
        task.holding = True
        task.trail.append(self.pp_rank)
        ev = Event(kind, task.microbatch, time.time(), ordinal=ordinal, light=light)
        self._open[task.microbatch] = ev
        self.events.append(ev)

    def _release(self, task: Task, *, finished: bool = False) -> None:
        assert self.baton is not None
        task.holding = False
        ev = self._open.pop(task.microbatch, None)
        if ev is not None:
            ev.end = time.time()
        if task.in_light:
            task.in_light = False
            self.baton.release_light(finished_mb=task.microbatch if finished else None)
            return
        self.baton.release(finished=finished)

    def _kind(self, task: Task) -> str:
        return BACKWARD if task.backward_called else FORWARD

    def _end_run(self, task: Task) -> None:
        """Close the peer's open action for this microbatch (its next work is not a call to it)."""
        if task.ahead:
            self._serve(task, until="ahead")  # the replies of calls sent without waiting, checked
        if task.run_with is not None:
            self._send(task.run_with, END_RUN, task.microbatch, None)
            task.run_with = None

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

    # --- requester side ------------------------------------------------------------------------

    def remote_forward(self, owner: int, path: str, span: tuple[int, int] | None, args: tuple[Any, ...],
                       kwargs: dict[str, Any], func: Callable[..., Any] | None = None) -> Any:
        """Call a module owned by pipeline rank ``owner`` from the current microbatch task (or, with
        ``func``, run a torch function there on values it holds)."""
        task = current_task()
        assert task is not None
        if task.run_with is not None and task.run_with != owner:
            self._end_run(task)
        grad = torch.is_grad_enabled()
        skeleton, tensors = self._pack_args(task, owner, (args, kwargs), grad)  # may fetch (and settle)
        task.calls += 1
        call_key = (task.calls, path)
        cid = (self.pp_rank, task.calls)
        body = {"id": cid, "path": path, "span": span, "func": func, "skeleton": skeleton, "grad": grad,
                "trail": task.trail,
                "open": self.keep_remote and not task.backward_called,
                "eager": None if not self.keep_remote else sorted(self.eager.get(call_key, ()))}
        signature = None
        if body["open"]:
            try:
                signature = pickle.dumps((path, span, func, skeleton, grad, body["eager"],
                                          [(tuple(t.shape), t.dtype, t.requires_grad) for t in tensors]))
            except Exception:  # noqa: BLE001 - an argument that does not pickle is sent as before
                signature = None
        known = self.predicted.get(call_key)
        if (signature is not None and known is not None and known[0] == signature and task.run_with == owner
                and not task.holding):
            # Note [calls that do not wait]: the owner holds this microbatch's open run, and this
            # call sends what it sent on the last step: it replies as it did then (checked when the
            # reply comes), so the caller goes on at once and the owner never waits for it.
            body["ahead"] = True
            self._send(owner, FWD_REQ, task.microbatch, body, tensors)
            task.ahead[cid] = known[1]
            reply_body, reply_tensors = known[1], []
        else:
            self._send(owner, FWD_REQ, task.microbatch, body, tensors)
            if task.holding:
                self._release(task)
            reply = self._serve(task, until=cid, peer=owner)
            task.trail = reply.body["trail"]
            if reply.body["open"]:
                task.run_with = owner
            elif not task.holding:
                self._acquire(task, self._kind(task))
            reply_body, reply_tensors = reply.body, reply.tensors
            if signature is not None and reply_body["open"] and not reply_tensors:
                self.predicted[call_key] = (signature, {"skeleton": reply_body["skeleton"], "open": True})
        ndeps = len(task.sent.get(owner, ()))
        for marker, out in reply_body.get("modified", ()):
            self._apply_change(task, owner, marker, tensors, out, reply_tensors[out.data], ndeps, path)
        out_skeleton = reply_body["skeleton"]

        def leaf(x: Any) -> Any:
            if isinstance(x, Out):
                if x.data >= 0:
                    return self._fetched(task, owner, x.key, reply_tensors[x.data], x.requires_grad, ndeps, path)
                return RemoteTensor(x.shape, x.stride, x.dtype, x.requires_grad, engine=self, task=task, owner=owner,
                                    key=x.key, origin=(call_key, x.index), ndeps=ndeps, path=path)
            if isinstance(x, Ref):
                return task.values[x.key]
            return x

        return map_structure(out_skeleton, leaf)

    def _apply_change(self, task: Task, owner: int, marker: tuple[str, Any], sent: list[torch.Tensor], out: Out,
                      data: torch.Tensor, ndeps: int, path: str) -> None:
        """Note [inputs changed in place]: the module on ``owner`` changed one of the tensors this call
        sent it in place (``nn.ReLU(inplace=True)``); change ours the same way, as in one process.

        Our tensor becomes the owner's new value (a fetch, so its gradient goes there); first every
        record of it as sent to a rank is replaced by an alias of it as it was, so the gradients
        those ranks return still reach its old history.
        """
        kind, ident = marker
        if kind == "slot":
            local = sent[ident]
        else:
            local = next(ref() for ref, _, _, leaf_id in task.cache.get(owner, {}).values() if leaf_id == tuple(ident))
        value = self._fetched(task, owner, out.key, data, out.requires_grad, ndeps, path)
        if local.requires_grad:
            with torch.enable_grad():
                old = _Alias.apply(local)
            for records in task.sent.values():
                for i, (leaf_id, t) in enumerate(records):
                    if t is local:
                        records[i] = (leaf_id, old)
        local.copy_(value)

    def _send(self, pp_dst: int, kind: int, mb: int, body: Any, tensors: Sequence[torch.Tensor] = ()) -> None:
        self.transport.send(self.pp_ranks[pp_dst], kind, mb, body, list(tensors))

    def _pack_args(self, task: Task, dst: int, obj: Any, grad: bool) -> tuple[Any, list[torch.Tensor]]:
        """The request's skeleton and tensors: references ``dst`` holds travel as `Ref`, a tensor sent
        to ``dst`` before in this microbatch (unchanged) as `Cached`, the rest as data."""
        tensors: list[torch.Tensor] = []
        call_no = task.calls + 1
        cache = task.cache.setdefault(dst, {})

        def leaf(x: Any) -> Any:
            x = _ref_or_value(x, dst)
            if not isinstance(x, torch.Tensor):
                return x
            need = grad and x.requires_grad
            seen = cache.get(id(x))
            if seen is not None and seen[0]() is x and seen[1:3] == (x._version, need):
                return Cached(seen[3])
            leaf_id = (self.pp_rank, call_no, len(tensors))
            cache[id(x)] = (weakref.ref(x), x._version, need, leaf_id)
            if need:
                task.sent.setdefault(dst, []).append((leaf_id, x))
            tensors.append(x)
            return Slot(len(tensors) - 1, need)

        return map_structure(obj, leaf), tensors

    def _fetched(self, task: Task, owner: int, key: int, data: torch.Tensor, requires_grad: bool, ndeps: int,
                 path: str) -> torch.Tensor:
        """A value received from ``owner``, joined to this rank's graph when it carries a gradient."""
        if not requires_grad:
            return data
        sent = task.sent.get(owner, [])[:ndeps]
        info = {"engine": self, "task": weakref.ref(task), "owner": owner, "key": key, "path": path, "data": data,
                "deps": [leaf_id for leaf_id, _ in sent]}
        with torch.enable_grad():
            out: torch.Tensor = _Fetch.apply(info, _ANCHOR, *[t for _, t in sent])
        return out

    def fetch(self, task: Task, ref: RemoteTensor) -> torch.Tensor:
        """Bring a reference's value here (this microbatch does work on this rank from now on)."""
        self.settle(task)
        self._send(ref.owner, FETCH, task.microbatch, {"id": ("fetch", ref.key), "key": ref.key,
                                                       "grad": ref.requires_grad})
        reply = self._serve(task, until=("fetch", ref.key), peer=ref.owner)
        call_key, index = ref.origin
        if call_key[0] == task.calls:  # read before any other call: ask for it with the reply next time
            self.eager.setdefault(call_key, set()).add(index)
        return self._fetched(task, ref.owner, ref.key, reply.tensors[0], ref.requires_grad, ref.ndeps, ref.path)

    def _backward_exchange(self, info: dict[str, Any], grad: torch.Tensor) -> list[torch.Tensor | None]:
        task = _info_task(info)
        owner = info["owner"]
        bid = ("backward", info["key"])
        self._send(owner, BWD_REQ, task.microbatch, {"id": bid, "key": info["key"], "deps": info["deps"],
                                                     "trail": task.trail}, [grad])
        if task.holding:
            self._release(task)
        reply = self._serve(task, until=bid, peer=owner)
        task.trail = reply.body["trail"]
        if not task.holding:
            self._acquire(task, BACKWARD)
        it = iter(reply.tensors)
        return [next(it) if m else None for m in reply.body["mask"]]

    # --- owner side ------------------------------------------------------------------------------

    def _handle_forward(self, task: Task, msg: Message) -> None:
        body = msg.body
        src = msg.src_pp
        task.trail = body["trail"]
        if not task.holding:
            self._acquire(task, FORWARD)

        passed: list[tuple[tuple[str, Any], torch.Tensor, int]] = []  # what came as data, to see in-place changes

        def given(marker: tuple[str, Any], t: torch.Tensor) -> torch.Tensor:
            if t.requires_grad:
                with torch.enable_grad():
                    t = _Alias.apply(t)
            passed.append((marker, t, t._version))
            return t

        def leaf(x: Any) -> Any:
            if isinstance(x, Slot):
                t = msg.tensors[x.index]
                if x.requires_grad:
                    t = t.requires_grad_(True)
                task.leaves[(src, body["id"][1], x.index)] = t
                return given(("slot", x.index), t)
            if isinstance(x, Cached):
                return given(("cached", x.leaf), task.leaves[x.leaf])
            if isinstance(x, Ref):
                return task.values[x.key]
            return x

        args, kwargs = map_structure(body["skeleton"], leaf)
        with torch.set_grad_enabled(body["grad"]):
            func = body["func"]
            out = func(*args, **kwargs) if func is not None else self.run_local(body["path"], body["span"], args,
                                                                                 kwargs)
        changed = [(marker, t) for marker, t, version in passed if t._version != version]
        if task.run_with == src:
            task.run_with = None  # the caller holds its own baton again: it continues from our reply
        eager = body["eager"]
        data: list[torch.Tensor] = []
        count = 0

        def out_leaf(x: Any, send: bool = False) -> Any:
            nonlocal count
            x = _ref_or_value(x, src)
            if not isinstance(x, torch.Tensor):
                return x
            index, count = count, count + 1
            key = (src, body["id"][1], index)  # named by the caller's call: it can know it before the reply
            task.values[key] = x
            rg = body["grad"] and x.requires_grad
            slot = -1
            if send or eager is None or index in eager:
                data.append(x.detach())
                slot = len(data) - 1
                if rg:
                    task.exported.add(key)
            return Out(key, index, tuple(x.shape), tuple(x.stride()), x.dtype, rg, slot)

        skeleton = map_structure(out, out_leaf)
        # Inputs the module changed in place go back with their new values: the caller changes its
        # own tensors the same way (Note [inputs changed in place]).
        modified = [(marker, out_leaf(t, send=True)) for marker, t in changed]
        self._end_run(task)  # a run we opened on a third rank
        keep = body["open"] and not data and task.holding
        self._send(src, FWD_REP, task.microbatch, {"id": body["id"], "skeleton": skeleton, "open": keep,
                                                   "trail": task.trail, "modified": modified}, data)
        if task.holding and not keep:
            self._release(task)

    def _handle_fetch(self, task: Task, msg: Message) -> None:
        key = msg.body["key"]
        value = task.values[key]
        if msg.body["grad"] and value.requires_grad:
            task.exported.add(key)
        self._send(msg.src_pp, FETCH_REP, task.microbatch, {"id": msg.body["id"]}, [value.detach()])

    def _handle_backward(self, task: Task, msg: Message) -> None:
        body = msg.body
        task.trail = body["trail"]
        held = task.holding
        if not held:
            self._acquire(task, BACKWARD)
        key = body["key"]
        task.exported.discard(key)
        # Another fetched value may share this graph; keep it until its gradient came (freed with the microbatch).
        torch.autograd.backward([task.values[key]], [msg.tensors[0]], retain_graph=bool(task.exported))
        grads = []
        for leaf_id in body["deps"]:
            leaf = task.leaves.get(tuple(leaf_id))
            g = None if leaf is None else leaf.grad
            if leaf is not None:
                leaf.grad = None
            grads.append(g)
        self._send(msg.src_pp, BWD_REP, task.microbatch, {"id": body["id"], "mask": [g is not None for g in grads],
                                                          "trail": task.trail}, [g for g in grads if g is not None])
        if not held:
            self._release(task)

    def _serve(self, task: Task, until: Any, peer: int | None = None) -> Message:
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
            if kind == FWD_REP and msg.body["id"] in task.ahead:
                expected = task.ahead.pop(msg.body["id"])
                if msg.body.get("modified"):
                    raise SMPError(
                        f"microbatch {task.microbatch}: a module on pp_rank {msg.src_pp} changed one of its inputs "
                        f"in place (call {msg.body['id']}), which it did not on the last step; smp sent that call "
                        "without waiting for its reply, so the caller's tensor cannot follow. Fix: set "
                        "\"fast_mode\": False in the config, or make the module change its inputs on every step or never")
                if msg.body["skeleton"] != expected["skeleton"] or not msg.body["open"] or msg.tensors:
                    raise SMPError(
                        f"microbatch {task.microbatch}: a module on pp_rank {msg.src_pp} returned outputs of other "
                        f"shapes or structure than on the last step for the same arguments (call {msg.body['id']}); "
                        "smp sent that call without waiting for its reply. Fix: set \"fast_mode\": False in the "
                        "config for models whose module outputs change shape with the values of their inputs")
                if until == "ahead" and not task.ahead:
                    return msg
                continue
            if kind in _REPLIES:
                if until is None or msg.body["id"] != until:
                    raise RuntimeError(f"unexpected reply {msg.body['id']} for microbatch {task.microbatch}")
                return msg
            if kind == FWD_REQ or kind == BWD_REQ:
                if task.run_with == msg.src_pp:
                    task.run_with = None  # the peer released its baton to send us this request
                if kind == FWD_REQ:
                    self._handle_forward(task, msg)
                else:
                    self._handle_backward(task, msg)
            elif kind == FETCH:
                self._handle_fetch(task, msg)
            elif kind == END_RUN:
                if task.holding:
                    self._release(task)
            elif kind == MB_END:
                task.free()
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
        tensors, grad_tensors = resolve((tensors, grad_tensors))
        self.settle(task)
        task.chain = list(task.trail)
        task.backward_called = True
        self._release(task)
        self._acquire(task, BACKWARD)
        torch.autograd.backward(tensors, grad_tensors)

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
                for pp in range(len(self.pp_ranks)):
                    if pp != self.pp_rank:
                        self._send(pp, MB_END, task.microbatch, None)
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
                worker = self._workers.get(mb)
                if worker is None:
                    worker = self._workers[mb] = _Worker(f"smp-mb{mb}")
            worker.jobs.put(lambda: self._task_main(task, body))
            return task

        def route(msg: Message) -> bool:
            """On the receiver thread: hand a microbatch's message straight to its task."""
            if msg.kind in (ERROR, DONE, DYNAMIC):
                return False
            last_rx[0] = time.monotonic()
            msg.src_pp = self.pp_ranks.index(msg.src)
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
