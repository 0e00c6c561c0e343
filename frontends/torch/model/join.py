"""Uneven inputs across data-parallel replicas: ``with model.join():`` (SMP v1, DDP's join protocol).

A replica that runs out of batches leaves the loop inside the block and, at the block's end,
shadows the data-parallel collectives of the replicas still training, step by step, until every
replica is done; then all replicas take the parameters and buffers of one that trained longest
(the others missed its last optimizer steps). A step of a replica inside the block runs, over its
DP group::

    step start   flags   allreduce: which DP ranks still train (1 from each, 0 from a shadow)
                 buffers broadcast from the highest DP rank still training (broadcast_buffers)
    step end     mask    allreduce (max): which local parameters hold a gradient on any replica
                 grads   the usual bucketed average; a shadow contributes zeros

A shadow answers the same calls in the same order, so nothing hangs. Gradients are divided by the
initial DP size (``divide_by_initial_world_size=True``, DDP's default: the finished replicas count
as zero gradients) or by the number still training. The mask makes the step-end sync cover the
same parameters on every replica even when a step has no backward (evaluation): there a replica
with no gradients anywhere syncs nothing, as outside the block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

import smp.state as smp_state
from smp.errors import SMPError
from smp.topology import GroupKind

from ..errors import DDPNotEnabledError, ModelNotPartitionedError, UnevenInputsError
from ..nn.params import is_tp_sharded
from ..runtime.failure import wait
from ..runtime.init import runtime
from . import data_parallel

__all__ = ["UnevenInputs", "UnevenInputsError", "check_can_join", "finish_join"]


class UnevenInputs:
    """One ``with model.join():`` block on this rank: its side of the protocol above."""

    def __init__(self, divide_by_initial_world_size: bool, throw_on_early_termination: bool) -> None:
        rt = runtime()
        self.dp_group, self.dp_ranks = rt.groups[GroupKind.DP], list(rt.group_ranks[GroupKind.DP])
        self.rdp_group, self.rdp_ranks = rt.groups[GroupKind.RDP], list(rt.group_ranks[GroupKind.RDP])
        self.rank = smp_state.current().rank
        self.divide_by_initial = divide_by_initial_world_size
        self.throw = throw_on_early_termination
        self.training = list(self.dp_ranks)  # the DP ranks still training, as of the last flags allreduce

    # --- the replicas still training ------------------------------------------------------------------

    def begin_step(self) -> None:
        """At the start of a step of this (training) rank: the flags allreduce."""
        self._count(True)
        if self.throw and len(self.training) < len(self.dp_ranks):
            raise UnevenInputsError(self._early("these DP ranks are still training"))

    def broadcast_buffers(self, buffers: Iterable[torch.Tensor]) -> None:
        """Every replica takes the buffers of the highest DP rank still training (TP shards: RDP)."""
        dp_src, rdp_src = self._source(self.training)
        for b in buffers:
            pg, ranks, src = (self.rdp_group, self.rdp_ranks, rdp_src) if is_tp_sharded(b) else \
                (self.dp_group, self.dp_ranks, dp_src)
            if b.numel() and len(ranks) > 1:
                wait(dist.broadcast(b.data, src, group=pg, async_op=True), "model.join(): buffer broadcast", ranks)

    def sync_gradients(self, params: Iterable[torch.nn.Parameter], bucket_cap_mb: int, training: bool) -> None:
        """The step-end gradient average; a shadow (``training=False``) contributes zeros and keeps its own."""
        params = list(params)
        mask = torch.tensor([float(training and p.grad is not None) for p in params])
        if params and len(self.dp_ranks) > 1:
            wait(dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=self.dp_group, async_op=True),
                 "model.join(): which parameters hold gradients", self.dp_ranks)
        chosen = [p for p, m in zip(params, mask.tolist(), strict=True) if m > 0]
        kept = [p.grad for p in chosen]
        for p in chosen:
            if not training or p.grad is None:  # zeros from a shadow, or from a replica this param missed
                p.grad = torch.zeros_like(p)
        data_parallel.sync_gradients(chosen, bucket_cap_mb)
        if not training:
            for p, g in zip(chosen, kept, strict=True):
                p.grad = g
            return
        if not self.divide_by_initial:
            with torch.no_grad():
                for p in chosen:
                    ranks = self.rdp_ranks if is_tp_sharded(p) else self.dp_ranks
                    still = sum(1 for r in ranks if r in self.training)
                    if p.grad is not None and 0 < still < len(ranks):
                        p.grad.mul_(len(ranks) / still)

    # --- this rank, after its last batch ----------------------------------------------------------

    def drain(self, shadow_step: Callable[[], None]) -> bool:
        """Run ``shadow_step`` once per step of the others until every replica is done.

        Returns whether this rank was among the last to finish (it shadowed nothing).
        """
        last = True
        while True:
            self._count(False)
            if not self.training:
                return last
            if self.throw:
                raise UnevenInputsError(self._early(f"rank {self.rank} ran out of batches while these DP ranks "
                                                    f"were still training"))
            last = False
            shadow_step()

    def sync_final(self, last: bool, tensors: Iterable[torch.Tensor]) -> None:
        """Every replica takes the parameters and buffers of the highest DP rank among the last to finish."""
        flags = torch.zeros(len(self.dp_ranks))
        if last:
            flags[self.dp_ranks.index(self.rank)] = 1.0
        if len(self.dp_ranks) > 1:
            wait(dist.all_reduce(flags, group=self.dp_group, async_op=True), "model.join(): the last replicas",
                 self.dp_ranks)
        lasts = [r for r, f in zip(self.dp_ranks, flags.tolist(), strict=True) if f > 0]
        dp_src, rdp_src = self._source(lasts)
        for t in tensors:
            pg, ranks, src = (self.rdp_group, self.rdp_ranks, rdp_src) if is_tp_sharded(t) else \
                (self.dp_group, self.dp_ranks, dp_src)
            if t.numel() and len(ranks) > 1:
                wait(dist.broadcast(t.data, src, group=pg, async_op=True), "model.join(): final model broadcast",
                     ranks)

    # --- helpers ------------------------------------------------------------------------------------

    def _count(self, training: bool) -> None:
        flags = torch.zeros(len(self.dp_ranks))
        if training:
            flags[self.dp_ranks.index(self.rank)] = 1.0
        if len(self.dp_ranks) > 1:
            wait(dist.all_reduce(flags, group=self.dp_group, async_op=True),
                 "model.join(): count the replicas still training", self.dp_ranks)
        self.training = [r for r, f in zip(self.dp_ranks, flags.tolist(), strict=True) if f > 0]

    def _source(self, candidates: list[int]) -> tuple[int, int]:
        """(DP source, RDP source): the highest candidate in each of this rank's groups."""
        in_rdp = [r for r in candidates if r in self.rdp_ranks]
        if not candidates or not in_rdp:
            raise UnevenInputsError(
                f"model.join(): the replicas still training ({candidates}) include none of this rank's RDP group "
                f"{self.rdp_ranks}: the ranks of one tensor-parallel group ran different numbers of steps. Fix: "
                f"give every rank of a TP group the same number of batches (only DP replicas may differ)")
        return max(candidates), max(in_rdp)

    def _early(self, what: str) -> str:
        done = [r for r in self.dp_ranks if r not in self.training]
        return (f"model.join(throw_on_early_termination=True): DP ranks {done} ran out of batches; {what}: "
                f"{self.training}. Fix: give every replica the same number of batches (e.g. DistributedSampler "
                f"with drop_last=True), or leave throw_on_early_termination False to train on")


