"""Batch scaling over the TP group (SMP v1 ``prescaled_batch: False``, reference 2.5).

TP layers need the same input on every rank of the TP group. With ``prescaled_batch: True`` the
data loader already gives every TP rank the same batch. Otherwise each TP rank holds its own
batch of B samples, and a TP region *scales* it: every rank works on all t ranks' samples
(``[t*B, ...]``) and hands each rank back the outputs of its own samples::

    rank 0: x0 --\\                       /--> y0
                  allgather [x0; x1] -> TP module -> [y0; y1] -> own slice
    rank 1: x1 --/                       \\--> y1

Backward is the adjoint: the output gradients are gathered ([g0; g1] on every rank, what the TP
module expects: the same gradient everywhere), and each rank keeps its own slice of the input
gradient. A parameter inside the region then receives the gradient of the *sum* of the t ranks'
losses, so data parallelism must average it over RDP (not DP) and divide by t to match the
gradient averaged over all DP ranks (``is_scaled_batch_parameter`` in SMP v1).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .group import resolve_group
from .mappings import gather_from_tp, scatter_to_tp

__all__ = ["scale_batch", "unscale_batch", "BatchScaled"]


def scale_batch(x: torch.Tensor, process_group: Any = None, dim: int = 0) -> torch.Tensor:
    """Every TP rank's batch concatenated along ``dim`` (backward: this rank's gradient slice)."""
    return gather_from_tp(x, resolve_group(process_group), dim=dim)


def unscale_batch(y: torch.Tensor, process_group: Any = None, dim: int = 0) -> torch.Tensor:
    """This rank's part of a scaled batch (backward: the gradients of all parts, gathered)."""
    return scatter_to_tp(y, resolve_group(process_group), dim=dim)


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
        y = self.module(gather_from_tp(x, self.group, dim=self.dim))
        return scatter_to_tp(y, self.group, dim=self.dim)
