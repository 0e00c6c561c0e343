"""`DistributedTransformerLMHead`: SMP v1's whole language model (embeddings, transformer, tied LM head).

::

    x      = dropout(Wte[input_ids] + Wpe[position_ids] (+ Wtt[token_type_ids]))
    h, _   = DistributedTransformer((x, additive(attention_mask)))
    h      = LN_final(h)                              if final_layernorm (GPT-2's ln_f)
    logits = h Wte^T                                  (tied to the word embedding)
    loss   = cross_entropy(logits[:, :-1], labels[:, 1:])    (next-token prediction)

The word embedding is vocabulary-parallel (`VocabParallelEmbedding`, rank r holds vocabulary rows
r*V/tp .. (r+1)*V/tp), so the tied LM head yields each rank's vocabulary slice of the logits and
the loss is `parallel_cross_entropy` on that slice (no rank computes the full softmax). The
logits returned are gathered over the vocabulary, as SMP v1 returns them; the allgather's backward
only runs when the caller uses them. (SMP v1 split this
table along ``embedding_dim``; splitting the vocabulary is what makes large vocabularies fit.)
Position and token-type embeddings are small and replicated.

Options for rotary models (SMP v1's names, keyword-only; the defaults give the math above):
``use_positional_embedding=False`` drops Wpe (the positions then come from ``rotary_dim``, the
attention option, and must be 0 .. S-1, as in SMP v1); ``tie_input_output_embedding=False`` gives
an own head ``lm_head`` (a `ColumnParallelLinear` H -> V, split over the vocabulary like the word
embedding, so the loss stays vocabulary-parallel), with a bias when ``use_lm_head_bias``;
``embedding_dropout_prob`` (default: ``hidden_dropout_prob``) is the embedding dropout; the
layer options (``rotary_dim``, ``rotary_emb_base``, ``gpt_neox_type_rotary``,
``parallel_attn_output``, ``use_qkv_bias``, ``use_attn_dense_bias``, ``single_pre_layernorm``)
go to every `DistributedTransformerLayer`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .attention import MASK_VALUE
from .basic import DistributedLayerNorm, DistributedModule, dense_linear
from .cross_entropy import parallel_cross_entropy
from .embedding import VocabParallelEmbedding
from .linear import ColumnParallelLinear
from .mappings import copy_to_tp, gather_from_tp
from .transformer import DistributedTransformer

__all__ = ["DistributedTransformerLMHead"]


def _check_default_positions(position_ids: torch.Tensor, seq_len: int) -> None:
    expected = torch.arange(seq_len, device=position_ids.device)
    if position_ids.shape[-1] != seq_len or not bool((position_ids == expected).all()):
        raise ValueError("position_ids other than 0 .. S-1 with use_positional_embedding=False: the rotary "
                         "embedding places the tokens at 0 .. S-1 (as SMP v1 did). Fix: pass position_ids=None")


class DistributedTransformerLMHead(DistributedModule):
    """Embeddings, a `DistributedTransformer` and a vocabulary-parallel LM head, tied by default (SMP v1 signature).

    ``forward((input_ids, attention_mask, token_type_ids, position_ids, labels))``; with
    ``add_cross_attention=True`` ``forward((input_ids, attention_mask, token_type_ids, position_ids,
    cross_states, cross_states, cross_mask, labels))`` (SMP v1's documented tuple). ``attention_mask``
    is [N, S] with 1 = masked (or None); ``cross_mask`` is additive [N, 1, 1, S2].

    Returns:
        ``(vocab_sharded_logits,)`` without labels, ``(loss, vocab_sharded_logits)`` with labels
        (-100 labels are ignored); the hidden states instead of logits when ``add_lm_head=False``.

    Example:
        >>> lm = DistributedTransformerLMHead(num_layers=1, num_attention_heads=2, attention_head_size=4,
        ...     hidden_size=8, intermediate_size=16, vocab_size=20, num_positions=6,
        ...     attention_dropout_prob=0.0, hidden_dropout_prob=0.0, causal_mask_size=6)
        >>> ids = torch.tensor([[1, 2, 3]])
        >>> loss, logits = lm((ids, None, None, None, ids))
        >>> tuple(logits.shape)
        (1, 3, 20)
    """

    def __init__(self, num_layers: int = 12, num_attention_heads: int = 32, attention_head_size: int = 32,
                 hidden_size: int = 1024, intermediate_size: int = 4096, vocab_size: int = 30522,
                 num_positions: int = 1024, attention_dropout_prob: float = 0.1, hidden_dropout_prob: float = 0.1,
                 activation: str = "gelu", layernorm_epsilon: float = 1e-5, num_token_types: int = 0,
                 causal_mask_size: int | None = None, add_cross_attention: bool = False, add_lm_head: bool = True,
                 initializer_range: float = 0.02, use_normal_initialization: bool = False,
                 pre_layernorm: bool = False, post_layernorm: bool = True, final_layernorm: bool = False,
                 process_group: Any = None, *, embedding_dropout_prob: float | None = None,
                 use_positional_embedding: bool = True, tie_input_output_embedding: bool = True,
                 use_lm_head_bias: bool = False, rotary_dim: int | None = None, rotary_emb_base: float | None = None,
                 gpt_neox_type_rotary: bool = False, parallel_attn_output: bool = False, use_qkv_bias: bool = True,
                 use_attn_dense_bias: bool = True, single_pre_layernorm: bool = False) -> None:
        super().__init__(process_group)
        if use_lm_head_bias and tie_input_output_embedding:
            raise ValueError("use_lm_head_bias=True with tie_input_output_embedding=True: the bias belongs to an "
                             "own LM head. Fix: tie_input_output_embedding=False (GPT-J)")
        word = nn.Embedding(vocab_size, hidden_size)
        nn.init.normal_(word.weight, 0.0, initializer_range)
        self.word_embedding = VocabParallelEmbedding.from_embedding(word, process_group=self.group)
        self.position_embedding: nn.Embedding | None = None
        if use_positional_embedding:
            self.position_embedding = nn.Embedding(num_positions, hidden_size)
            nn.init.normal_(self.position_embedding.weight, 0.0, initializer_range)
        self.token_type_embedding: nn.Embedding | None = None
        if num_token_types > 0:
            self.token_type_embedding = nn.Embedding(num_token_types, hidden_size)
            nn.init.normal_(self.token_type_embedding.weight, 0.0, initializer_range)
        self.embedding_dropout = nn.Dropout(hidden_dropout_prob if embedding_dropout_prob is None
                                            else embedding_dropout_prob)
        self.transformer = DistributedTransformer(
            num_layers=num_layers, num_attention_heads=num_attention_heads, attention_head_size=attention_head_size,
            hidden_size=hidden_size, intermediate_size=intermediate_size,
            attention_dropout_prob=attention_dropout_prob, hidden_dropout_prob=hidden_dropout_prob,
            activation=activation, layernorm_epsilon=layernorm_epsilon, initializer_range=initializer_range,
            use_normal_initialization=use_normal_initialization, causal_mask_size=causal_mask_size,
            add_cross_attention=add_cross_attention, pre_layernorm=pre_layernorm, post_layernorm=post_layernorm,
            process_group=self.group, rotary_dim=rotary_dim, rotary_emb_base=rotary_emb_base,
            gpt_neox_type_rotary=gpt_neox_type_rotary, parallel_attn_output=parallel_attn_output,
            use_qkv_bias=use_qkv_bias, use_attn_dense_bias=use_attn_dense_bias,
            single_pre_layernorm=single_pre_layernorm)
        # SMP v1's internal ``final_layernorm``: a LayerNorm after the last layer (pre-LN models: GPT-2's ln_f).
        self.layernorm = DistributedLayerNorm(hidden_size, eps=layernorm_epsilon) if final_layernorm else None
        self.add_cross_attention, self.add_lm_head = add_cross_attention, add_lm_head
        self.lm_head: ColumnParallelLinear | None = None
        if add_lm_head and not tie_input_output_embedding:
            self.lm_head = ColumnParallelLinear.from_linear(
                dense_linear(hidden_size, vocab_size, use_lm_head_bias, initializer_range, use_normal_initialization),
                process_group=self.group)

    def forward(self, inputs: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
        if self.add_cross_attention:
            input_ids, attention_mask, token_type_ids, position_ids, cross_states, _, cross_mask, labels = inputs
        else:
            input_ids, attention_mask, token_type_ids, position_ids, labels = inputs
        x = self.word_embedding(input_ids)
        if self.position_embedding is not None:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
            x = x + self.position_embedding(position_ids)
        elif position_ids is not None:
            _check_default_positions(position_ids, input_ids.shape[1])
        if self.token_type_embedding is not None and token_type_ids is not None:
            x = x + self.token_type_embedding(token_type_ids)
        x = self.embedding_dropout(x)
        mask = None
        if attention_mask is not None:
            mask = attention_mask.to(x.dtype).view(attention_mask.shape[0], 1, 1, -1) * MASK_VALUE
        args = (x, cross_states, mask, cross_mask) if self.add_cross_attention else (x, mask)
        hidden = self.transformer(args)[0]
        if self.layernorm is not None:
            hidden = self.layernorm(hidden)
        if not self.add_lm_head:
            return (hidden,)
        if self.lm_head is not None:
            local = self.lm_head(hidden)  # [N, S, V/tp]
        else:
            local = F.linear(copy_to_tp(hidden, self.group), self.word_embedding.weight)  # [N, S, V/tp]
        logits = gather_from_tp(local, self.group, dim=-1)  # the full logits, as SMP v1 returns them
        if labels is None:
            return (logits,)
        shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return parallel_cross_entropy(local, shifted, process_group=self.group), logits