def check_can_join(cfg: Any, enable: bool, active: UnevenInputs | None) -> None:
    """Refuse ``model.join()`` where the protocol cannot run, before the block starts."""
    if not cfg.ddp:
        raise DDPNotEnabledError("model.join() needs data parallelism: set ddp: True in the smp config "
                                 "(SMP v1 raised here too)")
    if not enable:
        return
    if active is not None:
        raise SMPError("model.join() inside another model.join() block: use one block around the loop")
    if cfg.shard_optimizer_state and len(runtime().group_ranks[GroupKind.RDP]) > 1:
        raise SMPError("model.join() with shard_optimizer_state: True: a replica that ran out of batches would "
                       "miss the optimizer steps of the parameters it owns, so the others would wait for them. "
                       "Fix: give every replica the same number of batches (DistributedSampler(drop_last=True) "
                       "over smp.dp_size() replicas), or turn shard_optimizer_state off")


def finish_join(model: Any, join: UnevenInputs) -> None:
    """At the block's end: shadow the replicas still training, then take the longest-trained model."""
    if not model.partitioned:
        raise ModelNotPartitionedError("model.join(): this rank ran no step inside the block, so the model was "
                                       "never partitioned here. Fix: give every replica at least one batch")
    last = join.drain(model._shadow_step)
    join.sync_final(last, [*model.local_parameters(), *model.local_buffers()])
    optimizer = smp_state.current().optimizer
    if getattr(optimizer, "master_weights", None) is not None:
        optimizer.reload_model_params()  # fp16/bf16: the masters take the weights every replica now has
