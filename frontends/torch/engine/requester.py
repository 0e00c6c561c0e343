"""The requester side of the engine: a microbatch's calls into modules that another pipeline rank owns.

A call becomes a forward request; the reply names the outputs the owner keeps (the caller gets a
`RemoteTensor` for each) or carries their values. Reading a reference fetches its value as a
`_Fetch` autograd node, whose backward sends the gradient to the owner and returns the gradients
of what this microbatch had sent it. `Requester` is mixed into `Engine` (engine.py), which owns
the baton, the messages and the step.
"""

from __future__ import annotations

import pickle
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from smp.errors import SMPError
from smp.pipeline.baton import BACKWARD

from .local import current_task
from .refs import RemoteTensor, resolve
from .task import Alias, Task, ref_or_value
from .wire import BWD_REQ, FETCH, FWD_BATCH, FWD_REQ, Cached, Out, Ref, Slot, map_structure


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
        return (None, None, *info["engine"]._backward_exchange(info, grad)[0])


_ANCHOR = torch.empty(0, requires_grad=True)
# Calls sent without waiting are queued at most this long (s) and this many before they leave.
_BATCH_S = 0.002
_BATCH_MAX = 64
# Bytes: a reference's value small enough to come back with the gradients of its backward (a loss).
_VALUE_BACK = 1024


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


