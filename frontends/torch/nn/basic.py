"""SMP v1's simple distributed layers: `DistributedLinear`, `DistributedEmbedding`, `DistributedLayerNorm`.

All take global sizes and compute what their `torch.nn` namesakes compute; what differs is what
each TP rank stores:

=======================  ==========================================  ==========================
layer                    split                                       communication (forward)
=======================  ==========================================  ==========================
DistributedLinear        ``in_features`` (a row-parallel linear)     allreduce of the output
DistributedEmbedding     ``embedding_dim`` (SMP v1: not the vocab)   allgather of the output
DistributedLayerNorm     nothing (replicated, like SMP v1)           none
=======================  ==========================================  ==========================

Every TP rank receives the same input (``prescaled_batch`` semantics, reference 2.5) and returns
the same output. ``initializer_range`` / ``use_normal_initialization`` follow SMP v1: with
``use_normal_initialization=True`` weights are drawn from N(0, initializer_range) and biases are
zero; otherwise torch's default initialisation of the dense layer is used.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .group import divide, group_size, resolve_group
from .linear import RowParallelLinear
from .mappings import gather_from_tp
from .params import sharded_parameter

__all__ = ["DistributedModule", "DistributedLinear", "DistributedEmbedding", "DistributedLayerNorm",
           "dense_linear"]


class DistributedModule(nn.Module):
    """Base class of the SMP v1 ``smp.nn.Distributed*`` layers: knows its TP group and degree."""

    def __init__(self, process_group: Any = None) -> None:
        super().__init__()
        self.group = resolve_group(process_group)
        self.tp = group_size(self.group)


def dense_linear(in_features: int, out_features: int, bias: bool = True, initializer_range: float = 0.02,
                 use_normal_initialization: bool = False) -> nn.Linear:
    """A full ``nn.Linear`` initialised the SMP v1 way, to slice TP shards from.

    Example:
        >>> layer = dense_linear(4, 2, use_normal_initialization=True)
        >>> float(layer.bias.detach().abs().sum())
        0.0
    """
    layer = nn.Linear(in_features, out_features, bias=bias)
    if use_normal_initialization:
        with torch.no_grad():
            layer.weight.normal_(0.0, initializer_range)
            if layer.bias is not None:
                layer.bias.zero_()
    return layer


class DistributedLinear(DistributedModule):
    """``nn.Linear(in_features, out_features)`` split along the input dimension (SMP v1).

    Example:
        >>> layer = DistributedLinear(8, 3)
        >>> layer(torch.ones(2, 8)).shape
        torch.Size([2, 3])
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, initializer_range: float = 0.02,
                 use_normal_initialization: bool = False, process_group: Any = None,
                 _dense_init: nn.Linear | None = None) -> None:
        super().__init__(process_group)
        self.in_features, self.out_features = in_features, out_features
        dense = _dense_init if _dense_init is not None else dense_linear(
            in_features, out_features, bias, initializer_range, use_normal_initialization)
        self.linear = RowParallelLinear.from_linear(dense, input_is_parallel=False, process_group=self.group)

    @classmethod
    def from_linear(cls, linear: nn.Linear, process_group: Any = None) -> DistributedLinear:
        """The distributed version of ``linear``, holding this rank's slice of its weights."""
        return cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                   process_group=process_group, _dense_init=linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)  # type: ignore[no-any-return]


class DistributedEmbedding(DistributedModule):
    """``nn.Embedding`` split along ``embedding_dim`` (SMP v1 signature).

    ``max_norm``, ``scale_grad_by_freq`` and ``sparse`` apply to each rank's slice as in
    `torch.nn.functional.embedding` (``max_norm`` renormalises the slice, not the full row, so it
    is rejected when tp > 1). ``_skip_allgather=True`` returns this rank's ``embedding_dim / tp``
    slice; ``_skip_scatter_and_merge`` is accepted for compatibility (every rank already holds the
    same input here).

    Example:
        >>> emb = DistributedEmbedding(10, 4)
        >>> emb(torch.tensor([[1, 2]])).shape
        torch.Size([1, 2, 4])
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, _weight: torch.Tensor | None = None, initializer_range: float = 0.02,
                 _skip_allgather: bool = False, _skip_scatter_and_merge: bool = False,
                 process_group: Any = None) -> None:
        super().__init__(process_group)
        divide(embedding_dim, self.tp, "embedding_dim")
        if max_norm is not None and self.tp > 1:
            raise ValueError(f"DistributedEmbedding(max_norm={max_norm}) with tensor_parallel_degree={self.tp}: "
                             "max_norm would renormalise each rank's slice, not the full row. Fix: "
                             "max_norm=None, or keep this embedding out of tensor parallelism")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        dense = nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx, _weight=_weight)
        if _weight is None:
            with torch.no_grad():
                dense.weight.normal_(0.0, initializer_range)
                if padding_idx is not None:
                    dense.weight[dense.padding_idx].zero_()  # type: ignore[index]
        self.padding_idx = dense.padding_idx
        self.max_norm, self.norm_type = max_norm, norm_type
        self.scale_grad_by_freq, self.sparse = scale_grad_by_freq, sparse
        self.skip_allgather = _skip_allgather
        self.weight = sharded_parameter(dense.weight, 1, self.group, "embedding_dim")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(ids, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                          self.scale_grad_by_freq, self.sparse)
        return out if self.skip_allgather else gather_from_tp(out, self.group, dim=-1)


class DistributedLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` for TP models (SMP v1 name): replicated, same parameters on every TP rank.

    Example:
        >>> DistributedLayerNorm(4)(torch.ones(2, 4)).abs().sum().item()
        0.0
    """

    def __init__(self, normalized_shape: int | tuple[int, ...], eps: float = 1e-5,
                 elementwise_affine: bool = True) -> None:
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine)
