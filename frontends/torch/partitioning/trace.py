"""Tracing and lowering for partitioning: an ``nn.Module`` tree as the core's `ModuleTree`.

The frontend translates, the core decides: this module turns an ``nn.Module`` tree (plus, for
automatic partitioning, a trace of one microbatch: execution order, time, output bytes) into the
core's `ModuleTree`, and hands it to `partition_tree` (auto); the manual path resolves the same
tree through `scopes.manual_scopes`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from smp.partition import ModuleNode, ModuleTree, TreePartition, exclusive_compute, partition_tree
from smp.structure import map_structure


def _tensor_bytes(obj: Any) -> int:
    total = 0

    def leaf(x: Any) -> Any:
        nonlocal total
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
        return x

    map_structure(obj, leaf)
    return total


class Trace:
    """What one traced microbatch showed: module order, inclusive time, output bytes.

    ``after`` is the step body's own work after the model returned (the loss on the logits) and
    ``last`` the module that finished last before it: that work runs where ``last``'s output
    lives (a torch op on a reference runs on its owner), so it is counted in ``last``'s time.
    """

    def __init__(self) -> None:
        self.order: dict[str, int] = {}
        self.time: dict[str, float] = {}
        self.output_bytes: dict[str, int] = {}
        self.after = 0.0
        self.last: str | None = None


def trace(root: nn.Module, run: Callable[[], Any], *, measure_time: bool = True) -> Trace:
    """Run ``run()`` (one microbatch of the step) with hooks on every module of ``root``."""
    tr = Trace()
    with torch.no_grad():
        run()  # warm-up: first calls pay one-time costs that would skew the measured compute
    starts: dict[str, list[float]] = {}
    handles = []
    last = ""  # the module that finished last
    root_done, before_root = 0.0, ""  # when the root last returned, and what finished just before it
    for path, module in root.named_modules():
        def pre(_m: nn.Module, _a: Any, path: str = path) -> None:
            tr.order.setdefault(path, len(tr.order))
            starts.setdefault(path, []).append(time.perf_counter())

        def post(_m: nn.Module, _a: Any, out: Any, path: str = path) -> None:
            nonlocal last, root_done, before_root
            now = time.perf_counter()
            tr.time[path] = tr.time.get(path, 0.0) + (now - starts[path].pop())
            tr.output_bytes[path] = tr.output_bytes.get(path, 0) + _tensor_bytes(out)
            if path:
                last = path
            else:
                root_done, before_root = now, last

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    try:
        with torch.no_grad():
            run()
        end = time.perf_counter()
    finally:
        for h in handles:
            h.remove()
    if before_root:
        tr.after, tr.last = end - root_done, before_root
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
    if compute and tr is not None and tr.last in compute:
        compute[tr.last] += tr.after  # the step body's loss runs where the model's output is
    for path, module in modules.items():
        # A container's own time is the Python loop around its children (and our hooks): overhead
        # that runs wherever its children run, not work to place.
        if isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)) and path in compute:
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
            atomic=_atomic(path, module, *_ancestors(modules, path))))
    return ModuleTree(nodes)


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


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
    if not children:
        return False
    if isinstance(parent, _CONTAINERS):
        return False  # a layer: open into its children, which stay whole (next case)
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
                          virtual_stages=section.virtual_stages, tolerance=_TOLERANCE)


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
