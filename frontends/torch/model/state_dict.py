"""State dicts of a partitioned model, and the one full-state gather behind them.

A rank's *stage* is its own entries of the module's state dict (every name, tied weights too), with
TP shards either kept (``cpu()``: the TP layers compute with them) or gathered into full tensors
(`state_dict`, `save_pretrained`: loadable by the unsharded model). `merge_stages` joins the stages
of one pipeline; before the first step partitions the model, or at pp == 1, a stage already is
the whole model and nothing moves.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

import smp.state as smp_state
from smp.topology import GroupKind

from ..nn.params import gather_named, is_tp_sharded, shard_packed
from ..runtime.init import runtime
from .interface import LocalView

__all__ = ["LOAD_INFO", "full_state", "gather_to_cpu", "join_partial", "load", "saved_partition", "local_state_tensors", "merge_stages", "save_pretrained",
           "stage_state"]


LOAD_INFO = "_smp_load_info"  # SMP v1's layout record in a partial model state dict


def saved_partition(info: Any, state: dict[str, Any]) -> dict[str, int] | None:
    """The partition a partial state dict was saved with (``info``: its `LOAD_INFO`), or None."""
    if not state.get("_smp_is_partial") or not isinstance(info, dict) or not info.get("partition_info"):
        return None
    return dict(info["partition_info"])


def join_partial(model: LocalView, state: dict[str, Any]) -> dict[str, Any]:
    """The partial state dicts of this pipeline's ranks (each passes its own), joined: what a rank
    needs after the partition changed since the save. A collective over the PP group."""
    from ..runtime.comm import PP_GROUP, allgather

    joined: dict[str, Any] = {}
    for part in allgather(state, PP_GROUP):
        for name, value in part.items():
            joined.setdefault(name, value)
    return joined


def local_state_tensors(model: LocalView) -> dict[str, torch.Tensor]:
    """This rank's entries of the module's state dict, under every name (tied weights too)."""
    ids = {id(p) for p in model.local_parameters()} | {id(b) for b in model.local_buffers()}
    return {k: v for k, v in model.module.state_dict(keep_vars=True).items() if id(v) in ids}


def _split(model: LocalView) -> bool:
    """Whether the pipeline stages hold different parameters (partitioned with pp > 1)."""
    return model.partitioned and model.cfg.pipeline_parallel_degree > 1


def stage_state(model: LocalView, *, full_tp: bool) -> dict[str, torch.Tensor]:
    """This rank's stage as detached CPU tensors; ``full_tp``: TP shards gathered (a TP collective).

    keep_vars=True is read even when plain tensors come out: the TP marks (``tp_split_dim``) live
    on the Parameter objects, and the detached copies of keep_vars=False lose them, so shards
    would pass for whole tensors.
    """
    own = local_state_tensors(model) if _split(model) else model.module.state_dict(keep_vars=True)
    if full_tp and model.cfg.tensor_parallel_degree > 1:
        return gather_named(own, runtime().groups[GroupKind.TP])
    return {k: v.detach().cpu() for k, v in own.items()}


def merge_stages(model: LocalView, stage: dict[str, torch.Tensor],
                 to: Literal["all", "pp0"]) -> dict[str, torch.Tensor]:
    """Every stage of this pipeline in the module's state-dict order (a collective over the PP group).

    ``to="pp0"``: only pp_rank 0 receives (the others return ``{}``); ``"all"``: every rank. A
    weight on two stages (tied) is taken from the lower pp_rank.
    """
    if not _split(model):
        return stage
    from ..runtime.comm import PP_GROUP, RankType, allgather, pp_rank, pp_size, recv_from, send

    if to == "all":
        parts = allgather(stage, PP_GROUP)
    elif pp_rank() == 0:
        parts = [stage] + [recv_from(peer, RankType.PP_RANK) for peer in range(1, pp_size())]
    else:
        send(stage, 0, RankType.PP_RANK)
        return {}
    full: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, t in part.items():
            full.setdefault(name, t)
    order = list(model.module.state_dict(keep_vars=True))
    return {k: full[k] for k in order if k in full}


def full_state(model: LocalView, *, to: Literal["all", "pp0"]) -> dict[str, torch.Tensor]:
    """The whole model as full tensors: the one gather of `state_dict` and `save_pretrained`."""
    return merge_stages(model, stage_state(model, full_tp=True), to)


def state_dict(model: LocalView, prefix: str, keep_vars: bool, cast_to_cpu: bool,
               gather_to_rank0: bool) -> dict[str, Any]:
    """`DistributedModel.state_dict`: see there."""
    if not _split(model) and model.cfg.tensor_parallel_degree == 1:
        # Nothing to gather: the module's own tensors (kept as Variables when asked).
        sd = model.module.state_dict(keep_vars=keep_vars)
        return {prefix + k: (v.detach().cpu() if cast_to_cpu and isinstance(v, torch.Tensor) else v)
                for k, v in sd.items()}
    full = full_state(model, to="pp0" if gather_to_rank0 else "all")
    if _split(model) and gather_to_rank0 and smp_state.current().rank != 0:
        return {}
    return {prefix + k: v for k, v in full.items()}


def load(model: LocalView, state: dict[str, Any], strict: bool) -> None:
    """Copy ``state`` (full or partial; TP shards or full tensors) into this rank's tensors."""
    partial = bool(state.get("_smp_is_partial", False))
    own = local_state_tensors(model)
    missing = [k for k in own if k not in state]
    if strict and missing:
        raise KeyError(f"load_state_dict: missing keys for this rank's modules: {missing[:8]}")
    known = set(model.module.state_dict(keep_vars=True))
    unexpected = [k for k in state if k != "_smp_is_partial" and k not in known]
    if strict and unexpected and not partial:
        raise KeyError(f"load_state_dict: unexpected keys: {unexpected[:8]}")
    with torch.no_grad():
        for k, t in own.items():
            if k in state:
                value = state[k]
                if is_tp_sharded(t) and tuple(value.shape) != tuple(t.shape):
                    # a full tensor (a full checkpoint, an unsharded model's state dict): this
                    # rank's shard of it
                    value = shard_packed(value, int(t.tp_split_dim), int(getattr(t, "tp_packed", 1)),
                                         runtime().groups[GroupKind.TP], k)
                t.copy_(value)


