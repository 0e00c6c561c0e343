"""Delayed parameter initialisation: build a model on the meta device, materialise each rank's share later.

``with smp.delay_param_initialization():`` moves every parameter registered inside to the ``meta``
device as soon as it is registered (buffers stay real: they are small, and some, like a rotary
embedding's ``inv_freq``, are computed in ``__init__`` and cannot be recomputed generically). The
model then costs no parameter memory until `smp.DistributedModel` partitions it; afterwards each
rank allocates and initialises only the parameters it owns, so a model bigger than one rank's
memory can be built::

    build (meta)  -> DistributedModel: TP conversion (meta shards) -> partition -> materialise local

How a parameter is initialised (see `DelayedPlan`): the module that first holds it, in the
order of ``named_modules()`` of the model given to `smp.DistributedModel` (its *origin*), is
initialised again on fresh tensors, with the default generator seeded from the config's
``random_seed`` (0 when unset) and the module's path:

* inside a Hugging Face ``PreTrainedModel``: its ``_init_weights(module)``;
* otherwise, or for what that leaves untouched: ``module.reset_parameters()`` (or
  ``_reset_parameters()``, as ``nn.MultiheadAttention`` names it).

Parameters are filled with NaN first; one that is still NaN afterwards raises
`DelayedInitError`. Because the seed depends only on the path, the values do not depend on the
partition: the same on any pipeline degree, and equal to a single-process run of the same delayed
script (not to an eager run, whose generator runs through the modules one after another). A
parameter shared by several modules (tied embeddings, a module used twice) is one ``Parameter``
object, materialised in place, so it stays shared.

Under tensor parallelism the converted modules hold meta *shards*. A shard is materialised by
initialising the full tensor of its origin (the module before conversion, matched by parameter
name) and keeping this rank's slice (`smp.torch.nn.params.shard_packed`), which equals a full
initialisation then slicing. The memory spike is one module's full parameters at a time.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from smp.errors import SMPError

from ..runtime.process_state import torch_state

__all__ = ["DelayedInitError", "DelayedPlan", "delay_param_initialization",
           "has_delayed_params", "pending_materialization", "plan_if_delayed", "attach_plan"]

logger = logging.getLogger("smp")
_PLAN_ATTR = "_smp_delayed_plan"

# The open contexts are `TorchState.delayed_contexts`, entered and left only by the context
# manager (restored in finally); smp.reset() drops them and undoes the patch.
_ORIGINAL_REGISTER = nn.Module.register_parameter


class DelayedInitError(SMPError, RuntimeError):
    """A delayed parameter could not be materialised (no initialiser, or no recorded origin)."""


def _to_meta(param: nn.Parameter) -> nn.Parameter:
    meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
    meta.__dict__.update(param.__dict__)
    return meta


def _register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
    contexts = torch_state().delayed_contexts
    if param is not None and contexts and contexts[-1][0] and not param.is_meta:
        memo = contexts[-1][1]
        meta = memo.get(param)
        if meta is None:
            meta = memo[param] = _to_meta(param)
        param = meta
    _ORIGINAL_REGISTER(self, name, param)


@contextmanager
def delay_param_initialization(enabled: bool = True) -> Iterator[None]:
    """Create the parameters of modules built inside on the meta device (SMP v1 reference 3.8).

    `smp.DistributedModel` materialises them after partitioning: each rank allocates and
    initialises only its own parameters (see the module docstring for how). An inner
    ``enabled=False`` context creates real parameters again.

    Example:
        >>> with delay_param_initialization():
        ...     layer = nn.Linear(4, 4)
        >>> layer.weight.is_meta
        True
    """
    ts = torch_state()  # left on the state it entered in, as smp.partition (partitioning/scopes.py) is
    outermost = not ts.delayed_contexts
    if outermost:
        ts.patch("delay_param_initialization", nn.Module, "register_parameter", _register_parameter)
    ts.delayed_contexts.append((enabled, WeakIdKeyDictionary()))
    try:
        yield
    finally:
        ts.delayed_contexts.pop()
        if outermost:
            ts.unpatch("delay_param_initialization")


def has_delayed_params(root: nn.Module) -> bool:
    """True while ``root`` holds parameters on the meta device."""
    return any(p.is_meta for p in root.parameters())


def _seed(base: int, path: str) -> int:
    digest = hashlib.sha256(f"{base}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _hf_pretrained() -> type | None:
    transformers = sys.modules.get("transformers")
    return getattr(transformers, "PreTrainedModel", None) if transformers is not None else None


class DelayedPlan:
    """Where each meta parameter of a model gets its full value: the module that first holds it.

    Built from the model as given to `smp.DistributedModel` (before tensor parallelism replaces
    modules), with every parameter's full shape, so that it still works after conversion (shards
    are matched to their origin by parameter name) and after pipeline partitioning freed the
    storage of other ranks' parameters.
    """

    def __init__(self, root: nn.Module) -> None:
        self.modules = dict(root.named_modules())
        self.order = {path: i for i, path in enumerate(self.modules)}
        # path -> attr -> (shape, dtype) of every direct parameter of a module with a meta one
        self.shapes: dict[str, dict[str, tuple[torch.Size, torch.dtype]]] = {}
        self.by_id: dict[int, tuple[str, str]] = {}
        self.by_name: dict[str, tuple[str, str]] = {}
        self._keep: list[nn.Parameter] = []  # keeps ids in by_id valid
        for path, m in self.modules.items():
            params = {a: p for a, p in m._parameters.items() if p is not None}
            if not any(p.is_meta for p in params.values()):
                continue
            self.shapes[path] = {a: (p.shape, p.dtype) for a, p in params.items()}
            for attr, p in params.items():
                if p.is_meta:
                    if id(p) not in self.by_id:
                        self.by_id[id(p)] = (path, attr)
                        self._keep.append(p)
                    self.by_name[f"{path}.{attr}" if path else attr] = self.by_id[id(p)]
        hf = _hf_pretrained()
        self._hf_owner: dict[str, Any] = {}
        if hf is not None:
            for path in self.shapes:
                parts = path.split(".") if path else []
                for k in range(len(parts), -1, -1):
                    candidate = self.modules.get(".".join(parts[:k]))
                    if isinstance(candidate, hf):
                        self._hf_owner[path] = candidate
                        break

    def origin(self, name: str, param: nn.Parameter) -> tuple[str, str] | None:
        return self.by_id.get(id(param)) or self.by_name.get(name)

    def full_values(self, path: str, seed: int) -> dict[str, torch.Tensor]:
        """The freshly initialised full parameters of the module at ``path`` (on the CPU)."""
        m = self.modules[path]
        saved = dict(m._parameters)
        # Descendants' parameters become meta placeholders of their full shapes while ``m``
        # initialises: an initialiser that also writes into its children (nn.MultiheadAttention
        # zeroes out_proj.bias) then changes nothing, so each value comes from its origin alone.
        below = [(cpath, c, a, p) for cpath, c in m.named_modules(prefix=path) if c is not m
                 for a, p in c._parameters.items() if p is not None]
        try:
            for attr, (shape, dtype) in self.shapes[path].items():
                fresh = torch.empty(shape, dtype=dtype)
                if fresh.is_floating_point():
                    fresh.fill_(float("nan"))
                m._parameters[attr] = nn.Parameter(fresh, requires_grad=False)
            for cpath, c, attr, p in below:
                spec = self.shapes.get(cpath, {}).get(attr)
                shape, dtype = spec if spec is not None else (p.shape, p.dtype)
                c._parameters[attr] = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"),
                                                   requires_grad=False)
            self._initialise(path, m, seed)
            values = {attr: m._parameters[attr] for attr in self.shapes[path]}
            return {attr: v.detach() for attr, v in values.items() if v is not None}
        finally:
            for attr, p in saved.items():
                m._parameters[attr] = p
            for _, c, attr, p in below:
                c._parameters[attr] = p

    def _initialise(self, path: str, m: nn.Module, seed: int) -> None:
        initialisers: list[tuple[str, Callable[[], Any]]] = []
        hf_owner = self._hf_owner.get(path)
        if hf_owner is not None:
            initialisers.append((f"{type(hf_owner).__name__}._init_weights",
                                 lambda: hf_owner._init_weights(m)))
        for name in ("reset_parameters", "_reset_parameters"):
            if callable(getattr(m, name, None)):
                initialisers.append((f"{type(m).__name__}.{name}", getattr(m, name)))
                break
        for _, run in initialisers:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                run()
            if not self._uninitialised(m, path):
                return
        tried = ", ".join(n for n, _ in initialisers) or "none found"
        raise DelayedInitError(
            f"delayed parameter initialisation: {self._uninitialised(m, path)} of module "
            f"{path or '<root>'!r} ({type(m).__name__}) were not initialised (initialisers tried: {tried}). "
            f"Fix: give {type(m).__name__} a reset_parameters() method that initialises all its own "
            "parameters, or create it outside smp.delay_param_initialization()")

    def _uninitialised(self, m: nn.Module, path: str) -> list[str]:
        out = []
        for attr in self.shapes[path]:
            t = m._parameters[attr]
            if t is None or t.is_meta or (t.is_floating_point() and bool(torch.isnan(t).any())):
                out.append(attr)
        return out


def attach_plan(root: nn.Module, plan: DelayedPlan | None) -> None:
    """Keep ``plan`` (made before tensor parallelism converted ``root``) for `pending_materialization`."""
    if plan is not None:
        object.__setattr__(root, _PLAN_ATTR, plan)


def plan_if_delayed(root: nn.Module) -> DelayedPlan | None:
    """The `DelayedPlan` of ``root`` when it holds meta parameters, else None."""
    return DelayedPlan(root) if has_delayed_params(root) else None


class PendingMaterialization:
    """The meta parameters of a model, with their shapes, taken before partitioning frees storage."""

    def __init__(self, root: nn.Module, plan: DelayedPlan) -> None:
        self.root, self.plan = root, plan
        self.targets = [(name, p, p.shape) for name, p in root.named_parameters() if p.is_meta]

    def materialize(self, is_local: Callable[[nn.Parameter], bool], cfg: Any) -> None:
        """Allocate and initialise this rank's meta parameters; other ranks' become empty tensors."""
        from ..nn.group import resolve_group
        from ..nn.params import is_tp_sharded, shard_packed, tp_split_dim

        if any(b.is_meta for b in self.root.buffers()):
            names = [n for n, b in self.root.named_buffers() if b.is_meta]
            raise DelayedInitError(
                f"delayed parameter initialisation: buffers {names[:8]} are on the meta device; smp cannot "
                "recompute their values. Fix: create buffers outside a torch.device('meta') context "
                "(smp.delay_param_initialization() keeps buffers real)")
        device = next((t.device for t in [*self.root.parameters(), *self.root.buffers()] if not t.is_meta),
                      torch.device("cpu"))
        base = int(cfg.random_seed) if getattr(cfg, "random_seed", None) is not None else 0
        by_origin: dict[str, list[tuple[str, nn.Parameter, torch.Size, str]]] = {}
        for name, p, shape in self.targets:
            if not is_local(p):
                _swap(p, torch.empty(0, dtype=p.dtype, device=device))
                continue
            origin = self.plan.origin(name, p)
            if origin is None:
                raise DelayedInitError(
                    f"delayed parameter initialisation: parameter {name!r} {tuple(shape)} on the meta device "
                    "has no recorded origin (created on meta after smp.DistributedModel saw the model, or "
                    "replaced under another name). Fix: create it inside the model before wrapping")
            by_origin.setdefault(origin[0], []).append((name, p, shape, origin[1]))
        group = resolve_group(None) if any(is_tp_sharded(p) for _, p, _ in self.targets) else None
        count = 0
        for path in sorted(by_origin, key=self.plan.order.__getitem__):
            full = self.plan.full_values(path, _seed(base, path))
            for name, p, shape, attr in by_origin[path]:
                value = full[attr]
                if is_tp_sharded(p):
                    dim = tp_split_dim(p)
                    assert dim is not None
                    value = shard_packed(value, dim, int(getattr(p, "tp_packed", 1)), group, name)
                if value.shape != shape:
                    raise DelayedInitError(
                        f"delayed parameter initialisation: {name!r} is {tuple(shape)} but its origin "
                        f"{path}.{attr} gives {tuple(value.shape)}. Fix: report this; the TP conversion of "
                        "that module does not shard like its parameter says")
                _swap(p, value.to(device=device).contiguous())
                count += 1
        self.root.__dict__.pop(_PLAN_ATTR, None)
        logger.info("delayed parameter initialisation: materialised %d local parameters (seed %d)",
                    count, base)


def _swap(param: nn.Parameter, value: torch.Tensor) -> None:
    """Give ``param`` the storage of ``value``, keeping the object (ties, optimizers).

    A meta tensor cannot take the ``.data`` of another device, so the tensors are swapped.
    """
    fresh = nn.Parameter(value.detach().clone() if value._base is not None else value.detach(),
                         requires_grad=param.requires_grad)
    fresh.__dict__.update(param.__dict__)
    torch.utils.swap_tensors(param, fresh)


def pending_materialization(root: nn.Module) -> PendingMaterialization | None:
    """What `smp.DistributedModel` materialises after partitioning ``root`` (None: nothing delayed)."""
    if not has_delayed_params(root):
        return None
    plan = root.__dict__.get(_PLAN_ATTR) or DelayedPlan(root)
    return PendingMaterialization(root, plan)
