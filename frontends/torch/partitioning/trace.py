"""Tracing and lowering for partitioning: an ``nn.Module`` tree as the core's `ModuleTree`.

The frontend translates, the core decides: this module turns an ``nn.Module`` tree (plus, for
automatic partitioning, a trace of one microbatch: execution order, time, output bytes) into the
core's `ModuleTree`, and hands it to `partition_tree` (auto); the manual path resolves the same
tree through `scopes.manual_scopes`.

A module's time is its forward and, when the step body calls ``model.backward``, its backward:
a pipeline stage pays both, and their ratio differs between modules (a language-model head and
its loss cost more in backward, relative to their forward, than a decoder layer does), so
forward times alone misplace the cut (the Llama of ``benchmarks/bench_pipeline.py``: rank 1
at 52 % of the forward at the layer boundary, 55 % of forward and backward).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from smp.partition import (
    ModuleNode,
    ModuleTree,
    TreePartition,
    exclusive_compute,
    in_flight_by_rank,
    partition_tree,
)
from smp.structure import leaves

from .twins import equalize_twins

logger = logging.getLogger("smp")


def _tensor_bytes(obj: Any) -> int:
    return sum(x.numel() * x.element_size() for x in _tensors(obj))


class Trace:
    """What one traced microbatch showed: module order, inclusive time, output bytes.

    ``after`` is the step body's own work after the model returned (the loss on the logits) and
    ``last`` the module that finished last before it: that work runs where ``last``'s output
    lives (a torch op on a reference runs on its owner), so it is counted in ``last``'s time.
    ``backward_time`` is each module's inclusive backward time (empty when the step body runs no
    backward) and ``after_backward`` the backward of the step body's own work (the loss's).
    ``tails`` is, by (caller, child), the caller's own forward time between that child's return
    and the caller's next call or return: see Note [own work after a child].
    """

    def __init__(self) -> None:
        self.order: dict[str, int] = {}
        self.time: dict[str, float] = {}
        self.output_bytes: dict[str, int] = {}
        self.after = 0.0
        self.last: str | None = None
        self.backward_time: dict[str, float] = {}
        self.after_backward = 0.0
        self.tails: dict[tuple[str, str], float] = {}


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [x for x in leaves(obj) if isinstance(x, torch.Tensor)]


class _BackwardClock:
    """Times each module call's backward: from the first gradient of its outputs to the last of its inputs.

    Hooks on the call's tensors fire as autograd produces their gradients. A call whose inputs
    need no gradient (an embedding of token ids) ends when the last of its parameters that no
    other module uses has its gradient; a tied weight's gradient is complete only after every
    user's backward, so it says nothing about this one. The gradients of the traced backward are
    dropped as they arrive (one parameter's at a time is held), and the ones held before are
    put back.
    """

    def __init__(self, root: nn.Module) -> None:
        self.calls: list[tuple[str, nn.Module, list[float]]] = []  # (path, module, [start, end])
        self._open: dict[str, list[list[float]]] = {}
        self._done: dict[int, float] = {}  # id(param) -> when its gradient was accumulated
        users: dict[int, int] = {}
        for m in root.modules():
            for p in m.parameters(recurse=False):
                users[id(p)] = users.get(id(p), 0) + 1
        self._tied = {k for k, n in users.items() if n > 1}
        self._params = [p for p in root.parameters() if p.requires_grad]

    def pre(self, path: str, args: Any, kwargs: Any) -> None:
        span = [math.inf, -math.inf]
        self._open.setdefault(path, []).append(span)
        for t in _tensors((args, kwargs)):
            if t.requires_grad:
                t.register_hook(partial(self._at_end, span))

    def post(self, path: str, module: nn.Module, out: Any) -> None:
        span = self._open[path].pop()
        self.calls.append((path, module, span))
        for t in _tensors(out):
            if t.requires_grad:
                t.register_hook(partial(self._at_start, span))

    @staticmethod
    def _at_start(span: list[float], _grad: torch.Tensor) -> None:
        span[0] = min(span[0], time.perf_counter())

    @staticmethod
    def _at_end(span: list[float], _grad: torch.Tensor) -> None:
        span[1] = max(span[1], time.perf_counter())

    def _accumulated(self, p: torch.Tensor) -> None:
        self._done[id(p)] = time.perf_counter()
        p.grad = None

    def run(self, pending: list[tuple[Any, Any]], tr: Trace) -> None:
        """Run the step body's backward calls, then fill ``tr.backward_time`` and ``after_backward``."""
        held = [(p, p.grad) for p in self._params]
        handles = []
        try:
            for p in self._params:
                p.grad = None
                handles.append(p.register_post_accumulate_grad_hook(self._accumulated))
            began = time.perf_counter()
            for tensors, grads in pending:
                torch.autograd.backward(tensors, grads)
        finally:
            for h in handles:
                h.remove()
            for p, g in held:
                p.grad = g
        for path, module, (start, end) in self.calls:
            if end == -math.inf:
                own = [self._done[id(p)] for p in module.parameters()
                       if id(p) in self._done and id(p) not in self._tied]
                end = max(own, default=-math.inf)
            if start < math.inf and end >= start:
                tr.backward_time[path] = tr.backward_time.get(path, 0.0) + (end - start)
        last = [span[0] for path, _, span in self.calls if path == tr.last]
        if last and last[-1] < math.inf:
            tr.after_backward = max(0.0, last[-1] - began)


# Measured runs of the traced microbatch; each module's time is its fastest over them. Noise here
# only adds time (a page fault, a collector pass, the other ranks' processes), so the minimum is
# the steadier estimate: on the benchmark's `nn.Sequential` GPT the LM head + loss measured
# 1.20-1.25 decoder blocks in three traces as the fastest of 5 runs, 1.21-1.57 as the median of 3
# (1.12-1.15 in a warm loop of the two in one process, about 1.18 in the pipelined step), and
# the automatic V flipped between two cuts with it.
_REPEATS = 5


def trace(root: nn.Module, run: Callable[[], Any], *, measure_time: bool = True,
          backward: Callable[[], list[tuple[Any, Any]]] | None = None) -> Trace:
    """Run ``run()`` (one microbatch of the step) with hooks on every module of ``root``.

    ``backward()`` returns the ``(tensors, grad_tensors)`` of the ``model.backward`` calls the
    step body made since the last call (``model.backward`` only records them while tracing).
    With it the measured run keeps grad on and then runs that backward, timed per module (SMP
    v1 traced without grad: forward times only). A forward that runs out of memory with grad on
    is traced again without, and a backward that fails (out of memory, a loss without grad) leaves
    forward times only; either says so in the log. After a warm-up, the microbatch runs
    `_REPEATS` times and each time is the fastest; identical layers then share one time (twins.py). The model's buffers (BatchNorm statistics) and
    the random number generators are as they were before: tracing changes no numbers of training.
    """
    buffers = [(b, b.detach().clone()) for b in root.buffers()]
    with torch.random.fork_rng(devices=[]):
        try:
            return _trace(root, run, measure_time=measure_time, backward=backward)
        finally:
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)


