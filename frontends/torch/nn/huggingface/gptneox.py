"""Hugging Face GPT-NeoX in SMP v1's names: the translate functions (exact), and why the hooks raise.

The names on each side, for layer N; every weight keeps its ``nn.Linear`` (out, in) layout::

    Hugging Face GPTNeoXForCausalLM                    SMP v1 DistributedTransformerLMHead
    gpt_neox.embed_in.weight                           word_embedding.weight
    gpt_neox.layers.N.input_layernorm.*                transformer.seq_layers.N.attention.pre_layernorm.*
    gpt_neox.layers.N.post_attention_layernorm.*       transformer.seq_layers.N.output.pre_layernorm.*
    gpt_neox.layers.N.attention.query_key_value.*      transformer.seq_layers.N.attention.{query,key,value}.*
                                                       (split per head, below)
    gpt_neox.layers.N.attention.dense.*                transformer.seq_layers.N.attention.dense.*
    gpt_neox.layers.N.attention.rotary_emb.inv_freq    transformer.seq_layers.N.attention.rotary_emb.inv_freq
                                                       (a buffer transformers 4.x saved; 5 saves none)
    gpt_neox.layers.N.mlp.dense_h_to_4h.*              transformer.seq_layers.N.output.dense1.*
    gpt_neox.layers.N.mlp.dense_4h_to_h.*              transformer.seq_layers.N.output.dense2.*
    gpt_neox.final_layer_norm.*                        layernorm.*
    lm_head.weight (transformers 4.x: embed_out.weight)  lm_head.weight   (untied, no bias)

The fused ``query_key_value`` is interleaved per head: ``GPTNeoXAttention`` views its output as
[..., heads, 3 * head_size] and chunks the last dim into q, k, v, so its rows are, for 2 heads of
size d::

    rows  0:d   d:2d  2d:3d | 3d:4d 4d:5d 5d:6d
          q0    k0    v0    | q1    k1    v1          ->  query = [q0; q1], key = [k0; k1], value = [v0; v1]

(the bias the same way), which is why the split needs ``num_attention_heads``. SMP v1 read it from
the config its init hook had seen (a module global); here it is an argument.

Where the names come from: SMP v1's own ``smdistributed/modelparallel/torch/nn/huggingface/gptneox.py``
(its translate functions and the init hook's arguments: ``rotary_pct``, ``rotary_emb_base``,
``gpt_neox_type_rotary=True``, ``parallel_attn_output=True``, ``use_qkv_bias=True``,
``use_attn_dense_bias=True``, ``use_lm_head_bias=False``, ``use_positional_embedding=False``),
read in a stored public copy of SMP v1's source. Nothing in the table is inferred except the
``lm_head.weight`` name on the Hugging Face side, which is transformers 5's (it renamed
``embed_out``; ``from_pretrained`` still reads the old name). One difference: SMP v1's way back
re-interleaved only the weight and left the bias as [q; k; v], so its round trip changed every
``query_key_value.bias``; here both are re-interleaved and the round trip is exact. The
transformers 4.x causal-mask buffers (``attention.bias``, ``attention.masked_bias``) are dropped on
the way in, as SMP v1 did. State dicts are full (every TP shard gathered); a partial one is refused.

The hooks: SMP v1 converted ``GPTNeoXForCausalLM`` into its ``DistributedTransformerLMHead``
through `get_hf_gptneox_transformer_lm_head_hooks`. smp's `DistributedTransformerLMHead` lacks
what that needs (rotary embeddings on ``partial_rotary_factor`` of each head, rotated in halves,
the parallel attention + MLP residual, an untied LM head, no position embedding), so the getter
raises and says what to use instead: marking the model for tensor parallelism
(``smp.tensor_parallelism()``, ``smp.set_tensor_parallelism``) or ``smp.transform(model)`` runs it
in the Hugging Face structure, whose names need no translation.
"""

from __future__ import annotations

import re
from typing import Any, NoReturn

import torch

from ._common import HFTranslationError, check_max_seq_len, reject_partial, rename_keys, unknown_keys_error

__all__ = [
    "fuse_query_key_value",
    "get_hf_gptneox_transformer_lm_head_hooks",
    "split_query_key_value",
    "translate_hf_gptneox_state_dict_to_smdistributed",
    "translate_hf_state_dict_to_smdistributed_gptneox",
    "translate_state_dict_to_hf_gptneox",
]

