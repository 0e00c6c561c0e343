"""`smp.DistributedOptimizer`: the user's optimizer, updating only this rank's parameters.

Parameters owned by other pipeline ranks have ``requires_grad`` off and no gradient, so torch's
optimizers skip them. State dicts are keyed by parameter *name* (not position), so a partial state
dict from one rank and the full one gathered over the pipeline merge and load in any layout.

Under ``fp16: True`` / ``bf16: True`` (SMP v1's ``FP16_Optimizer``) the model holds 16-bit weights
and the optimizer steps fp32 master copies of this rank's parameters instead (`MasterWeights`); one
``optimizer.step()`` is::

    model grads (16-bit, scaled) --copy, / loss scale--> master grads (fp32)
        inf/NaN on any rank (agreed over the world)?  yes: skip, every rank lowers the scale
                                                      no:  step the masters, copy them into the model

``model.backward(loss)`` multiplies the loss by the current scale (`scaled_for_backward`). Under bf16,
as in SMP v1, the loss is not scaled (bfloat16 has float32's exponent range): the loss-scaling
arguments are ignored, and a step whose gradients hold an inf/NaN is still skipped on every rank.

Example:
    >>> optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
    ...                                      static_loss_scale=None, dynamic_loss_scale=True,
    ...                                      dynamic_loss_args={"scale_window": 1000, "min_scale": 1})
    >>> # after the @smp.step: optimizer.clip_master_grads(1.0); optimizer.step()
    >>> # if not optimizer.overflow: lr_scheduler.step()
"""

from __future__ import annotations

import logging
import os
import types
from collections.abc import Callable
from typing import Any

import torch

import smp.state as smp_state
from smp.errors import ConfigProblem, SMPCheckpointError, SMPInvalidArgumentError, flag_arguments

from .amp import DYNAMIC_LOSS_DEFAULTS, LossScaler, any_rank, make_loss_scaler
from .errors import DistributedOptimizerError
from .master_weights import MasterWeights, global_grad_norm
from .model.precision import half_dtype
from .model.state_dict import LOAD_INFO, saved_partition
from .optimizer_shard import SHARD_KEY, OptimizerShard, merge_shards
from .optimizer_tp import check_tp_degree, gather_tp_state, local_value

__all__ = ["DistributedOptimizer", "scaled_for_backward"]

logger = logging.getLogger("smp")
_FP16_KEYS = ("fp32_from_fp16", "loss_scaler", "overflow")


def scaled_for_backward(tensors: Any, grad_tensors: Any) -> tuple[Any, Any]:
    """What ``model.backward(tensors, grad_tensors)`` differentiates under ``fp16: True``: the loss in
    float32 times the optimizer's loss scale (the gradients given, scaled, when there are some)."""
    opt = smp_state.current().optimizer
    scaler = getattr(opt, "loss_scaler", None)
    if getattr(opt, "master_weights", None) is None or scaler is None or scaler.loss_scale == 1.0:
        return tensors, grad_tensors
    scale = scaler.loss_scale
    if grad_tensors is not None:
        if isinstance(grad_tensors, torch.Tensor):
            return tensors, grad_tensors * scale
        return tensors, [g * scale if isinstance(g, torch.Tensor) else g for g in grad_tensors]
    if isinstance(tensors, torch.Tensor):
        return tensors.float() * scale, None
    return [t.float() * scale for t in tensors], None


def _names(model: Any, masters: MasterWeights) -> dict[int, str]:
    names = {id(p): n for n, p in model.module.named_parameters(remove_duplicate=False)}
    names.update({id(m): names[id(p)] for p, m in masters.pairs if m is not p and id(p) in names})
    return names


def _on_cpu(value: Any, cast_to_cpu: bool) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().cpu() if cast_to_cpu else value.detach().clone()


