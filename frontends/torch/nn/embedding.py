"""A vocabulary-parallel embedding: the table's rows (token ids) split over TP ranks.

With vocab 8 and tp = 2, rank 0 holds rows 0-3 and rank 1 rows 4-7. Each rank looks up the ids
that fall in its range, writes zeros for the others, and an allreduce (sum) gives every rank the
full embedding::

    ids [1, 6]   rank 0: [E[1], 0]    rank 1: [0, E[6]]    allreduce -> [E[1], E[6]] on both

The gradient of each row lands only on the rank that owns it. This is the layer that makes huge
vocabularies fit: each rank stores ``vocab / tp`` rows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .group import group_rank, group_size, resolve_group, shard_range
from .mappings import reduce_from_tp
from .params import sharded_parameter

__all__ = ["VocabParallelEmbedding"]


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding(num_embeddings, embedding_dim)`` with its rows split over TP ranks.

    Args:
        num_embeddings: global vocabulary size; must be divisible by the TP degree.
        embedding_dim: embedding size (not split).
        padding_idx: as in `torch.nn.Embedding` (global id; its row gets no gradient).
        process_group: the TP group (default: smp's TP group; None before ``smp.init``).
        dtype: parameter dtype.

    Example:
        >>> emb = VocabParallelEmbedding(16, 4)
        >>> emb(torch.tensor([[1, 15]])).shape
        torch.Size([1, 2, 4])
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 process_group: Any = None, dtype: torch.dtype | None = None,
                 _dense_init: nn.Embedding | None = None) -> None:
        super().__init__()
        self.group = resolve_group(process_group)
        self.tp = group_size(self.group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start, self.vocab_end = shard_range(num_embeddings, self.tp, group_rank(self.group),
                                                       "num_embeddings (vocab_size)")
        dense = _dense_init if _dense_init is not None else nn.Embedding(num_embeddings, embedding_dim,
                                                                         padding_idx=padding_idx, dtype=dtype)
        self.padding_idx = dense.padding_idx
        self.weight = sharded_parameter(dense.weight, 0, self.group, "num_embeddings (vocab_size)")

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, process_group: Any = None) -> VocabParallelEmbedding:
        """The vocabulary-parallel version of ``embedding`` holding this rank's rows of its table."""
        return cls(embedding.num_embeddings, embedding.embedding_dim, padding_idx=embedding.padding_idx,
                   process_group=process_group, _dense_init=embedding)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local_pad = None
        if self.padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_end:
            local_pad = self.padding_idx - self.vocab_start
        if self.tp == 1:
            return F.embedding(ids, self.weight, padding_idx=local_pad)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, padding_idx=local_pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}) "
                f"of tp={self.tp}, padding_idx={self.padding_idx}")