_HF_LAYER = re.compile(r"^(?P<prefix>)gpt_neox\.layers\.(?P<index>\d+)\.(?P<rest>.+)$")
_SMD_LAYER = re.compile(r"^(?P<prefix>)transformer\.seq_layers\.(?P<index>\d+)\.(?P<rest>.+)$")
# one layer, relative names: Hugging Face -> SMP v1 (the fused query_key_value is handled apart)
_BLOCK = {"input_layernorm": "attention.pre_layernorm", "post_attention_layernorm": "output.pre_layernorm",
          "attention.dense": "attention.dense", "attention.rotary_emb": "attention.rotary_emb",
          "mlp.dense_h_to_4h": "output.dense1", "mlp.dense_4h_to_h": "output.dense2"}
_TOP = {"gpt_neox.embed_in.": "word_embedding.", "gpt_neox.final_layer_norm.": "layernorm.", "lm_head.": "lm_head."}
_TOP_IN = {**_TOP, "embed_out.": "lm_head."}  # transformers 4.x's name of the LM head
_HF_BUFFERS = (".attention.bias", ".attention.masked_bias")
_QKV = ("query", "key", "value")


def _heads(num_attention_heads: Any, rows: int, what: str, key: str) -> int:
    if num_attention_heads is None:
        raise HFTranslationError(f"{what}: {key} is GPT-NeoX's fused query_key_value, interleaved per head; "
                                 "splitting it needs the head count. Fix: pass "
                                 "num_attention_heads=config.num_attention_heads")
    if type(num_attention_heads) is not int or num_attention_heads < 1 or rows % (3 * num_attention_heads):
        raise HFTranslationError(f"{what}: num_attention_heads={num_attention_heads!r} does not divide {key} "
                                 f"({rows} rows = 3 x heads x head size). Fix: pass the model's "
                                 "config.num_attention_heads")
    return num_attention_heads


