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
==================  ==========================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from smp.torch.nn.embedding import VocabParallelEmbedding
from smp.torch.nn.linear import ColumnParallelLinear, RowParallelLinear
from smp.torch.nn.mappings import copy_to_tp, reduce_from_tp
from smp.torch.nn.params import mark_tp_sharded, shard_packed, shard_tensor
from torch import nn

__all__ = ["STYLES", "Style", "apply_style"]

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
}


def apply_style(style: str, owner: nn.Module, attr: str, group: Any) -> None:
    """Apply plan style ``style`` to ``owner.<attr>``; an unknown style lists the known ones."""
    if style not in STYLES:
        raise ValueError(f"tensor-parallel style {style!r} (on {type(owner).__name__}.{attr}) is not supported; "
                         f"supported: {sorted(STYLES)}")
    STYLES[style](owner, attr, group)