def gather_to_cpu(model: LocalView) -> None:
    """Fill this process's module with every stage's tensors (TP layers keep this rank's shards).

    Over the pipeline of this tp_rank only: a TP rank must receive its own shards of the other
    stages, not another TP rank's (the MP group mixes them under one name).
    """
    if not _split(model):
        return
    stage = stage_state(model, full_tp=False)
    full = merge_stages(model, stage, "all")
    with torch.no_grad():
        for name, t in model.module.state_dict(keep_vars=True).items():
            if name in full and name not in stage:
                if isinstance(t, nn.Parameter) and t.numel() == 0:
                    t.data = full[name].clone()
                elif t.shape == full[name].shape:
                    t.copy_(full[name])


def save_pretrained(model: LocalView, path: str, **kwargs: Any) -> None:
    """`DistributedModel.save_pretrained`; a collective over the world.

    Only the first replica (``rdp_rank() == 0``) contributes: its TP ranks gather their stage's
    shards, tp_rank 0's pipeline merges the stages on global rank 0, which writes.
    """
    from ..runtime.comm import barrier, rank, rdp_rank, tp_rank
    from ..tp.hf_checkpoint import require_hf

    module = model.module
    require_hf(module)
    if rdp_rank() == 0:
        stage = stage_state(model, full_tp=True)
        if tp_rank() == 0:
            full = merge_stages(model, stage, "pp0")
            if rank() == 0:
                lost = [n for n in module.state_dict(keep_vars=True) if n not in full]
                if lost:
                    raise RuntimeError(f"save_pretrained: no pipeline stage holds {lost[:5]}")
                module.save_pretrained(path, state_dict=full, **kwargs)  # type: ignore[operator]
    barrier()
