"""Tensor-parallel parameters: how a shard is cut from a full tensor, and how it is marked.

A TP-sharded parameter carries two attributes: ``tp_sharded = True`` and ``tp_split_dim`` (the
dimension of the full tensor it was cut along). Everything else a TP layer owns is replicated:
identical on every TP rank, with identical gradients. Data parallelism needs the difference (see
`is_tp_sharded`): a sharded gradient is averaged over the RDP group only (the ranks that hold the
same shard), a replicated one over the whole DP group.

Parameters are initialised from the *full* tensor: every rank draws the full weight from the
default generator and keeps its slice. The default generator therefore advances identically on
every TP rank, so replicated parameters created afterwards are identical too (given the same
seed), and a TP layer built after ``torch.manual_seed(s)`` holds exactly the slices of the dense
layer built after the same seed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .group import divide, group_rank, group_size

__all__ = ["shard_tensor", "mark_tp_sharded", "is_tp_sharded", "tp_split_dim", "sharded_parameter",
           "gather_full", "gather_named", "full_state_dict", "shard_packed"]


def shard_tensor(full: torch.Tensor, dim: int, group: Any, what: str = "size") -> torch.Tensor:
    """This rank's contiguous slice of ``full`` along ``dim`` (a copy, detached).

    Example:
        >>> shard_tensor(torch.arange(6).view(2, 3), dim=0, group=None).tolist()
        [[0, 1, 2], [3, 4, 5]]
    """
    tp = group_size(group)
    part = divide(full.shape[dim], tp, what)
    start = group_rank(group) * part
    return full.detach().narrow(dim, start, part).clone().contiguous()


def mark_tp_sharded(param: torch.Tensor, dim: int, packed: int = 1) -> torch.Tensor:
    """Mark ``param`` as a TP shard cut along ``dim`` of the full tensor; returns it.

    ``packed=k`` says the full tensor is ``k`` tensors concatenated along ``dim`` (Mixtral's
    ``gate_up_proj`` is gate and up: ``packed=2``) and the shard is the concatenation of this
    rank's slice of each (see `shard_packed`).
    """
    param.tp_sharded = True  # type: ignore[attr-defined]
    param.tp_split_dim = dim  # type: ignore[attr-defined]
    param.tp_packed = packed  # type: ignore[attr-defined]
    return param


def is_tp_sharded(param: torch.Tensor) -> bool:
    """True for a TP shard (its gradient is reduced over RDP, not DP).

    Example:
        >>> is_tp_sharded(torch.nn.Parameter(torch.zeros(2)))
        False
    """
    return bool(getattr(param, "tp_sharded", False))


def tp_split_dim(param: torch.Tensor) -> int | None:
    """The dimension a TP shard was cut along; None for a replicated parameter."""
    return int(param.tp_split_dim) if is_tp_sharded(param) else None  # type: ignore[attr-defined]


def shard_packed(full: torch.Tensor, dim: int, packed: int, group: Any, what: str = "size") -> torch.Tensor:
    """This rank's slice of each of the ``packed`` equal parts of ``full`` along ``dim``, concatenated.

    Example (two ranks would get ``[g0, u0]`` and ``[g1, u1]`` of ``[g0, g1, u0, u1]``):
        >>> shard_packed(torch.arange(4), 0, 2, None).tolist()
        [0, 1, 2, 3]
    """
    parts = full.detach().chunk(packed, dim=dim)
    return torch.cat([shard_tensor(p, dim, group, what) for p in parts], dim=dim)


def sharded_parameter(full: torch.Tensor, dim: int, group: Any, what: str) -> nn.Parameter:
    """A marked `nn.Parameter` holding this rank's slice of ``full`` along ``dim``."""
    p = nn.Parameter(shard_tensor(full, dim, group, what))
    mark_tp_sharded(p, dim)
    return p


def gather_full(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """The full tensor of a TP shard (allgather along its split dim); a replicated tensor as is.

    A collective over ``group`` for shards: every TP rank must call it for the same parameter.

    Example:
        >>> gather_full(torch.nn.Parameter(torch.ones(2)), None).tolist()
        [1.0, 1.0]
    """
    dim = tp_split_dim(tensor)
    t = tensor.detach()
    if dim is None or group_size(group) == 1:
        return t.clone()
    parts = [torch.empty_like(t, memory_format=torch.contiguous_format) for _ in range(group_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    packed = int(getattr(tensor, "tp_packed", 1))
    if packed == 1:
        return torch.cat(parts, dim=dim)
    pieces = [p.chunk(packed, dim=dim) for p in parts]
    return torch.cat([pieces[r][k] for k in range(packed) for r in range(len(parts))], dim=dim)


def gather_named(tensors: dict[str, torch.Tensor], group: Any) -> dict[str, torch.Tensor]:
    """Full (TP-gathered, detached, CPU) copies of ``tensors`` by name; aliases share one gather.

    A collective over ``group``: every TP rank passes the same names in the same order.
    """
    done: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if id(t) not in done:
            done[id(t)] = gather_full(t, group).cpu()
        out[name] = done[id(t)]
    return out


def full_state_dict(module: nn.Module, group: Any, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter of ``module`` (or its gradient, with ``grads=True``) as the full tensor.

    A collective over ``group``. Parameter names are unchanged, so a converted model's result
    compares key by key with the dense model's ``named_parameters()``.
    """
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        src = p.grad if grads else p
        if src is None:
            continue
        if is_tp_sharded(p):
            src = mark_tp_sharded(src.detach(), int(p.tp_split_dim),  # type: ignore[attr-defined]
                                  int(getattr(p, "tp_packed", 1)))
        out[name] = gather_full(src, group)
    return out