def split_query_key_value(fused: torch.Tensor, num_attention_heads: int) -> tuple[torch.Tensor, ...]:
    """GPT-NeoX's per-head interleaved ``query_key_value`` weight (3H, in) or bias (3H) -> (q, k, v).

    Example:
        >>> q, k, v = split_query_key_value(torch.arange(12.0), num_attention_heads=2)  # head size 2
        >>> q.tolist(), k.tolist(), v.tolist()
        ([0.0, 1.0, 6.0, 7.0], [2.0, 3.0, 8.0, 9.0], [4.0, 5.0, 10.0, 11.0])
    """
    rest = tuple(fused.shape[1:])
    per_head = fused.view(num_attention_heads, 3, fused.shape[0] // (3 * num_attention_heads), *rest)
    return tuple(per_head[:, i].reshape(-1, *rest).contiguous() for i in range(3))


def fuse_query_key_value(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_attention_heads: int
                         ) -> torch.Tensor:
    """The inverse of `split_query_key_value`."""
    rest = tuple(q.shape[1:])
    parts = [t.reshape(num_attention_heads, -1, *rest) for t in (q, k, v)]
    return torch.stack(parts, dim=1).reshape(-1, *rest).contiguous()


def translate_hf_state_dict_to_smdistributed_gptneox(state_dict: dict[str, Any],
                                                     num_attention_heads: int | None = None) -> dict[str, Any]:
    """A Hugging Face ``GPTNeoXForCausalLM`` state dict -> SMP v1's names (the fused qkv split per head).

    Example:
        >>> import transformers
        >>> cfg = transformers.GPTNeoXConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1,
        ...                                  num_attention_heads=2, intermediate_size=16)
        >>> hf = transformers.GPTNeoXForCausalLM(cfg).state_dict()
        >>> sd = translate_hf_state_dict_to_smdistributed_gptneox(hf, num_attention_heads=2)
        >>> tuple(sd["transformer.seq_layers.0.attention.query.weight"].shape)
        (8, 8)

    Raises:
        HFTranslationError: a partial state dict, keys that are not GPT-NeoX's, or a missing or
            wrong ``num_attention_heads``.
    """
    what = "translate_hf_state_dict_to_smdistributed_gptneox"
    reject_partial(state_dict, what)
    out, left = rename_keys(state_dict, _TOP_IN, _HF_LAYER, "transformer.seq_layers.", _BLOCK)
    unknown = []
    for key in left:
        parsed = _HF_LAYER.match(key)
        owner, _, leaf = parsed["rest"].rpartition(".") if parsed else ("", "", "")
        if parsed and owner == "attention.query_key_value":
            value = state_dict[key]
            heads = _heads(num_attention_heads, value.shape[0], what, key)
            for name, part in zip(_QKV, split_query_key_value(value, heads)):
                out[f"transformer.seq_layers.{parsed['index']}.attention.{name}.{leaf}"] = part
        elif not key.endswith(_HF_BUFFERS):
            unknown.append(key)
    if unknown:
        raise unknown_keys_error("gptneox", what, unknown, "Hugging Face GPTNeoXForCausalLM keys")
    return out


def translate_hf_gptneox_state_dict_to_smdistributed(state_dict: dict[str, Any], max_seq_len: int | None = None,
                                                     num_attention_heads: int | None = None) -> dict[str, Any]:
    """SMP v1's older name of `translate_hf_state_dict_to_smdistributed_gptneox` (``max_seq_len`` unused)."""
    check_max_seq_len(max_seq_len)
    return translate_hf_state_dict_to_smdistributed_gptneox(state_dict, num_attention_heads)


def translate_state_dict_to_hf_gptneox(state_dict: dict[str, Any], max_seq_len: int | None = None,
                                       num_attention_heads: int | None = None) -> dict[str, Any]:
    """SMP v1's GPT-NeoX state dict -> Hugging Face ``GPTNeoXForCausalLM`` names (q, k, v fused per head).

    ``max_seq_len`` is SMP v1's argument for the ``attention.bias`` buffers of transformers 4.x;
    the state dicts of transformers 5 have none, so it is only checked. The LM head comes out as
    ``lm_head.weight`` (transformers 5's name).

    Example:
        >>> import transformers
        >>> cfg = transformers.GPTNeoXConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1,
        ...                                  num_attention_heads=2, intermediate_size=16)
        >>> hf = transformers.GPTNeoXForCausalLM(cfg).state_dict()
        >>> smd = translate_hf_state_dict_to_smdistributed_gptneox(hf, num_attention_heads=2)
        >>> back = translate_state_dict_to_hf_gptneox(smd, num_attention_heads=2)
        >>> sorted(back) == sorted(hf) and all(torch.equal(back[k], v) for k, v in hf.items())
        True

    Raises:
        HFTranslationError: a partial state dict, keys that are not SMP v1's GPT-NeoX names, a
            query/key/value without the other two, or a missing or wrong ``num_attention_heads``.
    """
    what = "translate_state_dict_to_hf_gptneox"
    check_max_seq_len(max_seq_len)
    reject_partial(state_dict, what)
    out, left = rename_keys(state_dict, {v: k for k, v in _TOP.items()}, _SMD_LAYER, "gpt_neox.layers.",
                            {v: k for k, v in _BLOCK.items()})
    qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    unknown = []
    for key in left:
        parsed = _SMD_LAYER.match(key)
        owner, _, leaf = parsed["rest"].rpartition(".") if parsed else ("", "", "")
        if parsed and owner.startswith("attention.") and owner[len("attention."):] in _QKV:
            qkv.setdefault((parsed["index"], leaf), {})[owner[len("attention."):]] = state_dict[key]
        else:
            unknown.append(key)
    if unknown:
        raise unknown_keys_error("gptneox", what, unknown, "SMP v1 GPT-NeoX (DistributedTransformerLMHead) keys")
    for (index, leaf), parts in qkv.items():
        head = f"transformer.seq_layers.{index}.attention"
        if set(parts) != set(_QKV):
            raise HFTranslationError(f"{what}: {head} has {sorted(parts)} {leaf} but needs query, key and value "
                                     "together (they form GPT-NeoX's fused query_key_value)")
        heads = _heads(num_attention_heads, 3 * parts["query"].shape[0], what, f"{head}.query.{leaf}")
        out[f"gpt_neox.layers.{index}.attention.query_key_value.{leaf}"] = fuse_query_key_value(
            parts["query"], parts["key"], parts["value"], heads)
    return out


def get_hf_gptneox_transformer_lm_head_hooks() -> NoReturn:
    """SMP v1's (init_hook, forward_hook, return_hook) for ``GPTNeoXForCausalLM``: not available in smp.

    Raises:
        HFTranslationError: always; the message names what smp's `DistributedTransformerLMHead`
            lacks and what to use instead.
    """
    raise HFTranslationError(
        "get_hf_gptneox_transformer_lm_head_hooks: SMP v1 replaced GPTNeoXForCausalLM by a "
        "DistributedTransformerLMHead with rotary embeddings (partial_rotary_factor of each head, rotated in "
        "halves), a parallel attention + MLP residual, no position embedding and an untied LM head; "
        "smp.torch.nn.DistributedTransformerLMHead has none of these, so GPT-NeoX cannot take SMP v1's "
        "structure. Fix: mark the model for tensor parallelism (smp.tensor_parallelism() or "
        "smp.set_tensor_parallelism) or call smp.transform(model): it runs in the Hugging Face structure, whose "
        "parameter names stay Hugging Face's; convert SMP v1 checkpoints with translate_state_dict_to_hf_gptneox "
        "/ translate_hf_state_dict_to_smdistributed_gptneox")
