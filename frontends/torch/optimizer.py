"""`smp.DistributedOptimizer`: the user's optimizer, updating only this rank's parameters.

Parameters owned by other pipeline ranks have ``requires_grad`` off and no gradient, so torch's
optimizers skip them. State dicts are keyed by parameter *name* (not position), so a partial state
dict from one rank and the full one gathered over the pipeline merge and load in any layout.
"""

from __future__ import annotations

import types
from typing import Any

import torch

import smp.state as smp_state

from .errors import DistributedOptimizerError


def _names(model: Any) -> dict[int, str]:
    return {id(p): n for n, p in model.module.named_parameters(remove_duplicate=False)}


def _by_name(opt: torch.optim.Optimizer, model: Any, only_local: bool) -> dict[str, Any]:
    names = _names(model)
    local = {id(p) for p in model.local_parameters()} if model.partitioned else None
    state: dict[str, Any] = {}
    groups = []
    for group in opt.param_groups:
        g = {k: v for k, v in group.items() if k != "params"}
        g["params"] = [names[id(p)] for p in group["params"]]
        groups.append(g)
        for p in group["params"]:
            if only_local and local is not None and id(p) not in local:
                continue
            if p in opt.state and opt.state[p]:
                state[names[id(p)]] = {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v)
                                       for k, v in opt.state[p].items()}
    return {"state": state, "param_groups": groups, "_smp_by_name": True}


def DistributedOptimizer(optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,  # noqa: N802
                         dynamic_loss_scale: bool = False, **dynamic_loss_args: Any) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` for smp (SMP v1 signature; returns the same object, patched).

    Example:
        >>> optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    """
    st = smp_state.current()
    model = st.model
    if model is None:
        raise DistributedOptimizerError("create smp.DistributedModel(...) before smp.DistributedOptimizer(...)")
    params = {id(p) for p in model.module.parameters()}
    foreign = [i for g in optimizer.param_groups for i, p in enumerate(g["params"]) if id(p) not in params]
    if foreign:
        raise DistributedOptimizerError(
            "the optimizer holds parameters that are not the DistributedModel's: it was probably initialized "
            "with the model parameters *before* calling the smp.DistributedModel wrapper. Fix: build the "
            "optimizer from model.parameters() after smp.DistributedModel(...)")
    orig_state_dict = optimizer.state_dict
    orig_load = optimizer.load_state_dict
    pending: list[dict[str, Any]] = []

    def local_state_dict(self: Any, cast_to_cpu: bool = True, gather_if_shard: bool = True,
                         fp32_states_only: bool = False) -> dict[str, Any]:
        sd = _by_name(self, model, only_local=True)
        sd["_smp_is_partial"] = True
        return sd

    def state_dict(self: Any) -> dict[str, Any]:
        """Full optimizer state, gathered over the pipeline (call on every rank with dp_rank() == 0)."""
        if not model.partitioned or st.cfg is None or st.cfg.pipeline_parallel_degree == 1:
            return _by_name(self, model, only_local=False)
        from .runtime.comm import MP_GROUP, allgather

        parts = allgather(local_state_dict(self), MP_GROUP)
        full = parts[0]
        for part in parts[1:]:
            full["state"].update(part["state"])
        full.pop("_smp_is_partial", None)
        return full

    def load_state_dict(self: Any, sd: dict[str, Any]) -> None:
        if not sd.get("_smp_by_name"):
            orig_load(sd)
            return
        if not model.partitioned:
            pending.append(sd)
            return
        by_name = {n: p for n, p in model.module.named_parameters(remove_duplicate=False)}
        local = {id(p) for p in model.local_parameters()}
        for group, saved in zip(self.param_groups, sd["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        for name, values in sd["state"].items():
            p = by_name.get(name)
            if p is None or id(p) not in local:
                continue
            self.state[p] = {k: (v.to(p.device) if isinstance(v, torch.Tensor) and v.dim() > 0 else
                                 v.clone() if isinstance(v, torch.Tensor) else v) for k, v in values.items()}

    def _apply_pending(_model: Any, _opt: Any) -> None:
        for sd in pending:
            load_state_dict(optimizer, sd)
        pending.clear()

    optimizer.orig_state_dict = orig_state_dict  # type: ignore[attr-defined]
    optimizer.state_dict = types.MethodType(state_dict, optimizer)  # type: ignore[method-assign]
    optimizer.local_state_dict = types.MethodType(local_state_dict, optimizer)  # type: ignore[attr-defined]
    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)  # type: ignore[method-assign]
    optimizer.loss_scale = static_loss_scale  # type: ignore[attr-defined]
    optimizer.overflow = False  # type: ignore[attr-defined]
    from .checkpointing.saving import take_pending

    resumed = take_pending("optimizer")
    if resumed is not None:  # resume_from_checkpoint ran before the optimizer existed
        pending.append(resumed)
    model.register_post_partition_hook(_apply_pending)
    st.optimizer = optimizer
    if model.partitioned:
        _apply_pending(model, optimizer)
    return optimizer
