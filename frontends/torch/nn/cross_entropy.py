"""Cross-entropy over vocabulary-sharded logits that never gathers the full logits.

Each rank holds logits for its ``vocab / tp`` slice of the classes. Per token, with ``z`` the logits
and ``t`` the target class::

    m    = allreduce_max(max_j z_j)                      (numerical stability)
    S    = allreduce_sum(sum_j exp(z_j - m))             (softmax denominator)
    z_t  = allreduce_sum(z_t - m on the rank owning t, 0 elsewhere)
    loss = log S - z_t

and the gradient with respect to this rank's logits is ``softmax(z)_j - [j == t]`` for its own j
only, so each rank sends three per-token scalars instead of ``vocab`` values per token.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .group import communicates, group_rank, resolve_group

__all__ = ["parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int,  # type: ignore[override]
                group: Any) -> torch.Tensor:
        rank = group_rank(group)
        part = logits.shape[-1]
        start = rank * part
        z = logits.float()
        m = z.max(dim=-1).values
        talk = communicates(group)
        if talk:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        shifted = z - m.unsqueeze(-1)
        ignored = target == ignore_index
        local_t = target - start
        outside = (local_t < 0) | (local_t >= part) | ignored
        local_t = local_t.masked_fill(outside, 0)
        picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if talk:
            both = torch.stack([picked, sum_exp])
            dist.all_reduce(both, group=group)
            picked, sum_exp = both[0], both[1]
        loss = (sum_exp.log() - picked).masked_fill(ignored, 0.0)
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, local_t, outside, ignored)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        softmax, local_t, outside, ignored = ctx.saved_tensors
        g = softmax.clone()
        hit = (~outside).to(g.dtype)
        g.scatter_add_(-1, local_t.unsqueeze(-1), -hit.unsqueeze(-1))
        g = g * grad.masked_fill(ignored, 0.0).unsqueeze(-1)
        return g.to(ctx.in_dtype), None, None, None


def parallel_cross_entropy(vocab_sharded_logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                           reduction: str = "mean", process_group: Any = None) -> torch.Tensor:
    """Cross-entropy of logits split over the vocabulary dimension; equals `F.cross_entropy` on the full logits.

    Args:
        vocab_sharded_logits: ``[..., vocab / tp]``, this rank's contiguous slice of the classes
            (the output of a `ColumnParallelLinear` LM head without ``gather_output``).
        target: ``[...]`` global class ids.
        ignore_index: targets with this value add no loss and no gradient.
        reduction: ``"mean"`` (over non-ignored targets, as `F.cross_entropy`), ``"sum"`` or ``"none"``.
        process_group: the TP group (default: smp's TP group; None before ``smp.init``).

    Returns:
        The loss, identical on every TP rank.

    Example:
        >>> logits, target = torch.randn(3, 5), torch.tensor([0, 4, -100])
        >>> ref = torch.nn.functional.cross_entropy(logits, target)
        >>> bool(torch.allclose(parallel_cross_entropy(logits, target), ref))
        True
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}: expected one of 'mean', 'sum', 'none'")
    if vocab_sharded_logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(vocab_sharded_logits.shape)} and target {tuple(target.shape)}: the "
                         "logits must have the target's shape plus a trailing (sharded) vocabulary dimension")
    group = resolve_group(process_group)
    losses = _VocabParallelCrossEntropy.apply(vocab_sharded_logits, target, ignore_index, group)
    if reduction == "none":
        return losses  # type: ignore[no-any-return]
    total = losses.sum()
    if reduction == "sum":
        return total  # type: ignore[no-any-return]
    return total / (target != ignore_index).sum().clamp(min=1)  # type: ignore[no-any-return]