def _by_name(opt: torch.optim.Optimizer, model: Any, masters: MasterWeights, only_local: bool,
             cast_to_cpu: bool = True, shard: OptimizerShard | None = None) -> dict[str, Any]:
    names = _names(model, masters)
    local = {id(m) for _, m in masters.pairs} | {id(p) for p in model.local_parameters()} \
        if model.partitioned else None
    state: dict[str, Any] = {}
    groups = []
    for i, group in enumerate(opt.param_groups):
        g = {k: v for k, v in group.items() if k != "params"}
        # A shard's groups list every parameter of this (pp, tp) rank, not only the ones it steps.
        members = shard.full_groups[i] if shard is not None else group["params"]
        g["params"] = [names[id(p)] for p in members]
        groups.append(g)
        for p in group["params"]:
            if only_local and local is not None and id(p) not in local:
                continue
            if p in opt.state and opt.state[p]:
                state[names[id(p)]] = {k: _on_cpu(v, cast_to_cpu) for k, v in opt.state[p].items()}
    return {"state": state, "param_groups": groups, "_smp_by_name": True}


def _loss_scaling(static_loss_scale: float | None, dynamic_loss_scale: bool,
                  extra: dict[str, Any], dtype: torch.dtype | None) -> LossScaler:
    """The loss scaler for the config's precision; SMP v1 takes the arguments as ``dynamic_loss_args={...}``
    (its code) or as keywords (its docs): both work, not both at once."""
    nested = extra.pop("dynamic_loss_args", None)
    if nested is not None and not isinstance(nested, dict):
        raise SMPInvalidArgumentError([ConfigProblem("smp.DistributedOptimizer(dynamic_loss_args=...)", nested,
                                                     "must be a dict", f"pass a dict with keys from "
                                                     f"{sorted(DYNAMIC_LOSS_DEFAULTS)}")])
    if nested and extra:
        raise SMPInvalidArgumentError([ConfigProblem("smp.DistributedOptimizer(...)", sorted(extra),
                                                     "dynamic loss arguments given both as keywords and in "
                                                     "dynamic_loss_args", "put them all in dynamic_loss_args")])
    args = {**(nested or {}), **extra}
    scaler = make_loss_scaler(static_loss_scale, dynamic_loss_scale, args)  # validates in every precision
    if dtype is torch.float16:
        return scaler
    if (dynamic_loss_scale or (static_loss_scale not in (None, 1.0))) and smp_state.current().rank == 0:
        logger.info("smp.DistributedOptimizer: the loss-scaling arguments take effect with fp16: True only "
                    "(%s); the loss is not scaled", "bf16 has float32's exponent range" if dtype is not None
                    else "float32 training")
    return LossScaler(1.0)


