"""Marking modules for tensor parallelism and replacing the marked ones (SMP v1 reference 3.8).

* ``with smp.tensor_parallelism(enabled=True, **kwargs):`` marks every supported module created
  inside (see `smp.torch.tp.registry`); an inner ``enabled=False`` context overrides, and the
  kwargs override the distributed module's constructor arguments.
* ``smp.set_tensor_parallelism(module, enabled=True, **kwargs)`` marks the topmost supported
  modules of an existing tree (disabling unmarks the whole subtree); only before
  ``smp.DistributedModel`` wraps the model.
* `apply_tensor_parallelism` (called when the model is wrapped) replaces, top down, each marked
  supported module by its distributed version and does not descend into it, so only the
  outermost supported module is distributed. A module whose sizes do not split over the TP
  degree, or that shares a parameter with a module outside it, stays as it is, with a warning.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

from smp.torch.nn.group import TPShardingError
from torch import nn

import smp.state as smp_state
from smp.errors import SMPError

from ..runtime.process_state import torch_state
from .registry import Registration, all_registrations, registration_for

__all__ = ["DistributedModelWrappedError", "tensor_parallelism", "set_tensor_parallelism",
           "apply_tensor_parallelism", "is_marked"]

logger = logging.getLogger("smp")
_MARK = "_smp_tp_mark"  # (enabled, overrides) on a module instance
_ARGS = "_smp_tp_init_args"  # (args, kwargs) its constructor received, for init_hook

# The open tensor_parallelism() contexts are `TorchState.tp_contexts`, (enabled, overrides) each,
# entered and left only by the context manager (restored in finally); smp.reset() drops them and
# undoes the class patches.


class DistributedModelWrappedError(SMPError, RuntimeError):
    """``set_tensor_parallelism`` was called after ``smp.DistributedModel`` wrapped the model (SMP v1 name)."""


def is_marked(module: nn.Module) -> bool:
    """True when ``module`` is marked for tensor parallelism."""
    mark = getattr(module, _MARK, None)
    return bool(mark and mark[0])


def _patched_init(cls: type, original: Any) -> Any:
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        contexts = torch_state().tp_contexts
        if type(self) is cls and contexts:
            enabled, overrides = contexts[-1]
            object.__setattr__(self, _MARK, (enabled, dict(overrides)))
            object.__setattr__(self, _ARGS, (args, kwargs))

    return __init__


@contextmanager
def tensor_parallelism(enabled: bool = True, **kwargs: Any) -> Iterator[None]:
    """Mark the supported modules created inside for tensor parallelism (SMP v1 ``smp.tensor_parallelism``).

    Example:
        >>> with tensor_parallelism():
        ...     layer = nn.Linear(4, 4)
        ...     with tensor_parallelism(enabled=False):
        ...         kept = nn.Linear(4, 4)
        >>> is_marked(layer), is_marked(kept)
        (True, False)
    """
    ts = torch_state()  # left on the state it entered in, as smp.partition (partitioning/scopes.py) is
    outermost = not ts.tp_contexts
    if outermost:
        for cls in all_registrations():
            ts.patch("tensor_parallelism", cls, "__init__", _patched_init(cls, cls.__init__))  # type: ignore[misc]
    ts.tp_contexts.append((enabled, kwargs))
    try:
        yield
    finally:
        ts.tp_contexts.pop()
        if outermost:
            ts.unpatch("tensor_parallelism")


def set_tensor_parallelism(module: nn.Module, enabled: bool = True, **kwargs: Any) -> None:
    """Mark the topmost supported modules under ``module`` (or unmark the whole subtree).

    Raises:
        DistributedModelWrappedError: after ``smp.DistributedModel`` was created.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        >>> set_tensor_parallelism(model)
        >>> is_marked(model[0]), is_marked(model[1])
        (True, False)
    """
    if smp_state.current().model is not None:
        raise DistributedModelWrappedError(
            "set_tensor_parallelism was called after smp.DistributedModel wrapped the model. Fix: call it "
            "before smp.DistributedModel(model)")
    if not enabled:
        for m in module.modules():
            if hasattr(m, _MARK):
                object.__setattr__(m, _MARK, (False, {}))
        return

    def visit(m: nn.Module) -> None:
        if registration_for(m) is not None:
            object.__setattr__(m, _MARK, (True, dict(kwargs)))
            return
        for child in m.children():
            visit(child)

    visit(module)


def _hooked(dist: nn.Module, reg: Registration) -> nn.Module:
    """``dist`` called through SMP v1's forward and return hooks.

    The hooks wrap ``dist``'s own ``forward`` (an instance attribute, as activation checkpointing
    does) instead of a wrapper module, so the parameter names are ``dist``'s, with no ``module.``
    in between: what SMP v1 scripts and its translate functions expect.
    """
    inner = dist.forward
    forward_hook, return_hook = reg.forward_hook, reg.return_hook

    def forward(*args: Any, **kwargs: Any) -> Any:
        if forward_hook is not None:
            args, kwargs = forward_hook(*args, **kwargs)
        out = inner(*args, **kwargs)
        return return_hook(out) if return_hook is not None else out

    dist.forward = forward  # type: ignore[method-assign]
    return dist


def _accepted(target: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    """The overrides ``target`` accepts; SMP v1 performance knobs it lacks (``fused_softmax``,
    ``fused_bias_gelu``, ``attention_in_fp32``, ...) are dropped with a log line, as they do not
    change the numbers."""
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return overrides
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return overrides
    dropped = sorted(set(overrides) - set(params))
    if dropped:
        logger.info("tensor parallelism: %s ignores %s", getattr(target, "__name__", target), dropped)
    return {k: v for k, v in overrides.items() if k in params}


def _build(module: nn.Module, reg: Registration, overrides: dict[str, Any]) -> nn.Module:
    if reg.convert is not None:
        return reg.convert(module, **_accepted(reg.convert, overrides))
    recorded = getattr(module, _ARGS, None)
    if recorded is None and reg.init_hook is not None:
        raise SMPError(f"{type(module).__name__} was marked with set_tensor_parallelism but not created inside "
                       "smp.tensor_parallelism(), so its constructor arguments for init_hook are unknown. Fix: "
                       "create it inside `with smp.tensor_parallelism():`")
    args, kwargs = recorded if recorded is not None else ((), {})
    if reg.init_hook is not None:
        args, kwargs = reg.init_hook(*args, **kwargs)
    dist = reg.dist_module(*args, **{**kwargs, **_accepted(reg.dist_module, overrides)})
    return _hooked(dist, reg) if (reg.forward_hook or reg.return_hook) else dist  # type: ignore[no-any-return]


def _shares_weights(module: nn.Module, root: nn.Module) -> bool:
    sub = {id(m) for m in module.modules()}
    inside = {id(p) for p in module.parameters()}
    outside = {id(p) for m in root.modules() if id(m) not in sub for p in m.parameters(recurse=False)}
    return bool(inside & outside)


def apply_tensor_parallelism(root: nn.Module, only: Collection[str] | None = None) -> nn.Module:
    """Replace every outermost marked supported module under ``root`` (with ``only``: of those class
    names only); returns the (new) root.

    Example:
        >>> with tensor_parallelism():
        ...     model = nn.Sequential(nn.Linear(4, 4))
        >>> type(apply_tensor_parallelism(model)[0]).__name__
        'DistributedLinear'
    """

    def convert(m: nn.Module) -> nn.Module | None:
        if only is not None and type(m).__name__ not in only:
            return None
        reg = registration_for(m)
        if reg is None or not is_marked(m):
            return None
        if _shares_weights(m, root):
            logger.warning("tensor parallelism: %s shares a parameter with another module; it stays "
                           "undistributed", type(m).__name__)
            return None
        try:
            return _build(m, reg, getattr(m, _MARK)[1])
        except TPShardingError as e:
            logger.warning("tensor parallelism: %s stays undistributed: %s", type(m).__name__, e)
            return None

    def visit(parent: nn.Module) -> None:
        for name, child in list(parent.named_children()):
            new = convert(child)
            if new is None:
                visit(child)
            else:
                setattr(parent, name, new)

    from smp.torch.model.delayed import attach_plan, plan_if_delayed

    # Delayed (meta) parameters: remember where their full values come from before conversion
    # turns them into meta shards (smp.torch.model.delayed).
    plan = plan_if_delayed(root)
    new_root = convert(root)
    if new_root is None:
        visit(root)
        new_root = root
    attach_plan(new_root, plan)
    return new_root
