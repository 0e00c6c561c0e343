"""`DistributedAttentionLayer`: SMP v1's multi-head attention with its heads split over TP ranks.

Reference math (reference 3.8), for ``hidden`` x of shape [N, S, H], n heads of size d::

    h      = LN_pre(x)                  if pre_layernorm else x
    q,k,v  = h Wq + bq, c Wk + bk, c Wv + bv       (c = cross_states if cross_attention else h)
    p      = dropout(softmax(q k^T / sqrt(d) + mask [+ causal -10000]))
    out    = dropout(concat_heads(p v) Wo + bo) + x
    out    = LN_post(out)               if post_layernorm

Wq, Wk, Wv are column-parallel (tp rank r computes heads r*n/tp .. (r+1)*n/tp - 1), Wo is
row-parallel: one allreduce forward, one backward. The attention-probability dropout acts on this
rank's heads and runs on the TP-region generator (different per rank, see
`smp.torch.nn.rng`); the output dropout acts on the replicated result and uses the default one.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .basic import DistributedLayerNorm, DistributedModule, dense_linear
from .group import divide
from .linear import ColumnParallelLinear, RowParallelLinear
from .rng import tp_rng

__all__ = ["DistributedAttentionLayer", "MASK_VALUE"]

MASK_VALUE = -10000.0  # the additive value SMP v1 / GPT-2 use for masked positions


def _check_layernorms(pre_layernorm: bool, post_layernorm: bool) -> None:
    if not (pre_layernorm or post_layernorm):
        raise ValueError("pre_layernorm=False and post_layernorm=False: at least one of them must be True "
                         "(as in SMP v1). Fix: set post_layernorm=True (BERT style) or pre_layernorm=True (GPT-2)")


class DistributedAttentionLayer(DistributedModule):
    """Multi-head (self or cross) attention with residual and LayerNorm; SMP v1 signature, global sizes.

    ``forward((hidden, attention_mask))`` or, with ``cross_attention=True``,
    ``forward((hidden, cross_states, attention_mask))`` returns the new hidden states [N, S, H].
    ``attention_mask`` is additive and broadcastable to [N, heads, S, S2] (e.g. [N, 1, 1, S2] with
    0 for kept and -10000 for masked keys), or None.

    Example:
        >>> layer = DistributedAttentionLayer(num_attention_heads=2, attention_head_size=4, hidden_size=8,
        ...                                   attention_dropout_prob=0.0, hidden_dropout_prob=0.0)
        >>> layer((torch.randn(1, 3, 8), None)).shape
        torch.Size([1, 3, 8])
    """

    def __init__(self, num_attention_heads: int = 32, attention_head_size: int = 32, hidden_size: int = 1024,
                 attention_dropout_prob: float = 0.1, hidden_dropout_prob: float = 0.1,
                 layernorm_epsilon: float = 1e-5, initializer_range: float = 0.02,
                 use_normal_initialization: bool = False, cross_attention: bool = False,
                 causal_mask_size: int | None = None, pre_layernorm: bool = False, post_layernorm: bool = True,
                 process_group: Any = None) -> None:
        super().__init__(process_group)
        _check_layernorms(pre_layernorm, post_layernorm)
        self.heads_per_rank = divide(num_attention_heads, self.tp, "num_attention_heads")
        self.num_attention_heads, self.head_size, self.hidden_size = num_attention_heads, attention_head_size, hidden_size
        self.cross_attention = cross_attention
        inner = num_attention_heads * attention_head_size

        def column() -> ColumnParallelLinear:
            return ColumnParallelLinear.from_linear(
                dense_linear(hidden_size, inner, True, initializer_range, use_normal_initialization),
                process_group=self.group)

        self.pre_layernorm = DistributedLayerNorm(hidden_size, eps=layernorm_epsilon) if pre_layernorm else None
        self.query, self.key, self.value = column(), column(), column()
        self.dense = RowParallelLinear.from_linear(
            dense_linear(inner, hidden_size, True, initializer_range, use_normal_initialization),
            process_group=self.group)
        self.layernorm = DistributedLayerNorm(hidden_size, eps=layernorm_epsilon) if post_layernorm else None
        self.attention_dropout = nn.Dropout(attention_dropout_prob)
        self.hidden_dropout = nn.Dropout(hidden_dropout_prob)
        self.causal_mask: torch.Tensor | None
        if causal_mask_size is not None:
            causal = torch.tril(torch.ones(causal_mask_size, causal_mask_size, dtype=torch.bool))
            self.register_buffer("causal_mask", causal, persistent=False)
        else:
            self.causal_mask = None

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        n, s, _ = x.shape
        return x.view(n, s, self.heads_per_rank, self.head_size).transpose(1, 2)

    def forward(self, inputs: tuple[Any, ...]) -> torch.Tensor:
        if self.cross_attention:
            hidden, cross_states, mask = inputs
        else:
            hidden, mask = inputs
            cross_states = None
        h = self.pre_layernorm(hidden) if self.pre_layernorm is not None else hidden
        kv_source = cross_states if cross_states is not None else h
        q, k, v = self._heads(self.query(h)), self._heads(self.key(kv_source)), self._heads(self.value(kv_source))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_size)
        if self.causal_mask is not None:
            sq, sk = scores.shape[-2:]
            causal = self.causal_mask[sk - sq:sk, :sk]
            scores = torch.where(causal, scores, torch.full_like(scores, MASK_VALUE))
        if mask is not None:
            scores = scores + mask
        probs = F.softmax(scores.float(), dim=-1).to(q.dtype)
        with tp_rng():
            probs = self.attention_dropout(probs)
        ctx = (probs @ v).transpose(1, 2).reshape(hidden.shape[0], hidden.shape[1], -1)
        out = self.hidden_dropout(self.dense(ctx)) + hidden
        return self.layernorm(out) if self.layernorm is not None else out
