"""`DistributedAttentionLayer`: SMP v1's multi-head attention with its heads split over TP ranks.

Reference math (reference 3.8), for ``hidden`` x of shape [N, S, H], n heads of size d::

    h      = LN_pre(x)                  if pre_layernorm else x
    q,k,v  = h Wq + bq, c Wk + bk, c Wv + bv       (c = cross_states if cross_attention else h)
    p      = dropout(softmax(q k^T / sqrt(d) + mask [+ causal -10000]))
    out    = dropout(concat_heads(p v) Wo + bo) + x
    out    = LN_post(out)               if post_layernorm

Options for rotary models (SMP v1's names, keyword-only; the defaults give the math above):
``rotary_dim`` rotates the first ``rotary_dim`` dims of each head of q and k (`smp.torch.nn.rotary`;
``gpt_neox_type_rotary`` picks GPT-NeoX's halves over GPT-J's interleaved pairs, ``rotary_emb_base``
the base, 10000 by default); ``use_qkv_bias`` / ``use_attn_dense_bias`` drop the biases of Wq, Wk, Wv
/ Wo; ``parallel_attn_output`` returns ``dropout(... Wo + bo)`` without the residual (one branch of
the parallel residual that `DistributedTransformerLayer` sums, GPT-J / GPT-NeoX style; it then
needs no LayerNorm of its own and takes no post-LayerNorm).

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
from .rotary import apply_rotary, check_rotary_dim, rotary_sin_cos

__all__ = ["DistributedAttentionLayer", "MASK_VALUE"]

MASK_VALUE = -10000.0  # the additive value SMP v1 / GPT-2 use for masked positions


def _check_layernorms(pre_layernorm: bool, post_layernorm: bool, parallel_attn_output: bool = False) -> None:
    if parallel_attn_output:
        if post_layernorm:
            raise ValueError("parallel_attn_output=True with post_layernorm=True: a branch of the parallel "
                             "residual takes no post-LayerNorm. Fix: post_layernorm=False (GPT-J, GPT-NeoX)")
        return  # a branch: its LayerNorm may be the layer's (single_pre_layernorm)
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
                 process_group: Any = None, *, rotary_dim: int | None = None, rotary_emb_base: float | None = None,
                 gpt_neox_type_rotary: bool = False, parallel_attn_output: bool = False, use_qkv_bias: bool = True,
                 use_attn_dense_bias: bool = True) -> None:
        super().__init__(process_group)
        _check_layernorms(pre_layernorm, post_layernorm, parallel_attn_output)
        check_rotary_dim(rotary_dim, attention_head_size)
        if rotary_dim is not None and cross_attention:
            raise ValueError(f"rotary_dim={rotary_dim} with cross_attention=True: rotary embeddings are for "
                             "self-attention. Fix: rotary_dim=None for the cross-attention layer")
        self.heads_per_rank = divide(num_attention_heads, self.tp, "num_attention_heads")
        self.num_attention_heads, self.head_size, self.hidden_size = num_attention_heads, attention_head_size, hidden_size
        self.cross_attention = cross_attention
        self.rotary_dim, self.gpt_neox_type_rotary = rotary_dim, gpt_neox_type_rotary
        self.rotary_emb_base = 10000.0 if rotary_emb_base is None else float(rotary_emb_base)  # SMP v1's default
        self.parallel_attn_output = parallel_attn_output
        inner = num_attention_heads * attention_head_size

        def column() -> ColumnParallelLinear:
            return ColumnParallelLinear.from_linear(
                dense_linear(hidden_size, inner, use_qkv_bias, initializer_range, use_normal_initialization),
                process_group=self.group)

        self.pre_layernorm = DistributedLayerNorm(hidden_size, eps=layernorm_epsilon) if pre_layernorm else None
        self.query, self.key, self.value = column(), column(), column()
        self.dense = RowParallelLinear.from_linear(
            dense_linear(inner, hidden_size, use_attn_dense_bias, initializer_range, use_normal_initialization),
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
        if self.rotary_dim is not None:  # positions 0 .. S-1, as SMP v1 (this rank's heads, same table)
            interleaved = not self.gpt_neox_type_rotary
            sin, cos = rotary_sin_cos(q.shape[-2], self.rotary_dim, self.rotary_emb_base, interleaved, q.device)
            q, k = apply_rotary(q, sin, cos, interleaved), apply_rotary(k, sin, cos, interleaved)
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
        out = self.hidden_dropout(self.dense(ctx))
        if self.parallel_attn_output:
            return out  # the layer adds the residual (and the MLP branch)
        out = out + hidden
        return self.layernorm(out) if self.layernorm is not None else out

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # SMP v1's GPT-NeoX state dicts (from transformers 4.x) carry rotary_emb.inv_freq; the table
        # is recomputed from rotary_dim and rotary_emb_base here, so the entry is dropped.
        if self.rotary_dim is not None:
            state_dict.pop(prefix + "rotary_emb.inv_freq", None)
        super()._load_from_state_dict(state_dict, prefix, *args)
