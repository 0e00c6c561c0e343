"""A full optimizer state dict under tensor parallelism: TP-sharded states gathered, and sliced back.

Under TP a rank's optimizer holds, for each sharded parameter, state of the shard's shape (Adam's
``exp_avg``: the rank's rows of the full moment). ``optimizer.state_dict()`` returns what
``model.state_dict()`` returns for the parameters: full tensors under the parameters' names, so
the dict loads in any layout (another tp or pp degree, or one process without smp)::

    tp rank 0: exp_avg of q_proj.weight rows 0:H/2  --+
                                                       +--> all_gather along tp_split_dim --> (H, H)
    tp rank 1: exp_avg of q_proj.weight rows H/2:H  --+

A state tensor of the parameter's shape is sharded like the parameter (every elementwise
optimizer: SGD, Adam, AdamW, Adadelta, Adagrad, RMSprop, LAMB); so are the fp32 masters of fp16
training. Any other tensor state of a sharded parameter (a factored second moment, say) has no
known full form: each TP rank's own value is kept under `PER_TP_RANK`, and a load at another
``tensor_parallel_degree`` raises, naming the parameter and the state, instead of loading wrong
numbers (`local_value`).
"""

from __future__ import annotations

from typing import Any

import torch

from smp.errors import SMPCheckpointError

from .nn.params import gather_full, is_tp_sharded, mark_tp_sharded, shard_packed

__all__ = ["PER_TP_RANK", "check_tp_degree", "gather_tp_state", "local_value"]

PER_TP_RANK = "_smp_per_tp_rank"  # name -> state key -> [value on tp rank 0, 1, ...]


def _marked_like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    return mark_tp_sharded(value.detach(), int(param.tp_split_dim),  # type: ignore[attr-defined]
                           int(getattr(param, "tp_packed", 1)))


def gather_tp_state(sd: dict[str, Any], params: dict[str, torch.Tensor], group: Any) -> dict[str, Any]:
    """``sd`` (a by-name local state dict) with the TP-sharded states of ``params`` as full CPU tensors.

    A collective over the TP ``group``: every TP rank of the stage calls it with its own ``sd``.

    Raises:
        SMPCheckpointError: the TP ranks hold state for different parameters or keys (they stepped
            different parameters: an optimizer built differently on some TP rank).
    """
    from .runtime.comm import TP_GROUP, allgather

    state = sd.get("state", {})
    sharded = sorted(n for n in state if n in params and is_tp_sharded(params[n]))
    layout = []  # (name, key, gathered along the split dim?) on this rank, in one order
    per_rank: dict[str, dict[str, Any]] = {}
    for name in sharded:
        p = params[name]
        for key, value in sorted(state[name].items()):
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue  # a step count: the same on every TP rank
            elementwise = tuple(value.shape) == tuple(p.shape)
            layout.append((name, key, elementwise))
            if not elementwise:
                per_rank.setdefault(name, {})[key] = value.detach().cpu()
    masters = sorted(n for n in sd.get("fp32_from_fp16", {}) if n in params and is_tp_sharded(params[n]))
    mine = (layout, masters, per_rank)
    everyone = allgather(mine, TP_GROUP)
    if any(other[:2] != mine[:2] for other in everyone):
        differ = [r for r, other in enumerate(everyone) if other[:2] != mine[:2]]
        raise SMPCheckpointError(
            f"optimizer.state_dict(): the TP ranks of this stage hold optimizer state for different parameters "
            f"(tp ranks {differ} differ from this one), so the shards cannot be joined. Fix: build the optimizer "
            "from model.parameters() on every rank, and call optimizer.state_dict() on every rank with "
            "rdp_rank() == 0 after the same steps")
    out = {**sd, "state": {n: dict(s) for n, s in state.items()}}
    for name, key, elementwise in layout:
        if elementwise:
            out["state"][name][key] = gather_full(_marked_like(state[name][key], params[name]), group).cpu()
        else:
            values = [other[2][name][key] for other in everyone]
            out["state"][name][key] = values[0]  # the same dict on every TP rank
            out.setdefault(PER_TP_RANK, {}).setdefault(name, {})[key] = values
    if masters:
        out["fp32_from_fp16"] = dict(sd["fp32_from_fp16"])
        for name in masters:
            out["fp32_from_fp16"][name] = gather_full(_marked_like(sd["fp32_from_fp16"][name], params[name]),
                                                      group).cpu()
    return out


def check_tp_degree(saved: dict[str, Any], tp_size: int) -> None:
    """Raise at load time (before the load waits for partitioning) when ``saved`` holds per-TP-rank
    states of another ``tensor_parallel_degree``."""
    for name, keys in saved.get(PER_TP_RANK, {}).items():
        for key, kept in keys.items():
            if len(kept) != tp_size:
                raise SMPCheckpointError(_per_rank_message(name, key, len(kept), tp_size))


def _per_rank_message(name: str, key: str, saved_tp: int, tp_size: int) -> str:
    return (f"optimizer.load_state_dict: the state {key!r} of {name!r} was saved per TP rank at "
            f"tensor_parallel_degree {saved_tp} (it is not elementwise, so it has no full form) and this run has "
            f"{tp_size}. Fix: load it with tensor_parallel_degree {saved_tp}, or drop that state from the dict to "
            "start it afresh")


def local_value(value: Any, param: torch.Tensor, name: str, key: str, saved: dict[str, Any], group: Any) -> Any:
    """This rank's part of a saved state ``value`` of ``param`` (``key`` of ``name``; ``saved`` the whole dict).

    A full tensor of a sharded parameter (from `gather_tp_state`, or saved without TP) gives this
    rank's shard; a shard (a partial checkpoint of the same layout) is taken as it is.

    Raises:
        SMPCheckpointError: a per-TP-rank state saved at another ``tensor_parallel_degree``.
    """
    from .nn.group import group_rank, group_size

    kept = saved.get(PER_TP_RANK, {}).get(name, {}).get(key)
    if kept is not None:
        if len(kept) != group_size(group):
            raise SMPCheckpointError(_per_rank_message(name, key, len(kept), group_size(group)))
        return kept[group_rank(group)]
    if not is_tp_sharded(param) or not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    if tuple(value.shape) == tuple(param.shape):
        return value
    return shard_packed(value, int(param.tp_split_dim), int(getattr(param, "tp_packed", 1)),  # type: ignore[attr-defined]
                        group, f"optimizer state {key!r} of {name!r}")
