"""Column- and row-parallel linear layers (Megatron style), built from global sizes.

With tp = 2 and ``y = x W^T + b`` for ``W`` of shape (out, in)::

    ColumnParallelLinear: W split by rows (output features)   rank r holds W[r*out/2:(r+1)*out/2, :]
        x --copy_to_tp--> x W_r^T + b_r   (this rank's out/2 features; gather_output=True concatenates)
    RowParallelLinear:    W split by columns (input features) rank r holds W[:, r*in/2:(r+1)*in/2]
        x_r --> x_r W_r^T --reduce_from_tp (sum over ranks)--> + b   (b replicated)

A column layer followed by a row layer (attention, MLP) needs one allreduce forward and one
backward. Both layers draw the full weight with `torch.nn.Linear`'s initialisation and keep their
slice (see `smp.torch.nn.params`), and `from_linear` slices an existing dense layer's weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .group import divide, group_size, resolve_group
from .mappings import copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp
from .params import sharded_parameter

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


def _dense(in_features: int, out_features: int, bias: bool, dtype: torch.dtype | None) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)


class ColumnParallelLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` with the output features split over TP ranks.

    Args:
        in_features: global input size.
        out_features: global output size; must be divisible by the TP degree.
        bias: add a (sharded) bias.
        gather_output: allgather the output so every rank holds all ``out_features``; otherwise each
            rank returns its ``out_features / tp`` slice (to feed a `RowParallelLinear`).
        process_group: the TP group (default: smp's TP group; None before ``smp.init``).
        dtype: parameter dtype.

    Example:
        >>> layer = ColumnParallelLinear(8, 4, gather_output=True)
        >>> layer(torch.ones(2, 8)).shape
        torch.Size([2, 4])
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 process_group: Any = None, dtype: torch.dtype | None = None,
                 _dense_init: nn.Linear | None = None) -> None:
        super().__init__()
        self.group = resolve_group(process_group)
        self.tp = group_size(self.group)
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = divide(out_features, self.tp, "out_features")
        self.gather_output = gather_output
        dense = _dense_init if _dense_init is not None else _dense(in_features, out_features, bias, dtype)
        self.weight = sharded_parameter(dense.weight, 0, self.group, "out_features")
        self.bias = sharded_parameter(dense.bias, 0, self.group, "out_features") if dense.bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, gather_output: bool = False,
                    process_group: Any = None) -> ColumnParallelLinear:
        """The column-parallel version of ``linear`` holding this rank's slice of its weights."""
        return cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                   gather_output=gather_output, process_group=process_group, _dense_init=linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tp(x, self.group), self.weight, self.bias)
        return gather_from_tp(y, self.group, dim=-1) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.out_per_rank} per rank, tp={self.tp}), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` with the input features split over TP ranks.

    Args:
        in_features: global input size; must be divisible by the TP degree.
        out_features: global output size.
        bias: add a (replicated) bias after the sum over ranks.
        input_is_parallel: the input is already this rank's ``in_features / tp`` slice (the output
            of a `ColumnParallelLinear`); otherwise the full input is sliced here.
        process_group: the TP group (default: smp's TP group; None before ``smp.init``).
        dtype: parameter dtype.

    Example:
        >>> layer = RowParallelLinear(8, 4)
        >>> layer(torch.ones(2, 8)).shape
        torch.Size([2, 4])
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 process_group: Any = None, dtype: torch.dtype | None = None,
                 _dense_init: nn.Linear | None = None) -> None:
        super().__init__()
        self.group = resolve_group(process_group)
        self.tp = group_size(self.group)
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = divide(in_features, self.tp, "in_features")
        self.input_is_parallel = input_is_parallel
        dense = _dense_init if _dense_init is not None else _dense(in_features, out_features, bias, dtype)
        self.weight = sharded_parameter(dense.weight, 1, self.group, "in_features")
        self.bias = nn.Parameter(dense.bias.detach().clone()) if dense.bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, input_is_parallel: bool = True,
                    process_group: Any = None) -> RowParallelLinear:
        """The row-parallel version of ``linear`` holding this rank's slice of its weights."""
        return cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                   input_is_parallel=input_is_parallel, process_group=process_group, _dense_init=linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group, dim=-1)
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_per_rank} per rank, tp={self.tp}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}")
