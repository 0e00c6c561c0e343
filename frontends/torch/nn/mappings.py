"""Autograd-correct collectives at the edges of a tensor-parallel region (Megatron's four mappings).

Each mapping is a pair of forward / backward operations that are each other's adjoint::

    copy_to_tp       forward: identity        backward: allreduce(sum)
    reduce_from_tp   forward: allreduce(sum)  backward: identity
    gather_from_tp   forward: allgather(dim)  backward: keep own slice
    scatter_to_tp    forward: keep own slice  backward: allgather(dim)

A column-parallel linear starts with ``copy_to_tp`` (every rank reads the same input; the input's
gradient is the sum of every rank's partial gradient), a row-parallel linear ends with
``reduce_from_tp`` (the partial products add up to the full product; its gradient is already
replicated). With ``group=None`` every mapping is the identity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .group import communicates, group_rank, group_size

__all__ = ["copy_to_tp", "reduce_from_tp", "gather_from_tp", "scatter_to_tp", "split_along_dim"]


def _allreduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    if not communicates(group):
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _allgather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    if not communicates(group):  # tracing alone: the right shape is all that is needed
        return torch.cat([x] * world, dim=dim)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def split_along_dim(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """This rank's equal slice of ``x`` along ``dim`` (no communication)."""
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        from .group import TPShardingError

        raise TPShardingError(f"tensor dimension {dim} of size {x.shape[dim]} is not divisible by "
                              f"tensor_parallel_degree={world}. Fix: make that size a multiple of {world}.")
    return x.chunk(world, dim=dim)[group_rank(group)].contiguous()


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _allreduce(grad, ctx.group), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _allreduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _allgather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return split_along_dim(grad, ctx.dim, ctx.group), None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return split_along_dim(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _allgather(grad, ctx.dim, ctx.group), None, None


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Enter a TP region: identity forward, gradient allreduced over ``group`` backward."""
    return x if group_size(group) == 1 else _Copy.apply(x, group)  # type: ignore[no-any-return]


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Leave a TP region by summing the ranks' partial results (allreduce); identity backward."""
    return x if group_size(group) == 1 else _Reduce.apply(x, group)  # type: ignore[no-any-return]


def gather_from_tp(x: torch.Tensor, group: Any, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's slice along ``dim``; backward keeps this rank's slice of the gradient."""
    return x if group_size(group) == 1 else _Gather.apply(x, dim, group)  # type: ignore[no-any-return]


def scatter_to_tp(x: torch.Tensor, group: Any, dim: int = -1) -> torch.Tensor:
    """Keep this rank's slice along ``dim``; backward gathers the gradient slices."""
    return x if group_size(group) == 1 else _Scatter.apply(x, dim, group)  # type: ignore[no-any-return]