def _trace(root: nn.Module, run: Callable[[], Any], *, measure_time: bool,
           backward: Callable[[], list[tuple[Any, Any]]] | None) -> Trace:
    with torch.no_grad():
        run()  # warm-up: first calls pay one-time costs that would skew the measured compute
    if backward is not None:
        backward()  # the warm-up's, made under no_grad
    runs = []
    for _ in range(_REPEATS if measure_time else 1):
        tr = _measure(root, run, measure_time=measure_time, backward=backward)
        if tr is None:  # out of memory with grad: forward times only
            return _trace(root, run, measure_time=measure_time, backward=None)
        runs.append(tr)
    return equalize_twins(root, _fastest(runs))  # repeated layers: one time for all their copies (twins.py)


def _fastest(runs: list[Trace]) -> Trace:
    """The first run's order and bytes, each time the least over the ``runs`` that have it."""
    out = runs[0]
    if len(runs) == 1:
        return out

    def least(values: list[dict[Any, float]], key: Any) -> float:
        return min(v[key] for v in values if key in v)

    times, backward, tails = [r.time for r in runs], [r.backward_time for r in runs], [r.tails for r in runs]
    out.time = {p: least(times, p) for p in out.time}
    out.backward_time = {p: least(backward, p) for p in out.backward_time}
    out.after = min(r.after for r in runs)
    out.after_backward = min(r.after_backward for r in runs)
    out.tails = {k: least(tails, k) for k in out.tails}
    return out


