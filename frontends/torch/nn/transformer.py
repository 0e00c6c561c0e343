"""SMP v1's transformer layers: the MLP block, one layer, and a stack of layers (global sizes).

`DistributedTransformerOutputLayer` (reference math, x of shape [N, S, H])::

    h   = LN_pre(x)                                   if pre_layernorm else x
    out = dropout(act(h W1 + b1) W2 + b2) + x         W1: H -> I column-parallel, W2: I -> H row-parallel
    out = LN_post(out)                                if post_layernorm

`DistributedTransformerLayer` = self-attention, optional cross-attention, then the output layer.
`DistributedTransformer` runs ``num_layers`` of them in sequence.

With ``parallel_attn_output=True`` (SMP v1's name; GPT-J, GPT-NeoX) a layer sums both branches
onto one residual instead::

    out = x + Attn(LN_a(x)) + MLP(LN_m(x))          pre_layernorm: each branch its own LayerNorm (GPT-NeoX)
    out = x + Attn(LN(x))   + MLP(LN(x))            single_pre_layernorm: one LayerNorm, the layer's (GPT-J)

The rotary and bias options of `DistributedAttentionLayer` (``rotary_dim``, ``rotary_emb_base``,
``gpt_neox_type_rotary``, ``use_qkv_bias``, ``use_attn_dense_bias``) pass through the layer and the
stack. All these options are keyword-only and off by default.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .attention import DistributedAttentionLayer, _check_layernorms
from .basic import DistributedLayerNorm, DistributedModule, dense_linear
from .group import divide
from .linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["ACTIVATIONS", "DistributedTransformerOutputLayer", "DistributedTransformerLayer",
           "DistributedTransformer"]

def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# "gelu_new" is GPT-2's tanh approximation of GELU (Hugging Face's name), so a translated GPT-2
# computes the same numbers as the Hugging Face model.
ACTIVATIONS = {"gelu": F.gelu, "gelu_new": _gelu_tanh, "relu": F.relu}


def _activation(name: str) -> Any:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation={name!r}: expected one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def _check_layer_options(pre_layernorm: bool, post_layernorm: bool, parallel_attn_output: bool,
                         single_pre_layernorm: bool, add_cross_attention: bool) -> None:
    problems = []
    if single_pre_layernorm and pre_layernorm:
        problems.append("single_pre_layernorm=True with pre_layernorm=True (as in SMP v1, one or the other)")
    if single_pre_layernorm and not parallel_attn_output:
        problems.append("single_pre_layernorm=True needs parallel_attn_output=True (GPT-J's layer)")
    if parallel_attn_output and add_cross_attention:
        problems.append("parallel_attn_output=True with add_cross_attention=True")
    if parallel_attn_output and not (pre_layernorm or single_pre_layernorm):
        problems.append("parallel_attn_output=True needs pre_layernorm=True (GPT-NeoX) or "
                        "single_pre_layernorm=True (GPT-J)")
    if problems:
        raise ValueError("DistributedTransformerLayer options do not fit together:\n" +
                         "\n".join(f"  - {p}" for p in problems) +
                         "\nFix: GPT-J: single_pre_layernorm=True, parallel_attn_output=True, pre_layernorm=False, "
                         "post_layernorm=False; GPT-NeoX: pre_layernorm=True, parallel_attn_output=True, "
                         "post_layernorm=False")


class DistributedTransformerOutputLayer(DistributedModule):
    """The transformer MLP H -> I -> H with residual and LayerNorm; SMP v1 signature, global sizes.

    Example:
        >>> mlp = DistributedTransformerOutputLayer(hidden_size=8, intermediate_size=16, hidden_dropout_prob=0.0)
        >>> mlp(torch.randn(2, 3, 8)).shape
        torch.Size([2, 3, 8])
    """

    def __init__(self, hidden_size: int = 1024, intermediate_size: int = 4096, hidden_dropout_prob: float = 0.1,
                 activation: str = "gelu", layernorm_epsilon: float = 1e-5, initializer_range: float = 0.02,
                 use_normal_initialization: bool = False, pre_layernorm: bool = False, post_layernorm: bool = True,
                 fp32_residual_addition: bool = False, process_group: Any = None, *,
                 parallel_attn_output: bool = False) -> None:
        super().__init__(process_group)
        _check_layernorms(pre_layernorm, post_layernorm, parallel_attn_output)
        self.parallel_attn_output = parallel_attn_output
        divide(intermediate_size, self.tp, "intermediate_size")
        self.act = _activation(activation)
        self.fp32_residual_addition = fp32_residual_addition
        self.pre_layernorm = DistributedLayerNorm(hidden_size, eps=layernorm_epsilon) if pre_layernorm else None
        self.dense1 = ColumnParallelLinear.from_linear(
            dense_linear(hidden_size, intermediate_size, True, initializer_range, use_normal_initialization),
            process_group=self.group)
        self.dense2 = RowParallelLinear.from_linear(
            dense_linear(intermediate_size, hidden_size, True, initializer_range, use_normal_initialization),
            process_group=self.group)
        self.dropout = nn.Dropout(hidden_dropout_prob)
        self.layernorm = DistributedLayerNorm(hidden_size, eps=layernorm_epsilon) if post_layernorm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre_layernorm(x) if self.pre_layernorm is not None else x
        y = self.dropout(self.dense2(self.act(self.dense1(h))))
        if self.parallel_attn_output:
            return y  # a branch of the parallel residual: the layer adds x
        out = (y.float() + x.float()).to(x.dtype) if self.fp32_residual_addition else y + x
        return self.layernorm(out) if self.layernorm is not None else out


class DistributedTransformerLayer(DistributedModule):
    """One transformer layer: attention (+ cross-attention) and MLP; SMP v1 signature, global sizes.

    ``forward((hidden, attention_mask))`` returns ``(new_hidden, attention_mask)``; with
    ``add_cross_attention=True``, ``forward((hidden, cross_states, attention_mask, cross_mask))``
    returns the same 4-tuple with the new hidden states.

    Example:
        >>> layer = DistributedTransformerLayer(num_attention_heads=2, attention_head_size=4, hidden_size=8,
        ...     intermediate_size=16, attention_dropout_prob=0.0, hidden_dropout_prob=0.0)
        >>> layer((torch.randn(1, 3, 8), None))[0].shape
        torch.Size([1, 3, 8])
    """

    def __init__(self, num_attention_heads: int = 32, attention_head_size: int = 32, hidden_size: int = 1024,
                 intermediate_size: int = 4096, attention_dropout_prob: float = 0.1,
                 hidden_dropout_prob: float = 0.1, activation: str = "gelu", layernorm_epsilon: float = 1e-5,
                 initializer_range: float = 0.02, use_normal_initialization: bool = False,
                 causal_mask_size: int | None = None, add_cross_attention: bool = False,
                 pre_layernorm: bool = False, post_layernorm: bool = True, process_group: Any = None, *,
                 rotary_dim: int | None = None, rotary_emb_base: float | None = None,
                 gpt_neox_type_rotary: bool = False, parallel_attn_output: bool = False,
                 use_qkv_bias: bool = True, use_attn_dense_bias: bool = True,
                 single_pre_layernorm: bool = False) -> None:
        super().__init__(process_group)
        _check_layer_options(pre_layernorm, post_layernorm, parallel_attn_output, single_pre_layernorm,
                             add_cross_attention)
        common = {"num_attention_heads": num_attention_heads, "attention_head_size": attention_head_size,
                  "hidden_size": hidden_size, "attention_dropout_prob": attention_dropout_prob,
                  "hidden_dropout_prob": hidden_dropout_prob, "layernorm_epsilon": layernorm_epsilon,
                  "initializer_range": initializer_range, "use_normal_initialization": use_normal_initialization,
                  "pre_layernorm": pre_layernorm, "post_layernorm": post_layernorm, "process_group": self.group,
                  "use_qkv_bias": use_qkv_bias, "use_attn_dense_bias": use_attn_dense_bias}
        self.add_cross_attention, self.parallel_attn_output = add_cross_attention, parallel_attn_output
        # SMP v1's single_pre_layernorm: the one LayerNorm both branches read (GPT-J's ln_1)
        self.pre_layernorm = (DistributedLayerNorm(hidden_size, eps=layernorm_epsilon) if single_pre_layernorm
                              else None)
        self.attention = DistributedAttentionLayer(
            causal_mask_size=causal_mask_size, rotary_dim=rotary_dim, rotary_emb_base=rotary_emb_base,
            gpt_neox_type_rotary=gpt_neox_type_rotary, parallel_attn_output=parallel_attn_output, **common)
        self.cross_attention = (DistributedAttentionLayer(cross_attention=True, **common)
                                if add_cross_attention else None)
        self.output = DistributedTransformerOutputLayer(
            hidden_size=hidden_size, intermediate_size=intermediate_size, hidden_dropout_prob=hidden_dropout_prob,
            activation=activation, layernorm_epsilon=layernorm_epsilon, initializer_range=initializer_range,
            use_normal_initialization=use_normal_initialization, pre_layernorm=pre_layernorm,
            post_layernorm=post_layernorm, process_group=self.group, parallel_attn_output=parallel_attn_output)

    def forward(self, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        if self.add_cross_attention:
            hidden, cross_states, mask, cross_mask = inputs
        else:
            hidden, mask = inputs
        if self.parallel_attn_output:
            h = self.pre_layernorm(hidden) if self.pre_layernorm is not None else hidden
            return (self.attention((h, mask)) + self.output(h) + hidden, mask)
        hidden = self.attention((hidden, mask))
        if self.cross_attention is not None:
            hidden = self.cross_attention((hidden, cross_states, cross_mask))
        hidden = self.output(hidden)
        return (hidden, cross_states, mask, cross_mask) if self.add_cross_attention else (hidden, mask)


class DistributedTransformer(DistributedModule):
    """``num_layers`` `DistributedTransformerLayer` s in sequence; same arguments, same tuples.

    When both ``pre_layernorm`` and ``post_layernorm`` are on, a LayerNorm is also applied to the
    stack's input and to its output (SMP v1 behaviour).

    Example:
        >>> stack = DistributedTransformer(num_layers=2, num_attention_heads=2, attention_head_size=4,
        ...     hidden_size=8, intermediate_size=16, attention_dropout_prob=0.0, hidden_dropout_prob=0.0)
        >>> stack((torch.randn(1, 3, 8), None))[0].shape
        torch.Size([1, 3, 8])
    """

    def __init__(self, num_layers: int = 12, num_attention_heads: int = 32, attention_head_size: int = 32,
                 hidden_size: int = 1024, intermediate_size: int = 4096, attention_dropout_prob: float = 0.1,
                 hidden_dropout_prob: float = 0.1, activation: str = "gelu", layernorm_epsilon: float = 1e-5,
                 initializer_range: float = 0.02, use_normal_initialization: bool = False,
                 causal_mask_size: int | None = None, add_cross_attention: bool = False,
                 pre_layernorm: bool = False, post_layernorm: bool = True, process_group: Any = None, *,
                 rotary_dim: int | None = None, rotary_emb_base: float | None = None,
                 gpt_neox_type_rotary: bool = False, parallel_attn_output: bool = False,
                 use_qkv_bias: bool = True, use_attn_dense_bias: bool = True,
                 single_pre_layernorm: bool = False) -> None:
        super().__init__(process_group)
        both = pre_layernorm and post_layernorm
        self.input_layernorm = DistributedLayerNorm(hidden_size, eps=layernorm_epsilon) if both else None
        self.seq_layers = nn.ModuleList(DistributedTransformerLayer(
            num_attention_heads=num_attention_heads, attention_head_size=attention_head_size,
            hidden_size=hidden_size, intermediate_size=intermediate_size,
            attention_dropout_prob=attention_dropout_prob, hidden_dropout_prob=hidden_dropout_prob,
            activation=activation, layernorm_epsilon=layernorm_epsilon, initializer_range=initializer_range,
            use_normal_initialization=use_normal_initialization, causal_mask_size=causal_mask_size,
            add_cross_attention=add_cross_attention, pre_layernorm=pre_layernorm, post_layernorm=post_layernorm,
            process_group=self.group, rotary_dim=rotary_dim, rotary_emb_base=rotary_emb_base,
            gpt_neox_type_rotary=gpt_neox_type_rotary, parallel_attn_output=parallel_attn_output,
            use_qkv_bias=use_qkv_bias, use_attn_dense_bias=use_attn_dense_bias,
            single_pre_layernorm=single_pre_layernorm) for _ in range(num_layers))
        self.output_layernorm = DistributedLayerNorm(hidden_size, eps=layernorm_epsilon) if both else None

    def forward(self, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden, rest = inputs[0], tuple(inputs[1:])
        if self.input_layernorm is not None:
            hidden = self.input_layernorm(hidden)
        out: tuple[Any, ...] = (hidden, *rest)
        for layer in self.seq_layers:
            out = layer(out)
        if self.output_layernorm is not None:
            out = (self.output_layernorm(out[0]), *out[1:])
        return out
