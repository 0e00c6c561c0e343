"""Tensor-parallel styles: what each value of a Hugging Face ``base_model_tp_plan`` does here.

A plan maps module / parameter paths (``layers.*.self_attn.q_proj``) to a style. Each style is a
function ``(owner, attr, group)`` that replaces ``owner.<attr>`` by its TP version holding this
rank's slice of the original weights (names unchanged, so state-dict keys stay Hugging Face's):

==================  ==========================================================================
style               effect
==================  ==========================================================================
colwise             ``nn.Linear`` -> `ColumnParallelLinear`; 3-D (E, out, in) parameter: slice ``out``
rowwise             ``nn.Linear`` -> `RowParallelLinear`; 3-D (E, out, in) parameter: slice ``in``
packed_colwise      3-D (E, 2I, H) parameter (gate and up stacked): slice each half's ``I``
moe_tp_experts      experts module: enter / leave a TP region (gradient allreduce of its
                    inputs, allreduce of its partial outputs)
embedding_rowwise   ``nn.Embedding`` -> `VocabParallelEmbedding` (vocabulary split)
replicated_with_    a replicated module applied to this rank's heads (Qwen3's q_norm/k_norm):
grad_allreduce      its parameters' gradients are summed over the TP group
conv1d_colwise      GPT-2 ``Conv1D`` (weight (in, out)) -> `ParallelConv1D` keeping output features
conv1d_qkv_colwise  the same for GPT-2's fused ``c_attn`` (q | k | v: whole heads of each)
conv1d_rowwise      GPT-2 ``Conv1D`` -> `ParallelConv1D` keeping input features
==================  ==========================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from smp.torch.nn.embedding import VocabParallelEmbedding
from smp.torch.nn.group import group_size
from smp.torch.nn.linear import ColumnParallelLinear, RowParallelLinear
from smp.torch.nn.mappings import copy_to_tp, reduce_from_tp
from smp.torch.nn.params import mark_tp_sharded, shard_packed, shard_tensor
from torch import nn

__all__ = ["STYLES", "ParallelConv1D", "Style", "apply_style"]

Style = Callable[[nn.Module, str, Any], None]


def _expect(owner: nn.Module, attr: str, style: str, kinds: tuple[type, ...]) -> Any:
    value = getattr(owner, attr)
    if not isinstance(value, kinds):
        raise TypeError(f"tp style {style!r} on {type(owner).__name__}.{attr}: expected "
                        f"{' or '.join(k.__name__ for k in kinds)}, found {type(value).__name__}")
    return value


def _set_param(owner: nn.Module, attr: str, data: torch.Tensor, dim: int, packed: int = 1) -> None:
    param = nn.Parameter(data, requires_grad=getattr(owner, attr).requires_grad)
    mark_tp_sharded(param, dim, packed)
    setattr(owner, attr, param)


def colwise(owner: nn.Module, attr: str, group: Any) -> None:
    value = _expect(owner, attr, "colwise", (nn.Linear, nn.Parameter))
    if isinstance(value, nn.Linear):
        setattr(owner, attr, ColumnParallelLinear.from_linear(value, process_group=group))
    else:
        _set_param(owner, attr, shard_tensor(value, -2, group, f"{attr} output features"), value.dim() - 2)


def rowwise(owner: nn.Module, attr: str, group: Any) -> None:
    value = _expect(owner, attr, "rowwise", (nn.Linear, nn.Parameter))
    if isinstance(value, nn.Linear):
        setattr(owner, attr, RowParallelLinear.from_linear(value, process_group=group))
    else:
        _set_param(owner, attr, shard_tensor(value, -1, group, f"{attr} input features"), value.dim() - 1)


def packed_colwise(owner: nn.Module, attr: str, group: Any) -> None:
    value = _expect(owner, attr, "packed_colwise", (nn.Parameter,))
    dim = value.dim() - 2
    _set_param(owner, attr, shard_packed(value, dim, 2, group, f"{attr} (intermediate_size)"), dim, packed=2)


def _enter_region(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    group = module._smp_tp_group  # type: ignore[union-attr]
    return tuple(copy_to_tp(a, group) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)


def _leave_region(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    return reduce_from_tp(output, module._smp_tp_group)  # type: ignore[arg-type]


def moe_tp_experts(owner: nn.Module, attr: str, group: Any) -> None:
    experts = _expect(owner, attr, "moe_tp_experts", (nn.Module,))
    # Every rank computes each expert on its slice of the intermediate dimension: the outputs are
    # partial sums (allreduce after), and the inputs' gradients too (hidden states and routing
    # weights: copy_to_tp before).
    experts._smp_tp_group = group
    experts.register_forward_pre_hook(_enter_region)
    experts.register_forward_hook(_leave_region)


def embedding_rowwise(owner: nn.Module, attr: str, group: Any) -> None:
    value = _expect(owner, attr, "embedding_rowwise", (nn.Embedding,))
    setattr(owner, attr, VocabParallelEmbedding.from_embedding(value, process_group=group))


class ParallelConv1D(nn.Module):
    """Hugging Face's ``Conv1D`` (GPT-2: ``y = x W + b`` with ``W`` of shape (in, out)) split over TP.

    ``mode="column"`` keeps this rank's slice of the output features (of each of ``packed`` equal
    parts: GPT-2's ``c_attn`` is q | k | v, so ``packed=3`` gives each rank whole heads of each);
    ``mode="row"`` keeps a slice of the input features, sums the partial products over the group
    and adds the replicated bias once. Parameter names stay ``weight`` and ``bias``.
    """

    def __init__(self, conv: nn.Module, mode: str, group: Any, packed: int = 1) -> None:
        super().__init__()
        self.mode, self.group = mode, group
        weight, bias = conv.weight, conv.bias
        if mode == "column":
            self.weight = nn.Parameter(shard_packed(weight, 1, packed, group, "output features"))
            mark_tp_sharded(self.weight, 1, packed)
            self.bias = nn.Parameter(shard_packed(bias, 0, packed, group, "output features"))
            mark_tp_sharded(self.bias, 0, packed)
        else:
            self.weight = nn.Parameter(shard_tensor(weight, 0, group, "input features"))
            mark_tp_sharded(self.weight, 0)
            self.bias = nn.Parameter(bias.detach().clone())
        self.nf = self.weight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[:-1] + (self.nf,)
        if self.mode == "column":
            x = copy_to_tp(x, self.group)
            return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(shape)
        y = reduce_from_tp(x.reshape(-1, x.shape[-1]) @ self.weight, self.group)
        return (y + self.bias).view(shape)


def conv1d_colwise(owner: nn.Module, attr: str, group: Any) -> None:
    setattr(owner, attr, ParallelConv1D(_expect(owner, attr, "conv1d_colwise", (nn.Module,)), "column", group))


def conv1d_rowwise(owner: nn.Module, attr: str, group: Any) -> None:
    setattr(owner, attr, ParallelConv1D(_expect(owner, attr, "conv1d_rowwise", (nn.Module,)), "row", group))


def conv1d_qkv_colwise(owner: nn.Module, attr: str, group: Any) -> None:
    # GPT-2's fused q | k | v projection: whole heads of each per rank; the attention module then
    # splits the output into three parts of its local width and infers its head count.
    conv = _expect(owner, attr, "conv1d_qkv_colwise", (nn.Module,))
    setattr(owner, attr, ParallelConv1D(conv, "column", group, packed=3))
    tp = group_size(group)
    owner.split_size = owner.split_size // tp  # type: ignore[operator]
    owner.num_heads = owner.num_heads // tp  # type: ignore[operator]


def replicated_with_grad_allreduce(owner: nn.Module, attr: str, group: Any) -> None:
    value = _expect(owner, attr, "replicated_with_grad_allreduce", (nn.Module, nn.Parameter))
    # A replicated module applied to this rank's heads only (Qwen3's per-head q_norm / k_norm):
    # each rank's gradient covers its own heads, the full gradient is their sum.
    from smp.torch.nn.mappings import _allreduce

    params = [value] if isinstance(value, nn.Parameter) else list(value.parameters())
    for p in params:
        p.register_hook(lambda grad: _allreduce(grad, group))


STYLES: dict[str, Style] = {
    "colwise": colwise,
    "rowwise": rowwise,
    "packed_colwise": packed_colwise,
    "moe_tp_experts": moe_tp_experts,
    "embedding_rowwise": embedding_rowwise,
    "replicated_with_grad_allreduce": replicated_with_grad_allreduce,
    "conv1d_colwise": conv1d_colwise,
    "conv1d_rowwise": conv1d_rowwise,
    "conv1d_qkv_colwise": conv1d_qkv_colwise,
}


def apply_style(style: str, owner: nn.Module, attr: str, group: Any) -> None:
    """Apply plan style ``style`` to ``owner.<attr>``; an unknown style lists the known ones."""
    if style not in STYLES:
        raise ValueError(f"tensor-parallel style {style!r} (on {type(owner).__name__}.{attr}) is not supported; "
                         f"supported: {sorted(STYLES)}")
    STYLES[style](owner, attr, group)