def _measure(root: nn.Module, run: Callable[[], Any], *, measure_time: bool,
             backward: Callable[[], list[tuple[Any, Any]]] | None) -> Trace | None:
    """One measured run (None: it ran out of memory with grad on)."""
    tr = Trace()
    clock = _BackwardClock(root) if backward is not None and measure_time else None
    starts: dict[str, list[float]] = {}
    handles = []
    last = ""  # the module that finished last
    root_done, before_root = 0.0, ""  # when the root last returned, and what finished just before it
    calls: list[list[Any]] = []  # open calls, innermost last: [path, child that returned last, when]

    def tail(frame: list[Any], now: float) -> None:
        if frame[1] is not None:  # Note [own work after a child]
            key = (frame[0], frame[1])
            tr.tails[key] = tr.tails.get(key, 0.0) + (now - frame[2])
            frame[1] = None

    for path, module in root.named_modules():
        def pre(_m: nn.Module, args: Any, kwargs: Any, path: str = path) -> None:
            tr.order.setdefault(path, len(tr.order))
            if clock is not None:
                clock.pre(path, args, kwargs)
            now = time.perf_counter()
            if calls:
                tail(calls[-1], now)
            calls.append([path, None, 0.0])
            starts.setdefault(path, []).append(now)

        def post(m: nn.Module, _a: Any, out: Any, path: str = path) -> None:
            nonlocal last, root_done, before_root
            now = time.perf_counter()
            while calls and calls[-1][0] != path:  # a call whose forward raised and was caught
                calls.pop()
            if calls:
                tail(calls.pop(), now)
            if calls:
                calls[-1][1:] = [path, now]
            tr.time[path] = tr.time.get(path, 0.0) + (now - starts[path].pop())
            tr.output_bytes[path] = tr.output_bytes.get(path, 0) + _tensor_bytes(out)
            if clock is not None:
                clock.post(path, m, out)
            if path:
                last = path
            else:
                root_done, before_root = now, last

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post))
    try:
        with torch.enable_grad() if clock is not None else torch.no_grad():
            run()
        end = time.perf_counter()
    except (torch.cuda.OutOfMemoryError, MemoryError):
        if clock is None:
            raise
        if backward is not None:
            backward()  # drop the half-made graph
        logger.warning("automatic partition: one microbatch with its backward does not fit for the trace; "
                       "the partition follows forward times only (traced without grad)")
        return None
    finally:
        for h in handles:
            h.remove()
    if before_root:
        tr.after, tr.last = end - root_done, before_root
    pending = backward() if backward is not None else []
    if clock is not None and pending:
        try:
            clock.run(pending, tr)
        except (RuntimeError, MemoryError) as e:
            logger.warning("automatic partition: the traced backward failed (%s); the partition "
                           "follows forward times only", str(e).splitlines()[0] if str(e) else type(e).__name__)
            tr.backward_time, tr.after_backward = {}, 0.0
    if not measure_time:
        tr.time, tr.after = {}, 0.0
    return tr


def lower(root: nn.Module, tr: Trace | None = None) -> ModuleTree:
    """The core's `ModuleTree` of ``root``: children in execution order, own parameter bytes,
    output bytes, exclusive compute, and groups of modules that share a parameter."""
    modules = dict(root.named_modules())
    owner_of: dict[int, str] = {}
    shared: dict[str, set[str]] = {}
    for path, module in modules.items():
        for name, p in module.named_parameters(recurse=False):
            first = owner_of.setdefault(id(p), path)
            if first != path:
                group = f"{first}.{name}"
                shared.setdefault(first, set()).add(group)
                shared.setdefault(path, set()).add(group)
    children: dict[str, tuple[str, ...]] = {}
    order = tr.order if tr else {}
    # A container that is never called itself (a ModuleList iterated by its parent) sits where its
    # first called descendant runs.
    first: dict[str, float] = {}
    for path in sorted(modules, key=lambda p: -p.count(".")):
        seen = [order[path]] if path in order else []
        seen += [first[k] for k in first if k.startswith(path + ".") and k.count(".") == path.count(".") + 1]
        first[path] = min(seen) if seen else float("inf")
    for path, module in modules.items():
        kids = [f"{path}.{n}" if path else n for n, c in module.named_children() if
                (f"{path}.{n}" if path else n) in modules and modules[f"{path}.{n}" if path else n] is c]
        # Children in execution order; never-run ones keep their definition order at the end.
        kids.sort(key=lambda k: first.get(k, float("inf")))
        children[path] = tuple(kids)
    compute = exclusive_compute(tr.time, children) if tr and tr.time else {}
    if compute and tr is not None:
        backward = exclusive_compute(tr.backward_time, children) if tr.backward_time else {}
        _follow_data(compute, backward, tr.tails, modules)
        for path, own in backward.items():
            compute[path] = compute.get(path, 0.0) + own
    if compute and tr is not None and tr.last in compute:
        compute[tr.last] += tr.after + tr.after_backward  # the step body's loss runs where the model's output is
    for path, module in modules.items():
        # A container's own time is the Python loop around its children (and our hooks): overhead
        # that runs wherever its children run, not work to place.
        if isinstance(module, _CONTAINERS) and path in compute:
            compute[path] = 0.0
    nodes = []
    for path, module in modules.items():
        own = [p for p in module.parameters(recurse=False) if owner_of.get(id(p)) == path]
        nodes.append(ModuleNode(
            path, children[path],
            param_bytes=sum(p.numel() * p.element_size() for p in own),
            activation_bytes=tr.output_bytes.get(path, 0) if tr else 0,
            compute=float(compute.get(path, 0.0)) if compute else (1.0 if tr is None or path in order else 0.0),
            shared_groups=frozenset(shared.get(path, ())),
            param_count=sum(p.numel() for p in own),
            atomic=_atomic(path, module, *_ancestors(modules, path)),
            no_return_cut=_layer(path, module, *_ancestors(modules, path))))
    return ModuleTree(nodes)