def DistributedOptimizer(optimizer: torch.optim.Optimizer, static_loss_scale: float | None = 1.0,  # noqa: N802
                         dynamic_loss_scale: bool = False, **dynamic_loss_args: Any) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` for smp (SMP v1 signature; returns the same object, patched).

    Args:
        optimizer: a torch optimizer built from ``model.parameters()`` after ``smp.DistributedModel``.
        static_loss_scale: fp16: the fixed loss scale (1.0: none). Ignored with ``dynamic_loss_scale``.
        dynamic_loss_scale: fp16: scale the loss dynamically (`smp.torch.amp.DynamicLossScaler`).
        **dynamic_loss_args: ``dynamic_loss_args={...}`` or keywords: ``init_scale`` (2**32),
            ``scale_factor`` (2.0), ``scale_window`` (1000), ``min_scale`` (1), ``delayed_shift`` (1),
            ``consecutive_hysteresis`` (False).

    Besides torch's methods, the optimizer has SMP v1's: ``clip_master_grads(max_norm)``,
    ``overflow``, ``loss_scaler``, ``local_state_dict``, ``local_optimizer_state_dict``,
    ``load_local_optimizer_state_dict``, ``local_fp16_state_dict``, ``load_local_fp16_state_dict``,
    ``load_optimizer_checkpoint``, ``init_master_params``, ``reload_model_params``, and
    ``optimizer.optimizer`` (itself, for SMP v1's ``StepLR(optimizer.optimizer)``).

    Example:
        >>> optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    """
    st = smp_state.current()
    model = st.model
    if model is None:
        raise DistributedOptimizerError("create smp.DistributedModel(...) before smp.DistributedOptimizer(...)")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise DistributedOptimizerError(f"smp.DistributedOptimizer wraps a torch.optim.Optimizer, got "
                                        f"{type(optimizer).__name__}. Fix: pass e.g. torch.optim.Adam(model.parameters())")
    if hasattr(optimizer, "loss_scaler"):
        raise DistributedOptimizerError("this optimizer is already an smp.DistributedOptimizer: wrap it once")
    params = {id(p) for p in model.module.parameters()}
    foreign = [i for g in optimizer.param_groups for i, p in enumerate(g["params"]) if id(p) not in params]
    if foreign:
        raise DistributedOptimizerError(
            "the optimizer holds parameters that are not the DistributedModel's: it was probably initialized "
            "with the model parameters *before* calling the smp.DistributedModel wrapper. Fix: build the "
            "optimizer from model.parameters() after smp.DistributedModel(...)")
    dtype = half_dtype(st.cfg)
    scaler = _loss_scaling(static_loss_scale, dynamic_loss_scale, dict(dynamic_loss_args), dtype)
    masters = MasterWeights(optimizer, dtype)
    rank_map = st.rank_map
    sharding = bool(st.cfg is not None and st.cfg.shard_optimizer_state and rank_map is not None
                    and rank_map.rdp_size > 1)
    shards: list[OptimizerShard | None] = [None]  # built with the masters, after partitioning
    orig_state_dict = optimizer.state_dict
    orig_load = optimizer.load_state_dict
    orig_step = optimizer.step
    orig_zero_grad = optimizer.zero_grad
    pending: list[tuple[Callable[..., None], dict[str, Any]]] = []
    # The model gradients the master grads were last taken from (None: not taken since the last step).
    prepared: list[tuple[Any, ...] | None] = [None]

    def ensure_built() -> bool:
        if not masters.built and model.partitioned:
            local = {id(p) for p in model.local_parameters()}
            if sharding:
                shard = shards[0] = OptimizerShard(optimizer, local)
                local = {id(p) for p in shard.params if shard.owns(p)}
            masters.build(local)
        return masters.built

    def shard_mark(sd: dict[str, Any]) -> dict[str, Any]:
        if shards[0] is not None:
            sd[SHARD_KEY] = shards[0].mark
        return sd

    def prepare(self: Any) -> bool:
        """Once per set of gradients: master grads from the model's, and whether any rank overflowed.

        Master grads taken earlier in this iteration (``clip_master_grads`` before ``step``) are reused
        unless some rank's model gradients changed since; the ranks agree on that, so they all run the
        same collectives.
        """
        if prepared[0] is not None:
            changed = prepared[0] != masters.grads_signature()
            if not any_rank(float(changed), "optimizer.step(): did gradients change since clip_master_grads"):
                return bool(self.overflow)
        masters.refresh_changed()
        local = masters.grads_in(scaler.loss_scale)
        self.overflow = any_rank(float(local), "the fp16/bf16 overflow check of optimizer.step()")
        prepared[0] = masters.grads_signature()
        return bool(self.overflow)

    def step(self: Any, closure: Callable[[], Any] | None = None) -> Any:
        """Step the fp32 masters and copy them into the model; on an inf/NaN on any rank, skip (every rank)."""
        if closure is not None:
            raise SMPInvalidArgumentError([ConfigProblem(
                "optimizer.step(closure=...)", closure, "closures do not fit fp16/bf16 training under smp "
                "(backward runs inside the @smp.step function)", "run the @smp.step, then call optimizer.step()")])
        if not ensure_built():
            return None  # no step has run: no gradients yet
        tried = scaler.loss_scale
        overflow = prepare(self)
        scaler.update_scale(overflow)
        self.loss_scale = scaler.loss_scale
        prepared[0] = None
        if overflow:
            if st.rank == 0:
                logger.info("optimizer.step() skipped: inf/NaN gradients at loss scale %g (agreed by every rank); "
                            "loss scale now %g", tried, scaler.loss_scale)
            return None
        out = orig_step()
        masters.weights_out()
        if shards[0] is not None:
            shards[0].broadcast_stepped()
        return out

    def sharded_step(self: Any, closure: Callable[[], Any] | None = None) -> Any:
        """Step the parameters this rank owns, then take every other rdp rank's (fp32 training)."""
        if not ensure_built():
            return None
        out = orig_step(closure) if closure is not None else orig_step()
        if shards[0] is not None:
            shards[0].broadcast_stepped()
        return out

    def zero_grad(self: Any, set_to_none: bool | None = None) -> None:
        if set_to_none is None:  # the optimizer's own default (apex's set_grad_none for FusedAdam/FusedLAMB)
            orig_zero_grad()
            set_to_none = getattr(self, "set_grad_none", True)
        else:
            orig_zero_grad(set_to_none)
        masters.zero_model_grads(set_to_none)
        if shards[0] is not None:
            shards[0].zero_foreign_grads(set_to_none)
        prepared[0] = None

    def sharded_zero_grad(self: Any, set_to_none: bool = True) -> None:
        """``zero_grad``, also of the parameters that other rdp ranks step (fp32 training)."""
        orig_zero_grad(set_to_none)
        if shards[0] is not None:
            shards[0].zero_foreign_grads(set_to_none)

    def clip_master_grads(self: Any, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the gradients the optimizer steps (fp32 masters under fp16/bf16) to a global norm of ``max_norm``.

        The norm is taken over every rank's gradients (all pipeline, tensor-parallel and data-parallel
        ranks, each gradient once), so every rank applies the same factor. Returns the norm before
        clipping, or -1 when this iteration's gradients overflowed (the step will be skipped).
        A collective: call it on every rank.
        """
        if not (type(max_norm) in (int, float) and max_norm > 0) or not (type(norm_type) in (int, float)
                                                                          and norm_type > 0):
            raise SMPInvalidArgumentError([ConfigProblem("optimizer.clip_master_grads(max_norm, norm_type)",
                                                         (max_norm, norm_type), "both must be numbers > 0",
                                                         "pass e.g. clip_master_grads(1.0)")])
        if not ensure_built():
            return 0.0
        if dtype is not None and prepare(self):
            return -1.0
        total = global_grad_norm(masters.pairs, float(norm_type), sharded=shards[0] is not None)
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            with torch.no_grad():
                for _, m in masters.pairs:
                    if m.grad is not None:
                        m.grad.mul_(coef)
        return total

    # --- state dicts ---------------------------------------------------------------------------

    def fp16_state(self: Any, cast_to_cpu: bool = True) -> dict[str, Any]:
        names = _names(model, masters)
        return {"fp32_from_fp16": {names[id(p)]: _on_cpu(m, cast_to_cpu) for p, m in masters.pairs
                                   if m is not p and id(p) in names},
                "loss_scaler": {"type": type(scaler).__name__, **scaler.state_dict()},
                "overflow": bool(self.overflow)}

    def local_optimizer_state_dict(self: Any, cast_to_cpu: bool = True) -> dict[str, Any]:
        """This rank's optimizer state by parameter name, marked ``_smp_is_partial`` (no fp16 states)."""
        cast_to_cpu = flag_arguments("optimizer.local_optimizer_state_dict", cast_to_cpu=cast_to_cpu)["cast_to_cpu"]
        ensure_built()
        sd = _by_name(self, model, masters, only_local=True, cast_to_cpu=cast_to_cpu, shard=shards[0])
        sd["_smp_is_partial"] = True
        sd[LOAD_INFO] = {"partition_info": model.partition_assignment}  # see apply()
        return shard_mark(sd)

    def local_fp16_state_dict(self: Any) -> dict[str, Any]:
        """The loss scaler and this rank's fp32 master weights (SMP v1's ``fp16_states``)."""
        ensure_built()
        return shard_mark({**fp16_state(self), "_smp_is_partial": True, "_smp_by_name": True})

    def local_state_dict(self: Any, cast_to_cpu: bool = True, gather_if_shard: bool = True,
                         fp32_states_only: bool = False) -> dict[str, Any]:
        """This rank's part of the optimizer (a partial checkpoint): its state by parameter name plus, under
        fp16/bf16, the loss scaler and the fp32 masters. ``fp32_states_only`` returns only the latter.

        With ``shard_optimizer_state: True`` this rank holds only its shard: ``gather_if_shard=True``
        (the default) gathers the shards of its RDP group into the complete state of its (pp, tp) part
        -- a collective: call it on every rank -- and ``gather_if_shard=False`` returns the shard alone,
        marked ``_smp_shard`` (save it on every rank with ``smp.save(..., v3=True)``).
        """
        flags = flag_arguments("optimizer.local_state_dict", cast_to_cpu=cast_to_cpu,
                               gather_if_shard=gather_if_shard, fp32_states_only=fp32_states_only)
        cast_to_cpu, gather_if_shard, fp32_states_only = flags.values()
        if fp32_states_only:
            sd = local_fp16_state_dict(self)
        else:
            sd = local_optimizer_state_dict(self, cast_to_cpu)
            if dtype is not None:
                sd.update(fp16_state(self, cast_to_cpu))
        if gather_if_shard and shards[0] is not None:
            from .runtime.comm import RDP_GROUP, allgather

            return merge_shards(allgather(sd, RDP_GROUP))
        return sd

    def state_dict(self: Any) -> dict[str, Any]:
        """Full optimizer state by parameter name, gathered over the pipeline and, under tensor parallelism,
        with TP-sharded states as full tensors (`optimizer_tp`): it loads in any layout. A collective
        over the model-parallel group: call it on every rank with ``rdp_rank() == 0``."""
        ensure_built()
        if shards[0] is not None:
            raise SMPCheckpointError(
                "optimizer.state_dict(): with shard_optimizer_state: True each rdp rank holds part of the optimizer "
                "state, so there is no full state dict on one rank (as in SMP v1). Fix: save partial -- "
                "smp.save_checkpoint(path, tag), or on every rank smp.save(optimizer.local_state_dict("
                "gather_if_shard=False), f, partial=True, v3=True); optimizer.local_state_dict() called on every "
                "rank gathers this stage's complete state")
        tp = tp_group()
        if not model.partitioned or st.cfg is None or st.cfg.pipeline_parallel_degree == 1:
            sd = _by_name(self, model, masters, only_local=False)
            if dtype is not None:
                sd.update(fp16_state(self))
            return gather_tp_state(sd, model_params(), tp) if tp is not None else sd
        from .runtime.comm import PP_GROUP, allgather

        local = local_state_dict(self)
        if tp is not None:  # TP shards -> full tensors, the same dict on every TP rank of the stage
            local = gather_tp_state(local, model_params(), tp)
        full = merge_shards(allgather(local, PP_GROUP))  # the stages hold disjoint parameters, as shards do
        full.pop("_smp_is_partial", None)
        full.pop(LOAD_INFO, None)
        return full

    def tp_group() -> Any:
        """The TP process group when tensor parallelism splits parameters, else None."""
        if st.rank_map is None or st.rank_map.tp_size == 1:
            return None
        from smp.topology import GroupKind

        from .runtime.init import runtime

        return runtime().groups[GroupKind.TP]

    def model_params() -> dict[str, torch.Tensor]:
        return dict(model.module.named_parameters(remove_duplicate=False))

    def apply(self: Any, sd: dict[str, Any]) -> None:
        """Load a by-name state dict into this rank's stepped tensors (after partitioning); the full
        tensors of a TP-sharded parameter's state (``state_dict()`` under TP, or saved without TP)
        give this rank's shard."""
        ensure_built()
        saved = saved_partition(sd.get(LOAD_INFO), sd)
        if saved is not None and model.cfg.pipeline_parallel_degree > 1 and saved != model.partition_assignment:
            # Saved under another partition: some of this rank's parameters were another rank's then.
            from .runtime.comm import PP_GROUP, allgather

            sd = merge_shards(allgather(sd, PP_GROUP))
        stepped = {id(p): m for p, m in masters.pairs}
        params = model_params()
        by_name = {n: stepped.get(id(p), p) for n, p in params.items()}
        local = {id(m) for m in stepped.values()}
        tp = tp_group()
        if "param_groups" in sd:
            for group, saved in zip(self.param_groups, sd["param_groups"]):
                group.update({k: v for k, v in saved.items() if k != "params"})
        for name, values in sd.get("state", {}).items():
            p = by_name.get(name)
            if p is None or id(p) not in local:
                continue
            values = {k: local_value(v, params[name], name, k, sd, tp) for k, v in values.items()}
            self.state[p] = {k: (v.to(device=p.device, dtype=p.dtype if v.is_floating_point() else v.dtype)
                                 if isinstance(v, torch.Tensor) and v.dim() > 0 else
                                 v.clone() if isinstance(v, torch.Tensor) else v) for k, v in values.items()}
        apply_fp16(self, sd)

    def apply_fp16(self: Any, sd: dict[str, Any]) -> None:
        ensure_built()
        if sd.get("fp32_from_fp16") and dtype is not None:
            params, tp = model_params(), tp_group()
            saved_masters = {n: local_value(v, params[n], n, "fp32 master", sd, tp) if n in params else v
                             for n, v in sd["fp32_from_fp16"].items()}
            masters.load_masters(saved_masters, _names(model, masters))
        saved = sd.get("loss_scaler")
        if isinstance(saved, dict) and dtype is torch.float16:
            if saved.get("type", type(scaler).__name__) != type(scaler).__name__:
                logger.warning("optimizer state: the checkpoint's loss scaler is a %s, this optimizer's a %s; "
                               "its scale %s is taken", saved.get("type"), type(scaler).__name__,
                               saved.get("cur_scale"))
                scaler.cur_scale = float(saved.get("cur_scale", scaler.cur_scale))
            else:
                scaler.load_state_dict(saved)
            self.loss_scale = scaler.loss_scale
        if "overflow" in sd:
            self.overflow = bool(sd["overflow"])

    def later(fn: Callable[..., None], sd: dict[str, Any]) -> None:
        if model.partitioned:
            fn(optimizer, sd)
        else:  # after partitioning each rank knows its parameters (SMP v1 defers the same way)
            pending.append((fn, sd))

    def load_state_dict(self: Any, state_dict: dict[str, Any], gather_if_shard: bool = False) -> None:
        """Load a full or partial (``local_state_dict``) state dict; before partitioning it waits until after.

        A shard (``local_state_dict(gather_if_shard=False)``, marked ``_smp_shard``) loads on the rdp rank
        that saved it when the sharding is the same; ``gather_if_shard=True`` (a collective over the RDP
        group: call it on every rank, each with its own shard) joins the shards first, so it loads with
        any sharding or none. A complete state dict loads anywhere (each rank takes what it steps).
        """
        gather_if_shard = flag_arguments("optimizer.load_state_dict", gather_if_shard=gather_if_shard)["gather_if_shard"]
        if not isinstance(state_dict, dict):
            raise SMPInvalidArgumentError([ConfigProblem("optimizer.load_state_dict(state_dict)",
                                                         type(state_dict).__name__, "must be a dict",
                                                         "pass what optimizer.state_dict() or local_state_dict() "
                                                         "returned")])
        if not state_dict.get("_smp_by_name"):
            orig_load(state_dict)
            return
        check_tp_degree(state_dict, st.rank_map.tp_size if st.rank_map is not None else 1)
        saved = state_dict.get(SHARD_KEY)
        if saved is not None and gather_if_shard:
            from .runtime.comm import RDP_GROUP, allgather

            state_dict = merge_shards(allgather(state_dict, RDP_GROUP))
        elif saved is not None:
            here = {"rdp_rank": st.rank_map.coord(st.rank).rdp_rank, "rdp_size": st.rank_map.rdp_size} \
                if sharding and st.rank_map is not None else None
            if saved != here:
                raise SMPCheckpointError(
                    f"optimizer.load_state_dict: this state dict is the optimizer-state shard of rdp rank "
                    f"{saved.get('rdp_rank')} of {saved.get('rdp_size')}, and this rank "
                    + (f"steps the shard of rdp rank {here['rdp_rank']} of {here['rdp_size']}" if here else
                       "keeps its whole state (shard_optimizer_state is off or rdp_size is 1)")
                    + ". Fix: load with optimizer.load_state_dict(sd, gather_if_shard=True) on every rank, each "
                      "with the shard it saved (smp.load finds it), or resume with smp.resume_from_checkpoint")
        later(apply, state_dict)

    def load_local_optimizer_state_dict(self: Any, state_dict: dict[str, Any]) -> None:
        """Load this rank's part saved by ``local_optimizer_state_dict`` / ``local_state_dict``."""
        if not (isinstance(state_dict, dict) and state_dict.get("_smp_is_partial")):
            raise SMPCheckpointError(
                "optimizer.load_local_optimizer_state_dict needs a partial state dict (from "
                "optimizer.local_optimizer_state_dict() or local_state_dict(), marked _smp_is_partial). Fix: "
                "load a full one with optimizer.load_state_dict(state_dict)")
        load_state_dict(self, state_dict)

    def load_local_fp16_state_dict(self: Any, fp16_states: dict[str, Any]) -> None:
        """Load what ``local_fp16_state_dict`` returned (loss scaler, fp32 masters)."""
        if not isinstance(fp16_states, dict) or not any(k in fp16_states for k in _FP16_KEYS):
            raise SMPCheckpointError(f"optimizer.load_local_fp16_state_dict needs the dict of "
                                     f"optimizer.local_fp16_state_dict() (keys {list(_FP16_KEYS)}), got "
                                     f"{sorted(fp16_states) if isinstance(fp16_states, dict) else type(fp16_states)}")
        later(apply_fp16, fp16_states)

    def load_optimizer_checkpoint(self: Any, path: str, tag: str | None = None) -> None:
        """Load this rank's optimizer part of a ``smp.save_checkpoint`` checkpoint (``tag`` None: the newest)."""
        from .checkpointing import files
        from .runtime.comm import pp_rank, tp_rank

        if tag is not None and tag.endswith("_partial") and not os.path.isdir(os.path.join(path, f"{tag}_partial")):
            tag = tag[: -len("_partial")]
        info = files.detect_rankinfo(path, tag, pp_rank(), tp_rank())
        got = files.read_partial_checkpoint(path, tag, info, load_optimizer=True)
        load_state_dict(self, got["optimizer"])
        if got.get("fp16_states"):
            load_local_fp16_state_dict(self, got["fp16_states"])

    def init_master_params(self: Any) -> None:
        """Create the fp32 masters now (after partitioning), or copy the model's weights into existing ones."""
        if masters.built:
            reload_model_params(self)
        else:
            ensure_built()

    def reload_model_params(self: Any) -> None:
        """Copy the model's current 16-bit weights into the fp32 masters (after editing the model's weights)."""
        if ensure_built():
            with torch.no_grad():
                for p, m in masters.pairs:
                    if m is not p:
                        m.copy_(p)
            masters._mark_in_sync(p for p, _ in masters.pairs)

    def _after_partition(_model: Any, _opt: Any) -> None:
        ensure_built()
        for fn, sd in pending:
            fn(optimizer, sd)
        pending.clear()

    methods: dict[str, Callable[..., Any]] = {
        "state_dict": state_dict, "load_state_dict": load_state_dict, "local_state_dict": local_state_dict,
        "local_optimizer_state_dict": local_optimizer_state_dict, "local_fp16_state_dict": local_fp16_state_dict,
        "load_local_optimizer_state_dict": load_local_optimizer_state_dict,
        "load_local_fp16_state_dict": load_local_fp16_state_dict,
        "load_optimizer_checkpoint": load_optimizer_checkpoint, "clip_master_grads": clip_master_grads,
        "init_master_params": init_master_params, "reload_model_params": reload_model_params,
    }
    if dtype is not None:
        methods.update(step=step, zero_grad=zero_grad)
    elif sharding:
        methods.update(step=sharded_step, zero_grad=sharded_zero_grad)
    for name, fn in methods.items():
        setattr(optimizer, name, types.MethodType(fn, optimizer))
    optimizer.orig_state_dict = orig_state_dict  # type: ignore[attr-defined]
    optimizer.orig_load_state_dict = orig_load  # type: ignore[attr-defined]
    optimizer.orig_step = orig_step  # type: ignore[attr-defined]
    optimizer.loss_scaler = scaler  # type: ignore[attr-defined]
    optimizer.loss_scale = scaler.loss_scale  # type: ignore[attr-defined]
    optimizer.dynamic_loss_scale = scaler.dynamic  # type: ignore[attr-defined]
    optimizer.overflow = False  # type: ignore[attr-defined]
    optimizer.master_weights = masters if dtype is not None else None  # type: ignore[attr-defined]
    optimizer.optimizer = optimizer  # type: ignore[attr-defined]
    optimizer.state_shard = lambda: shards[0]  # type: ignore[attr-defined]
    from .checkpointing.saving import take_pending

    resumed = take_pending("optimizer")
    if resumed is not None:  # resume_from_checkpoint ran before the optimizer existed
        load_state_dict(optimizer, resumed)
    model.register_post_partition_hook(_after_partition)
    st.optimizer = optimizer
    if model.partitioned:
        _after_partition(model, optimizer)
    return optimizer
