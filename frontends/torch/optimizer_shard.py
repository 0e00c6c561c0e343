"""``shard_optimizer_state: True``: each replica steps and keeps optimizer state for part of the parameters (ZeRO-1).

The ranks of one RDP group (same pipeline stage, same TP shard) hold the same parameters. With
sharding, each parameter gets one *owner* among them; only the owner keeps its optimizer state
(and, under fp16/bf16, its fp32 master) and steps it; after ``optimizer.step()`` every owner
broadcasts what it stepped to the others, so each replica again holds the same weights::

    gradients averaged over DP (as without sharding)
    rdp rank r: optimizer.step() over the parameters r owns    (state: ~1/rdp of the unsharded one)
    for r in rdp ranks: broadcast r's updated parameters        (one flat buffer per dtype)

SMP v1 splits a flattened buffer into equal slices (DeepSpeed's layout); smp assigns whole
parameters (largest first, to the least-loaded rank; torch's ``ZeroRedundancyOptimizer`` does the
same), so any optimizer steps exactly as unsharded -- LAMB's per-tensor trust ratio included -- and
the state dicts stay keyed by parameter name. The price is balance: a rank's share of the state is
1/rdp up to the largest parameter (`OptimizerShard.loads` says how far off it is).

A shard's state dict is marked ``_smp_shard: {"rdp_rank", "rdp_size"}``; `merge_shards` joins the
shards of one (pp, tp) rank into its complete state (what ``local_state_dict()`` returns by default).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from smp.topology import GroupKind

from .optimizer_tp import PER_TP_RANK
from .runtime.failure import wait

__all__ = ["SHARD_KEY", "OptimizerShard", "merge_shards", "optimizer_state_bytes"]

SHARD_KEY = "_smp_shard"
_BY_NAME = ("state", "fp32_from_fp16", PER_TP_RANK)  # entries keyed by parameter name


def _assign(sizes: Sequence[int], parts: int) -> list[int]:
    """The owner of each of ``sizes``: largest first to the least-loaded part (lowest index on ties)."""
    loads = [0] * parts
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(parts), key=lambda r: (loads[r], r))
        owner[i] = r
        loads[r] += sizes[i]
    return owner


class OptimizerShard:
    """Which rank of this RDP group steps each of this rank's parameters; the broadcast after a step.

    Built once, after partitioning, before the fp32 masters (so non-owned parameters never get one):
    removes the parameters this rank does not own from ``optimizer.param_groups`` (the group dicts
    stay: an LR scheduler made earlier keeps working) and drops any state they had.

    Args:
        optimizer: the user's optimizer, still holding the model's parameters.
        local: ids of this rank's parameters (after partitioning).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, local: set[int]) -> None:
        from .runtime.init import runtime

        rt = runtime()
        self.ranks: list[int] = list(rt.group_ranks[GroupKind.RDP])
        self.group = rt.groups[GroupKind.RDP]
        self.size = len(self.ranks)
        self.me = self.ranks.index(dist.get_rank())
        # Every parameter of the optimizer that this rank holds, in the optimizer's order (the same
        # on every RDP rank: same script, same partition).
        self.full_groups: list[list[torch.nn.Parameter]] = [
            [p for p in g["params"] if id(p) in local] for g in optimizer.param_groups]
        self.params: list[torch.nn.Parameter] = [p for g in self.full_groups for p in g]
        owners = _assign(self._agreed_sizes(rt), self.size)
        self.owner: dict[int, int] = {id(p): r for p, r in zip(self.params, owners)}
        self.loads = [sum(p.numel() for p in self.params if self.owner[id(p)] == r) for r in range(self.size)]
        for group in optimizer.param_groups:
            kept = [p for p in group["params"] if self.owner.get(id(p), self.me) == self.me]
            for p in group["params"]:
                if self.owner.get(id(p), self.me) != self.me:
                    optimizer.state.pop(p, None)
            group["params"] = kept

    def _agreed_sizes(self, rt: Any) -> list[int]:
        """Parameter sizes the TP peers agree on (their shards may differ by a row): the largest of each.

        TP peers must pick the same owners (rdp rank r of every TP rank owns the same parameters), so
        that the norms FusedLAMB completes over the TP group add matching shards.
        """
        sizes = [p.numel() for p in self.params]
        tp_ranks = rt.group_ranks[GroupKind.TP]
        if len(tp_ranks) > 1:
            from .runtime.comm import TP_GROUP, allgather

            sizes = [max(column) for column in zip(*allgather(sizes, TP_GROUP), strict=True)]
        return sizes

    def owns(self, p: torch.Tensor) -> bool:
        return self.owner.get(id(p), self.me) == self.me

    @property
    def mark(self) -> dict[str, int]:
        return {"rdp_rank": self.me, "rdp_size": self.size}

    def zero_foreign_grads(self, set_to_none: bool) -> None:
        """``zero_grad`` of the parameters the optimizer no longer lists (those other ranks own)."""
        for p in self.params:
            if not self.owns(p) and p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def broadcast_stepped(self) -> None:
        """Every owner's parameters to the rest of the group (after every owner stepped its own)."""
        with torch.no_grad():
            for r in range(self.size):
                mine = [p for p in self.params if self.owner[id(p)] == r and p.numel()]
                by_kind: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
                for p in mine:
                    by_kind.setdefault((p.dtype, p.device), []).append(p)
                for tensors in by_kind.values():
                    flat = _flatten_dense_tensors([p.data for p in tensors])
                    wait(dist.broadcast(flat, self.ranks[r], group=self.group, async_op=True),
                         f"shard_optimizer_state: parameters stepped by rdp rank {r}", self.ranks)
                    if r != self.me:
                        for p, value in zip(tensors, _unflatten_dense_tensors(flat, [p.data for p in tensors]),
                                            strict=True):
                            p.data.copy_(value)


def merge_shards(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """By-name optimizer state dicts of disjoint parameter sets joined into one: the shards of one (pp, tp)
    rank (ordered by rdp rank), or the parts of the pipeline stages (in the order given)."""
    ordered = sorted(parts, key=lambda sd: sd.get(SHARD_KEY, {}).get("rdp_rank", 0))
    full = {k: v for k, v in ordered[0].items() if k not in (*_BY_NAME, SHARD_KEY)}
    full["state"] = {}
    for sd in ordered:
        for key in _BY_NAME:
            if key in sd:
                full.setdefault(key, {}).update(sd[key])
    return full


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds for the optimizer: its state tensors, and fp32 masters of 16-bit weights."""
    state = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    masters = getattr(optimizer, "master_weights", None)
    master = sum(m.numel() * m.element_size() for p, m in masters.pairs if m is not p) if masters is not None else 0
    return {"state": state, "masters": master}
