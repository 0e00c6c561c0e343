"""Batch scaling over the TP group (SMP v1 ``prescaled_batch: False``, reference 2.5).

TP layers need the same input on every rank of the TP group. With ``prescaled_batch: True`` the
data loader already gives every TP rank the same batch. Otherwise each TP rank holds its own
batch of B samples, and a TP region *scales* it: every rank works on all t ranks' samples
(``[t*B, ...]``) and hands each rank back the outputs of its own samples::

    rank 0: x0 --\\                       /--> y0
                  allgather [x0; x1] -> TP module -> [y0; y1] -> own slice
    rank 1: x1 --/                       \\--> y1

Gradients. Each rank's loss is a function of its own outputs. Inside the region every rank must
see the same output gradient, so backward gathers the t ranks' output gradients and divides them by
t: the region's parameters receive the gradient of the *mean* of the t ranks' losses, which is the
gradient of the combined batch's mean loss, identical on every TP rank. Data parallelism then
averages over DP as for any replicated parameter, and the result equals one process training on
all ranks' samples (SMP v1 instead sums and divides by t in its RDP allreduce,
``is_scaled_batch_parameter``; the numbers are the same). The input gradient is this rank's slice
times t, i.e. the gradient of this rank's own loss, as if the region had run on the rank's batch.
A loss computed *inside* the region over the combined batch (a Hugging Face model given labels) is
the combined mean on every rank and its gradients follow the same rule.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .group import TPShardingError, communicates, group_size, resolve_group
from .mappings import gather_from_tp, scatter_to_tp

__all__ = ["scale_batch", "unscale_batch", "BatchScaled", "scale_arguments", "unscale_outputs"]


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``factor`` backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def scale_batch(x: torch.Tensor, process_group: Any = None, dim: int = 0) -> torch.Tensor:
    """Every TP rank's batch concatenated along ``dim`` (see the module docstring for gradients)."""
    group = resolve_group(process_group)
    t = group_size(group)
    # backward: this rank's slice of the gradient (gather's adjoint), times t
    return x if t == 1 else gather_from_tp(_ScaleGrad.apply(x, float(t)), group, dim=dim)


def unscale_batch(y: torch.Tensor, process_group: Any = None, dim: int = 0) -> torch.Tensor:
    """This rank's part of a scaled batch (see the module docstring for gradients)."""
    group = resolve_group(process_group)
    t = group_size(group)
    # backward: every rank's gradient gathered (scatter's adjoint), divided by t
    return y if t == 1 else scatter_to_tp(_ScaleGrad.apply(y, 1.0 / t), group, dim=dim)


class BatchScaled(nn.Module):
    """Run ``module`` (a TP module taking and returning one tensor) on the TP-scaled batch.

    Example:
        >>> from smp.torch.nn import DistributedLinear
        >>> layer = BatchScaled(DistributedLinear(4, 2))
        >>> layer(torch.ones(3, 4)).shape
        torch.Size([3, 2])
    """

    def __init__(self, module: nn.Module, process_group: Any = None, dim: int = 0) -> None:
        super().__init__()
        self.module = module
        self.group = resolve_group(process_group)
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.module(scale_batch(x, self.group, self.dim))
        return unscale_batch(y, self.group, self.dim)


def _leaves(obj: Any) -> list[torch.Tensor]:
    from smp.structure import leaves

    return [x for x in leaves(obj) if isinstance(x, torch.Tensor)]


def scale_arguments(args: tuple[Any, ...], kwargs: dict[str, Any], process_group: Any = None,
                    ) -> tuple[tuple[Any, ...], dict[str, Any], int | None]:
    """Scale a model call's batch over the TP group: every tensor argument whose first dimension is
    the batch size (that of the first tensor argument with a dimension) is gathered along it.

    Returns the new ``(args, kwargs)`` and the per-rank batch size (None when nothing was scaled,
    for example a call without tensors). Tensors of another first size (``position_ids`` of shape
    ``[1, S]``, masks broadcast over the batch) are passed unchanged. Every TP rank must call with
    the same shapes; otherwise a `TPShardingError` says which sizes differ.
    """
    from smp.structure import map_structure

    group = resolve_group(process_group)
    t = group_size(group)
    batched = [x for x in _leaves((args, kwargs)) if x.dim() >= 1]
    if t == 1 or not batched:
        return args, kwargs, None
    b = batched[0].shape[0]
    chosen = [x for x in batched if x.shape[0] == b]
    if communicates(group):
        import torch.distributed as dist

        mine = torch.tensor([b, len(chosen), sum(x.numel() for x in chosen)], dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(t)]
        dist.all_gather(every, mine, group=group)
        if any(not torch.equal(e, mine) for e in every):
            rows = ", ".join(f"tp_rank {i}: batch {int(e[0])}, {int(e[1])} tensor(s), {int(e[2])} elements"
                             for i, e in enumerate(every))
            raise TPShardingError(
                f"the TP ranks called the model with different batches ({rows}; inside @smp.step these are "
                f"per-microbatch sizes: the batch divided by the microbatches config). With prescaled_batch: False "
                f"each TP rank passes its own batch and they are concatenated, so every rank of a TP group "
                f"needs the same batch size and tensor shapes. Fix: give every rank equal batches (a "
                f"DataLoader with drop_last=True), or use prescaled_batch: True with the same batch on every "
                f"TP rank.")
    ids = {id(x) for x in chosen}
    out = map_structure((args, kwargs), lambda x: scale_batch(x, group) if id(x) in ids else x)
    return out[0], out[1], b


def unscale_outputs(out: Any, batch: int | None, process_group: Any = None) -> Any:
    """This rank's part of every output tensor whose first dimension is the scaled batch
    (``tp_size * batch``); other outputs (a loss computed over the combined batch) stay whole. An
    output another pipeline rank keeps is cut there (`smp.torch.engine.refs.on_owner`)."""
    from smp.structure import map_structure

    from ..engine.refs import on_owner

    group = resolve_group(process_group)
    t = group_size(group)
    if batch is None or t == 1:
        return out

    def one(y: Any) -> Any:
        if not (isinstance(y, torch.Tensor) and y.dim() >= 1 and y.shape[0] == t * batch):
            return y
        return on_owner(unscale_batch, y) if process_group is None else unscale_batch(y, group)

    return map_structure(out, one)