# Note [own work after a child]: a module's own torch ops run where their inputs live (an op on a
# reference runs on its owner), and the ops a forward runs after calling a child mostly take that
# child's output: a GPT block's attention (qkv -> reshape, scaled_dot_product_attention -> proj)
# runs where qkv ran. Counted as the block's own work, it sat where the block's Python runs: a V
# that opened the block with qkv on rank 1 and the block on rank 0 put a quarter of a block on
# rank 0 in the estimate and on rank 1 in the step. So the trace times, per call, the caller's
# own work between a child's return and the caller's next child call or return (`Trace.tails`),
# and lowering moves it, with the same share of the caller's own backward, to that child; the own
# work before the first child (on the caller's inputs) stays with the caller. Containers' own time
# is the loop around their children and is dropped anyway (see `lower`).
def _follow_data(forward: dict[str, float], backward: dict[str, float], tails: dict[tuple[str, str], float],
                 modules: dict[str, nn.Module]) -> None:
    """Move each caller's own work after a child to that child (Note [own work after a child])."""
    own_forward, own_backward = dict(forward), dict(backward)
    for (caller, child), spent in tails.items():
        total = own_forward.get(caller, 0.0)
        if total <= 0.0 or child not in forward or isinstance(modules.get(caller), _CONTAINERS):
            continue
        moved = min(spent, forward[caller])  # timer noise: never more than the caller has left
        forward[caller] -= moved
        forward[child] += moved
        back = min(own_backward.get(caller, 0.0) * moved / total, backward.get(caller, 0.0))
        if back > 0.0:
            backward[caller] -= back
            backward[child] = backward.get(child, 0.0) + back


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _layer(path: str, module: nn.Module, parent: nn.Module | None, _grandparent: nn.Module | None = None) -> bool:
    """A layer of a container (a decoder layer, a GPT block) that has children. It may be opened one
    level (`_atomic`); its code mixes their outputs with its input (residual adds), so a V's way
    back is cut only between layers."""
    return bool(path) and isinstance(parent, _CONTAINERS) and not isinstance(module, _CONTAINERS) \
        and next(module.children(), None) is not None


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_NEVER_CALLED = (nn.ModuleList, nn.ModuleDict)  # containers a parent iterates; a Sequential is called


def _ancestors(modules: dict[str, nn.Module], path: str) -> tuple[nn.Module | None, nn.Module | None]:
    """(parent, grandparent) of the module at ``path`` (None above the root)."""
    if not path:
        return None, None
    up = path.rpartition(".")[0]
    return modules[up], (modules[up.rpartition(".")[0]] if up else None)


