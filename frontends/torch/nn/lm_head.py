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
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .attention import MASK_VALUE
from .basic import DistributedLayerNorm, DistributedModule
from .cross_entropy import parallel_cross_entropy
from .embedding import VocabParallelEmbedding
from .mappings import copy_to_tp, gather_from_tp
from .transformer import DistributedTransformer

__all__ = ["DistributedTransformerLMHead"]


class DistributedTransformerLMHead(DistributedModule):
    """Embeddings, a `DistributedTransformer` and a tied, vocabulary-parallel LM head (SMP v1 signature).

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
                 process_group: Any = None) -> None:
        super().__init__(process_group)
        word = nn.Embedding(vocab_size, hidden_size)
        nn.init.normal_(word.weight, 0.0, initializer_range)
        self.word_embedding = VocabParallelEmbedding.from_embedding(word, process_group=self.group)
        self.position_embedding = nn.Embedding(num_positions, hidden_size)
        nn.init.normal_(self.position_embedding.weight, 0.0, initializer_range)
        self.token_type_embedding: nn.Embedding | None = None
        if num_token_types > 0:
            self.token_type_embedding = nn.Embedding(num_token_types, hidden_size)
            nn.init.normal_(self.token_type_embedding.weight, 0.0, initializer_range)
        self.embedding_dropout = nn.Dropout(hidden_dropout_prob)
        self.transformer = DistributedTransformer(
            num_layers=num_layers, num_attention_heads=num_attention_heads, attention_head_size=attention_head_size,
            hidden_size=hidden_size, intermediate_size=intermediate_size,
            attention_dropout_prob=attention_dropout_prob, hidden_dropout_prob=hidden_dropout_prob,
            activation=activation, layernorm_epsilon=layernorm_epsilon, initializer_range=initializer_range,
            use_normal_initialization=use_normal_initialization, causal_mask_size=causal_mask_size,
            add_cross_attention=add_cross_attention, pre_layernorm=pre_layernorm, post_layernorm=post_layernorm,
            process_group=self.group)
        # SMP v1's internal ``final_layernorm``: a LayerNorm after the last layer (pre-LN models: GPT-2's ln_f).
        self.layernorm = DistributedLayerNorm(hidden_size, eps=layernorm_epsilon) if final_layernorm else None
        self.add_cross_attention, self.add_lm_head = add_cross_attention, add_lm_head

    def forward(self, inputs: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
        if self.add_cross_attention:
            input_ids, attention_mask, token_type_ids, position_ids, cross_states, _, cross_mask, labels = inputs
        else:
            input_ids, attention_mask, token_type_ids, position_ids, labels = inputs
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        x = self.word_embedding(input_ids) + self.position_embedding(position_ids)
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
        local = F.linear(copy_to_tp(hidden, self.group), self.word_embedding.weight)  # [N, S, V/tp]
        logits = gather_from_tp(local, self.group, dim=-1)  # the full logits, as SMP v1 returns them
        if labels is None:
            return (logits,)
        shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return parallel_cross_entropy(local, shifted, process_group=self.group), logits