class Requester:
    """The calling side of `Engine` (see the module docstring)."""

    def remote_forward(self, owner: int, path: str, span: tuple[int, int] | None, args: tuple[Any, ...],
                       kwargs: dict[str, Any], func: Callable[..., Any] | None = None) -> Any:
        """Call a module owned by pipeline rank ``owner`` from the current microbatch task (or, with
        ``func``, run a torch function there on values it holds)."""
        task = current_task()
        assert task is not None
        start, handled = time.thread_time(), task.handled_s
        try:
            return self._remote_forward(task, owner, path, span, args, kwargs, func)
        finally:  # this call's own CPU, less the requests it served while it waited
            self.costs.count(calls=1, call_s=time.thread_time() - start - (task.handled_s - handled))

    def _remote_forward(self, task: Task, owner: int, path: str, span: tuple[int, int] | None,
                        args: tuple[Any, ...], kwargs: dict[str, Any], func: Callable[..., Any] | None) -> Any:
        if task.run_with is not None and task.run_with != owner:
            self._end_run(task)
        run_before = task.run_with
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
        predicted = signature is not None and known is not None and known[0] == signature
        # The call that opens a run goes ahead too when it opened one on the last step (its reply
        # was open, with the owner as the only new rank of the trail): the caller ends its own
        # action as the reply would have let it. The owner handles it before anything sent after it
        # (Note [requests that wait for the one before]).
        opening = predicted and task.run_with is None and known[1]["opens"]  # type: ignore[index]
        if opening:
            if task.holding:
                self._release(task)
            task.run_with = owner
            task.trail = [*task.trail, owner]  # what the owner's reply would say (a new list: body holds the old)
        if predicted and task.run_with == owner and not task.holding:
            # Note [calls that do not wait]: the owner holds this microbatch's open run, and this
            # call sends what it sent on the last step, so it should reply as it did then: the
            # caller goes on at once with that reply, and the owner never waits for it. The request
            # carries the expected reply; the owner sends a reply only when its own differs (the
            # caller then fails with the difference). Its reply to any later request, or one
            # acknowledgement when the run ends (`Engine._end_run`), confirms all of them: at most
            # one message per run back instead of one per call.
            # Such calls also leave together: queued until this task sends or waits for anything
            # else, or the first has waited _BATCH_S (a loop of layers on one rank: one message).
            body["ahead"] = True
            body["opening"] = opening
            body["expect"] = known[1]["skeleton"]
            task.ahead[cid] = owner
            task.outbox.append((owner, body, tensors))
            now = time.perf_counter()
            if len(task.outbox) == 1:
                task.outbox_since = now
            elif now - task.outbox_since > _BATCH_S or len(task.outbox) >= _BATCH_MAX:
                self._flush(task)
            reply_body, reply_tensors = known[1], []
        else:
            self._send(owner, FWD_REQ, task.microbatch, body, tensors)
            if task.holding:
                self._release(task)
            reply = self._serve(task, until=cid, peer=owner)
            task.trail = reply.body["trail"]
            task.run_with = owner if reply.body["open"] else None  # not open: the owner closed its run
            if task.run_with is None and not task.holding:
                self._acquire(task, self._kind(task))
            reply_body, reply_tensors = reply.body, reply.tensors
            if signature is not None and reply_body["open"] and not reply_tensors:
                opens = run_before is None and reply_body["trail"] == [*body["trail"], owner]
                self.predicted[call_key] = (signature, {"skeleton": reply_body["skeleton"], "open": True,
                                                        "opens": opens})
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

    def _flush(self, task: Task) -> None:
        """Send the task's queued calls (Note [calls that do not wait]) as one message.

        They all go to the owner of the open run: a call to another rank ends the run first
        (`Engine._end_run` sends, and every send flushes).
        """
        batch, task.outbox = task.outbox, []
        owner = batch[0][0]
        if len(batch) == 1:
            self.transport.send(self.pp_ranks[owner], FWD_REQ, task.microbatch, batch[0][1], batch[0][2])
        else:
            self.transport.send(self.pp_ranks[owner], FWD_BATCH, task.microbatch,
                                [(body, len(tensors)) for _, body, tensors in batch],
                                [t for _, _, tensors in batch for t in tensors])

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
                old = Alias.apply(local)
            for records in task.sent.values():
                for i, (leaf_id, t) in enumerate(records):
                    if t is local:
                        records[i] = (leaf_id, old)
        local.copy_(value)

    def _pack_args(self, task: Task, dst: int, obj: Any, grad: bool) -> tuple[Any, list[torch.Tensor]]:
        """The request's skeleton and tensors: references ``dst`` holds travel as `Ref`, a tensor sent
        to ``dst`` before in this microbatch (unchanged) as `Cached`, the rest as data."""
        tensors: list[torch.Tensor] = []
        call_no = task.calls + 1
        cache = task.cache.setdefault(dst, {})

        def leaf(x: Any) -> Any:
            x = ref_or_value(x, dst)
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

    def _backward_exchange(self, info: dict[str, Any], grad: torch.Tensor, close: bool = False,
                           value: bool = False) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
        """Send the gradient of the owner's kept value ``info["key"]``; the gradients of the tensors
        this microbatch sent it (``info["deps"]``, None where none) come back, and with ``value``
        the kept value itself. ``close``: the request also ends the owner's open run."""
        task = _info_task(info)
        owner = info["owner"]
        bid = ("backward", info["key"])
        self._send(owner, BWD_REQ, task.microbatch, {"id": bid, "key": info["key"], "deps": info["deps"],
                                                     "trail": task.trail, "close": close, "value": value}, [grad])
        if task.holding:
            self._release(task)
        reply = self._serve(task, until=bid, peer=owner)
        task.trail = reply.body["trail"]
        if not task.holding:
            self._acquire(task, BACKWARD)
        it = iter(reply.tensors)
        grads = [next(it) if m else None for m in reply.body["mask"]]
        return grads, next(it) if value else None

    def _backward_of_reference(self, task: Task, ref: RemoteTensor, grad: torch.Tensor) -> None:
        """``model.backward(ref, grad)`` for a reference `_remote_root` chose.

        Note [backward of a reference]: the loss lives where the last module computed it (an op
        on a reference runs there), so the backward starts there: its gradient goes straight to
        the owner, in a request that also closes the owner's open run, and its value (when
        small) comes back with the gradients. The call that produced it then needs no reply of
        its own (from the second step on it leaves without waiting, like the layers before it),
        and the microbatch's chain is 0 -> 1 forward, 1 -> 0 backward, with no hop back to hold
        the loss.
        """
        close = self._end_run(task, closing=ref.owner)
        task.chain = list(task.trail)
        task.backward_called = True
        sent = task.sent.get(ref.owner, [])[:ref.ndeps]
        info = {"task": weakref.ref(task), "owner": ref.owner, "key": ref.key, "path": ref.path,
                "deps": [leaf_id for leaf_id, _ in sent]}
        small = ref.numel() * ref.element_size() <= _VALUE_BACK
        grads, value = self._backward_exchange(info, grad, close=close, value=small)  # releases, then acquires
        if value is not None:
            ref.value = self._fetched(task, ref.owner, ref.key, value, ref.requires_grad, ref.ndeps, ref.path)
            ref.version = ref.value._version
        pairs = [(t, g) for (_, t), g in zip(sent, grads) if g is not None]
        if pairs:  # on through this rank's graph, as autograd goes on from a fetched value
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])

    def _remote_root(self, tensors: Any, grad_tensors: Any) -> tuple[RemoteTensor, torch.Tensor] | None:
        """The reference ``model.backward`` starts from where it lives, and its gradient: one unread
        reference of this microbatch that needs a gradient (a loss; any other output with its
        gradient given). None: the values are fetched and autograd runs here."""
        one = isinstance(tensors, (list, tuple)) and len(tensors) == 1
        ref = tensors[0] if one else tensors
        grad = grad_tensors[0] if one and isinstance(grad_tensors, (list, tuple)) and len(grad_tensors) == 1 \
            else grad_tensors
        if (not self.keep_remote or not isinstance(ref, RemoteTensor) or ref.value is not None
                or not ref.requires_grad or not ref.live()):
            return None
        if grad is None:
            if ref.numel() != 1:
                return None  # autograd's own error: a gradient can be implied for scalars only
            return ref, torch.ones(ref.shape, dtype=ref.dtype)
        if not isinstance(grad, torch.Tensor):
            return None
        return ref, resolve(grad)
