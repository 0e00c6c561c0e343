"""Tensor-parallel layers for PyTorch: ``smp.torch.nn`` (SMP v1's ``smp.nn``).

SMP v1 layers (global sizes, SMP v1 signatures): `DistributedLinear`, `DistributedEmbedding`,
`DistributedLayerNorm`, `DistributedAttentionLayer`, `DistributedTransformerOutputLayer`,
`DistributedTransformerLayer`, `DistributedTransformer`, `DistributedTransformerLMHead`, and
`FusedLayerNorm` (apex's, on torch's kernel without apex). Building blocks underneath (Megatron
style): `ColumnParallelLinear`, `RowParallelLinear`, `VocabParallelEmbedding`,
`parallel_cross_entropy`, the mappings at the edges of a TP region, and the RNG tracker.
"""

from .attention import DistributedAttentionLayer
from .basic import DistributedEmbedding, DistributedLayerNorm, DistributedLinear, DistributedModule
from .batch import BatchScaled, scale_batch, unscale_batch
from .cross_entropy import parallel_cross_entropy
from .embedding import VocabParallelEmbedding
from .fused import FusedLayerNorm
from .group import TPShardingError
from .linear import ColumnParallelLinear, RowParallelLinear
from .lm_head import DistributedTransformerLMHead
from .mappings import copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp
from .params import full_state_dict, gather_full, is_tp_sharded, tp_split_dim
from .rng import RNGStatesTracker, get_rng_state_tracker, seed_tensor_parallel
from .transformer import (
    DistributedTransformer,
    DistributedTransformerLayer,
    DistributedTransformerOutputLayer,
)

__all__ = [
    "BatchScaled",
    "ColumnParallelLinear",
    "DistributedAttentionLayer",
    "DistributedEmbedding",
    "DistributedLayerNorm",
    "DistributedLinear",
    "DistributedModule",
    "DistributedTransformer",
    "DistributedTransformerLayer",
    "DistributedTransformerLMHead",
    "DistributedTransformerOutputLayer",
    "FusedLayerNorm",
    "RNGStatesTracker",
    "RowParallelLinear",
    "TPShardingError",
    "VocabParallelEmbedding",
    "copy_to_tp",
    "full_state_dict",
    "gather_from_tp",
    "gather_full",
    "get_rng_state_tracker",
    "is_tp_sharded",
    "parallel_cross_entropy",
    "reduce_from_tp",
    "scale_batch",
    "scatter_to_tp",
    "seed_tensor_parallel",
    "tp_split_dim",
    "unscale_batch",
]
