"""Data parallelism of a partitioned model: same start on every replica, averaged gradients.

Replicated tensors synchronise over the DP group; TP-sharded ones over the replicas of the same
shard (the RDP group). Gradients are averaged in flat buckets of ``bucket_cap_mb`` after the step
(not overlapped with backward: the pipeline engine owns backward's threads).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from smp.topology import GroupKind

from ..nn.params import is_tp_sharded
from ..runtime.failure import wait
from ..runtime.init import runtime

__all__ = ["MicrobatchAverage", "broadcast_from_dp0", "sync_gradients"]

Groups = tuple[tuple[Any, list[int]], tuple[Any, list[int]]]
_HALF = (torch.float16, torch.bfloat16)


def _reduction_groups() -> Groups:
    """(DP group, RDP group): replicated tensors sync over DP, TP-sharded ones over RDP."""
    rt = runtime()
    return ((rt.groups[GroupKind.DP], rt.group_ranks[GroupKind.DP]),
            (rt.groups[GroupKind.RDP], rt.group_ranks[GroupKind.RDP]))


def broadcast_from_dp0(tensors: Iterable[torch.Tensor]) -> None:
    """Make every DP replica hold DP rank 0's values of ``tensors`` (TP shards: RDP rank 0's)."""
    (dp, dp_ranks), (rdp, rdp_ranks) = _reduction_groups()
    for t in tensors:
        pg, ranks = (rdp, rdp_ranks) if is_tp_sharded(t) else (dp, dp_ranks)
        if t.numel() and len(ranks) > 1:
            wait(dist.broadcast(t.data, ranks[0], group=pg, async_op=True), "broadcast from DP rank 0", ranks)


class MicrobatchAverage:
    """Average the microbatches' gradients of ``params`` over ``count`` (while ``enabled()``).

    Without a gradient before the step (``zero_grad`` sets ``.grad`` to None), the step's sum is
    divided once, in place, when the step ends: one pass over the parameters instead of one
    division (and a new tensor) per parameter per microbatch. A parameter that already holds a
    gradient (``backward_passes_per_step``, or a script accumulating over steps without
    ``zero_grad``) must not have that divided too: its microbatch gradients are divided as autograd
    produces them, and so are 16-bit ones (``fp16``/``bf16``: the sum may overflow where the mean fits). Parameters frozen at partition time are left alone (torch refuses hooks on
    them); one unfrozen later accumulates sums. Inside the step body, after ``model.backward``, a
    gradient of the first kind is still the sum.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], count: int, enabled: Callable[[], bool]) -> None:
        self.count = count
        self.enabled = enabled
        self.params = [p for p in params if p.requires_grad] if count > 1 else []
        self._at_end: list[torch.nn.Parameter] = []
        self._as_made: set[int] = set()
        for p in self.params:
            p.register_hook(self._hook(p))

    def _hook(self, p: torch.nn.Parameter) -> Callable[[torch.Tensor], torch.Tensor]:
        key = id(p)

        def average(grad: torch.Tensor) -> torch.Tensor:
            return grad / self.count if key in self._as_made else grad

        return average

    def begin(self) -> None:
        """Before the step's first backward: sort the parameters by whether they hold a gradient."""
        self._at_end, self._as_made = [], set()
        if not self.params or not self.enabled():
            return
        for p in self.params:
            # A 16-bit gradient is divided as it comes (SMP v1's order): the sum of the step's
            # microbatches can overflow float16 where their mean does not (a static loss scale that
            # fits the mean would then skip every step).
            if p.grad is None and p.dtype not in _HALF:
                self._at_end.append(p)
            else:
                self._as_made.add(id(p))

    def end(self) -> None:
        """After the step's last backward: divide the sums of the parameters that had no gradient."""
        with torch.no_grad():
            for p in self._at_end:
                if p.grad is not None:
                    p.grad.div_(self.count)
        self._at_end, self._as_made = [], set()


def sync_gradients(params: Iterable[torch.nn.Parameter], bucket_cap_mb: int) -> None:
    """Average the gradients of ``params`` over their data-parallel replicas."""
    (dp, dp_ranks), (rdp, rdp_ranks) = _reduction_groups()
    replicated: list[torch.Tensor] = []
    sharded: list[torch.Tensor] = []
    for p in params:
        if p.grad is not None:
            # TP-sharded gradients average over the replicas of the same shard (RDP), the rest over DP.
            (sharded if is_tp_sharded(p) else replicated).append(p.grad)
    cap = max(1, bucket_cap_mb) * 1024 * 1024
    _allreduce(replicated, dp, dp_ranks, cap)
    _allreduce(sharded, rdp, rdp_ranks, cap)


def _allreduce(grads: list[torch.Tensor], pg: Any, ranks: list[int], cap: int) -> None:
    """Average ``grads`` over ``pg`` in flat buckets of at most ``cap`` bytes (one tensor may exceed it)."""
    if len(ranks) < 2 or not grads:
        return
    bucket: list[torch.Tensor] = []
    size = 0
    for g in [*grads, None]:
        if g is not None:
            bucket.append(g)
            size += g.numel() * g.element_size()
        if bucket and (g is None or size >= cap):
            flat = torch.cat([b.reshape(-1) for b in bucket])
            wait(dist.all_reduce(flat, group=pg, async_op=True), "gradient allreduce over DP", ranks)
            flat.div_(len(ranks))
            offset = 0
            for b in bucket:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()
            bucket, size = [], 0