def _atomic(path: str, module: nn.Module, parent: nn.Module | None, grandparent: nn.Module | None) -> bool:
    """Whether the partitioner must keep ``module`` whole.

    The root, containers and modules that hold containers (a model body with a ``ModuleList`` of
    layers) may be opened; so may a layer itself (a module inside a container), one level deep: a
    cut between a decoder layer's attention and its MLP crosses once, since the outputs a layer
    passes on stay where they were computed and its residual adds follow them (engine/refs.py), so
    a microbatch still visits each rank once. Below that (the attention's projections, an MoE
    block's experts, whose calls the parent's code interleaves) and in any other module with
    children, a cut would turn every child call into a round trip: those stay whole.
    """
    if not path or isinstance(module, _CONTAINERS):
        return False
    children = list(module.children())
    if not children or _layer(path, module, parent):
        return False  # a leaf; or a layer: open into its children, which stay whole (next case)
    if isinstance(grandparent, _CONTAINERS):
        return True
    return not any(isinstance(c, _CONTAINERS) for c in children)


# How far above the finest split a coarser one may stay (`partition_tree`). The traced costs are
# measured times: a split whose bottleneck is 2 % lower makes every step about 2 % shorter, which
# pays for opening a layer (its cut still crosses once).
_TOLERANCE = 0.02


def auto_partition(tree: ModuleTree, cfg: Any) -> TreePartition:
    section = cfg.partition_section()
    return partition_tree(tree, section.num_stages, memory_weight=section.memory_weight,
                          stage_ranks=section.stage_ranks, tolerance=_TOLERANCE, microbatches=section.microbatches,
                          memory_cap_bytes=section.memory_per_rank, in_flight=in_flight(cfg))


def in_flight(cfg: Any) -> tuple[int, ...]:
    """Each rank's microbatches in flight at its peak, for the partition's memory estimate."""
    return in_flight_by_rank(cfg.pipeline, cfg.pipeline_parallel_degree, cfg.microbatches, cfg.active_microbatches)


def rehome_split_layers(root: nn.Module, assignment: dict[str, int]) -> dict[str, int]:
    """A module whose children the split put on different ranks runs its own code where its caller does.

    The core places an opened module's own work (its Python: residual adds, reshapes) before its
    first child. Where a V placement cuts a layer on the way back (its attention on rank 1, its
    MLP on rank 0, which also runs the decoder loop), that would put the layer's code on rank 1:
    rank 1 would call the MLP on rank 0 and hand rank 0 back a value rank 0 holds, a round trip
    per microbatch each way. Run where the loop runs, the layer's calls continue rank 1's open run
    and then rank 0's own work: the microbatch still crosses once. The same holds for an
    ``nn.Sequential`` (it calls its children); the caller is the nearest ancestor that is called
    (``ModuleList`` and ``ModuleDict`` never are).
    """
    out = dict(assignment)
    modules = dict(root.named_modules())
    for path, module in modules.items():
        if not path or isinstance(module, _NEVER_CALLED):
            continue
        children = {out[f"{path}.{name}"] for name, c in module.named_children() if next(c.parameters(), None) is not None}
        if len(children) < 2:
            continue
        up = path.rpartition(".")[0]
        while up and isinstance(modules[up], _NEVER_CALLED):
            up = up.rpartition(".")[0]
        rank = out[up]
        if out[path] == rank:
            continue
        out[path] = rank
        if not isinstance(module, nn.Sequential):  # its parameter-less children stay with their neighbours
            for name, child in module.named_children():  # a layer's run with it
                if next(child.parameters(), None) is None:
                    for sub, _ in child.named_modules(prefix=f"{path}.{name}"):
                        out[sub] = rank
    return out


def rehome_sequential_stateless(root: nn.Module, assignment: dict[str, int]) -> dict[str, int]:
    """Parameter-less children of an ``nn.Sequential`` (activations, dropout) join a neighbour.

    The core runs a parameter-less module with its parent, which is right when the parent's own
    forward calls it; inside an ``nn.Sequential`` it would split a run of children on one rank
    into two requests, so such a child goes with the child before it (or after, if first).
    """
    out = dict(assignment)
    for path, module in root.named_modules():
        if not isinstance(module, nn.Sequential):
            continue
        names = [f"{path}.{n}" if path else n for n in module._modules]
        stateful = [next(iter(c.parameters()), None) is not None for c in module._modules.values()]
        for i, name in enumerate(names):
            if stateful[i] or name not in out:
                continue
            before = [names[j] for j in range(i - 1, -1, -1) if stateful[j]]
            after = [names[j] for j in range(i + 1, len(names)) if stateful[j]]
            anchor = before[0] if before else (after[0] if after else None)
            if anchor is not None:
                for sub, _ in module._modules[name.rsplit(".", 1)[-1]].named_modules(prefix=name):
                    out[sub] = out[anchor]
    return out
