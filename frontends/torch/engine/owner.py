"""The owner side of the engine: running the calls another pipeline rank makes into this rank's modules.

The owner runs a forward request in the microbatch's task on this rank and keeps the outputs, with
their graph, under keys the caller can name (`Task.values`); it replies with their metadata, or
their values when the caller reads them at once. A fetch sends a kept value; a backward request
backpropagates a kept value's gradient and replies with the gradients of the tensors the caller had
sent. `Owner` is mixed into `Engine` (engine.py).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from smp.pipeline.baton import BACKWARD, FORWARD, WEIGHT

from .refs import RemoteTensor
from .split import WeightGrads, backward_input
from .task import Alias, Task, ref_or_value
from .wire import BWD_REP, FETCH_REP, FWD_REP, Cached, Message, Out, Ref, Slot, map_structure


class Owner:
    """The called side of `Engine` (see the module docstring)."""

    def _handle_forward(self, task: Task, msg: Message) -> float:
        """Run a module call (or a torch function on values kept here) for ``msg``; returns the CPU
        seconds the call itself took (`Engine.costs` counts the rest as serving)."""
        body = msg.body
        src = msg.src_pp
        task.trail = list(body["trail"])  # body["trail"] stays what the caller sent
        if not task.holding:
            self._acquire(task, FORWARD)

        passed: list[tuple[tuple[str, Any], torch.Tensor, int]] = []  # what came as data, to see in-place changes

        def given(marker: tuple[str, Any], t: torch.Tensor) -> torch.Tensor:
            if t.requires_grad:
                with torch.enable_grad():
                    t = Alias.apply(t)
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
            start = time.thread_time()
            out = func(*args, **kwargs) if func is not None else self.run_local(body["path"], body["span"], args,
                                                                                 kwargs)
            compute = time.thread_time() - start
        changed = [(marker, t) for marker, t, version in passed if t._version != version]
        if task.run_with == src:
            task.run_with = None  # the caller holds its own baton again: it continues from our reply
        eager = body["eager"]
        data: list[torch.Tensor] = []
        count = 0

        def out_leaf(x: Any, send: bool = False) -> Any:
            nonlocal count
            if isinstance(x, RemoteTensor) and x.owner == src and x.requires_grad and x.ndeps:
                # Note [returning the caller's own value]: a value the caller computed in a call
                # from this module depends on tensors this rank sent it there; as a `Ref` it would
                # reach the caller's graph without this rank's part (autograd would stop at the
                # tensors received from here). Fetched, it joins this rank's graph and returns as ours.
                x = x.get()
            x = ref_or_value(x, src)
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
        if task.holding and not keep:
            self._ends(task)
        # A call sent without waiting whose reply is the one the caller expects needs none
        # (Note [calls that do not wait]): our next reply to the caller, or the run's end, acknowledges it.
        # (The owner's trail must be the one the caller assumed: the run's, one hop longer when the
        # call opened it. A call to a third rank that the last step did not make shows there.)
        assumed = [*body["trail"], self.pp_rank] if body.get("opening") else body["trail"]
        if not (body.get("ahead") and keep and not modified and skeleton == body["expect"]
                and task.trail == assumed):
            self._send(src, FWD_REP, task.microbatch, {"id": body["id"], "skeleton": skeleton, "open": keep,
                                                       "trail": task.trail, "modified": modified}, data)
        if task.holding and not keep:
            self._release(task)
        return compute

    def _handle_fetch(self, task: Task, msg: Message) -> None:
        key = msg.body["key"]
        value = task.values[key]
        if msg.body["grad"] and value.requires_grad:
            task.exported.add(key)
        self._send(msg.src_pp, FETCH_REP, task.microbatch, {"id": msg.body["id"]}, [value.detach()])

    def _handle_backward(self, task: Task, msg: Message) -> float:
        """Backpropagate a kept value's gradient; returns the CPU seconds of the backward itself."""
        body = msg.body
        task.trail = list(body["trail"])  # body["trail"] stays what the caller sent
        if body["close"] and task.holding:  # the caller's open run ends with this request
            self._release(task)
        held = task.holding
        if not held:
            self._acquire(task, BACKWARD)
        key = body["key"]
        kept = [task.values[key].detach()] if body["value"] else []
        task.exported.discard(key)
        # When this rank's plan runs this microbatch's weight gradients as an action of their own
        # (zero bubble: smp/pipeline/weights.py), this action computes only the gradients the caller
        # waits for, and the weights' part runs when the plan says (split.py).
        assert self.baton is not None
        split = not held and not task.exported and self.baton.next_planned(task.microbatch) == WEIGHT
        start = time.thread_time()
        later = self._backward_input(task, key, msg.tensors[0]) if split else None
        if later is None:
            # Another fetched value may share this graph; keep it until its gradient came (freed with the microbatch).
            torch.autograd.backward([task.values[key]], [msg.tensors[0]], retain_graph=bool(task.exported))
        compute = time.thread_time() - start
        grads = []
        for leaf_id in body["deps"]:
            leaf = task.leaves.get(tuple(leaf_id))
            g = None if leaf is None else leaf.grad
            if leaf is not None:
                leaf.grad = None
            grads.append(g)
        if not held:
            self._ends(task)
        self._send(msg.src_pp, BWD_REP, task.microbatch, {"id": body["id"], "mask": [g is not None for g in grads],
                                                          "trail": task.trail}, [g for g in grads if g is not None] + kept)
        if not held:
            self._release(task)
        if split:
            self._acquire(task, WEIGHT)
            if later is not None:
                start = time.thread_time()
                later.run()
                compute += time.thread_time() - start
            self._release(task)
        return compute

    def _backward_input(self, task: Task, key: Any, grad: torch.Tensor) -> WeightGrads | None:
        """The input half of a split backward of ``task.values[key]``: the received tensors' gradients
        land in their ``.grad`` as a whole backward would put them; returns the weights' half (None:
        this graph does not split, nothing ran)."""
        leaves = [t for t in task.leaves.values() if t.requires_grad]
        split = backward_input([task.values[key]], [grad], leaves)
        if split is None:
            return None
        grads, later = split
        for leaf, g in zip(leaves, grads, strict=True):
            if g is not None:
                leaf.grad = g if leaf.grad is None else leaf.grad + g
        return later
