"""Hugging Face GPT-NeoX in SMP v1's structure: the translate functions (exact) and SMP v1's hooks.

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

The hooks (`get_hf_gptneox_transformer_lm_head_hooks`, SMP v1's name): registered with
``smp.tp_register_with_module(GPTNeoXForCausalLM, smp.nn.DistributedTransformerLMHead, *hooks)``, a
GPT-NeoX created inside ``smp.tensor_parallelism()`` becomes a `DistributedTransformerLMHead` with
SMP v1's GPT-NeoX arguments: ``rotary_dim = int(head size * partial_rotary_factor)`` with
``gpt_neox_type_rotary`` (halves) and ``rotary_emb_base`` (``rope_theta``), ``parallel_attn_output``
from ``use_parallel_residual`` (``x + Attn(LN1(x)) + MLP(LN2(x))``; the sequential form otherwise),
``use_qkv_bias`` / ``use_attn_dense_bias`` from ``attention_bias``, ``use_positional_embedding=False``
and an own LM head without a bias. It is called like the Hugging Face model and returns a
``CausalLMOutputWithPast`` with the same logits and loss. Its weights are fresh, as in SMP v1; a
Hugging Face checkpoint loads through `translate_hf_state_dict_to_smdistributed_gptneox` (SMP v1's
names, as they are); a ``rotary_emb.inv_freq`` entry is accepted and
recomputed. SMP v1's init hook forced every dropout to 0; here the config's dropouts are kept.
Without the registration, a marked GPT-NeoX keeps the Hugging Face structure (the registry's
`transform` path), as before; docs/huggingface.md says which path a user gets.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ._causal_lm import causal_lm_inputs, causal_lm_output, config_activation
from ._common import HFTranslationError, check_max_seq_len, reject_partial, rename_keys, unknown_keys_error

__all__ = [
    "fuse_query_key_value",
    "get_hf_gptneox_transformer_lm_head_hooks",
    "hf_gptneox_transformer_forward_hook",
    "hf_gptneox_transformer_init_hook",
    "hf_gptneox_transformer_return_hook",
    "split_query_key_value",
    "translate_hf_gptneox_state_dict_to_smdistributed",
    "translate_hf_state_dict_to_smdistributed",
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


# --- SMP v1's hooks: GPTNeoXForCausalLM -> DistributedTransformerLMHead -----------------------

def _rope(config: Any) -> tuple[str, float, float]:
    """(rope_type, rope_theta, partial_rotary_factor): transformers 5's rope_parameters, else 4.x's names."""
    params = getattr(config, "rope_parameters", None) or {}
    return (params.get("rope_type", "default"), params.get("rope_theta", getattr(config, "rotary_emb_base", 10000)),
            params.get("partial_rotary_factor", getattr(config, "rotary_pct", 1.0)))


def hf_gptneox_transformer_init_hook(config: Any, *args: Any, **kwargs: Any
                                     ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``GPTNeoXForCausalLM(config)`` -> the `DistributedTransformerLMHead` arguments (SMP v1's, from its init hook).

    Raises:
        HFTranslationError: a config SMP v1's structure cannot compute, every problem named.
    """
    problems = []
    if config.hidden_size % config.num_attention_heads:
        problems.append(f"hidden_size={config.hidden_size} is not divisible by "
                        f"num_attention_heads={config.num_attention_heads}")
    activation = config_activation(config.hidden_act, problems, "hidden_act")
    head = config.hidden_size // max(config.num_attention_heads, 1)
    rope_type, theta, pct = _rope(config)
    rotary = int(head * pct)
    if rope_type != "default":
        problems.append(f"rope_parameters rope_type={rope_type!r}: only the default (unscaled) rotary embedding")
    if rotary % 2:
        problems.append(f"partial_rotary_factor={pct} gives {rotary} rotary dims of a head of {head}: an even number "
                        "is needed")
    if getattr(config, "tie_word_embeddings", False):
        problems.append("tie_word_embeddings=True: SMP v1's GPT-NeoX head is its own (lm_head)")
    if problems:
        raise HFTranslationError("this GPT-NeoX config does not fit SMP v1's structure:\n" +
                                 "\n".join(f"  - {p}" for p in problems) +
                                 "\nFix: change these config values, or keep the Hugging Face structure (do not "
                                 "register the hooks; marking or smp.transform(model) use it)")
    bias = bool(getattr(config, "attention_bias", True))
    return (), {
        "num_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
        "attention_head_size": head, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size,
        "num_positions": config.max_position_embeddings, "attention_dropout_prob": config.attention_dropout,
        "hidden_dropout_prob": config.hidden_dropout, "embedding_dropout_prob": config.hidden_dropout,
        "activation": activation, "layernorm_epsilon": config.layer_norm_eps,
        "initializer_range": config.initializer_range, "use_normal_initialization": True,
        "causal_mask_size": config.max_position_embeddings, "pre_layernorm": True, "post_layernorm": False,
        "final_layernorm": True, "parallel_attn_output": bool(config.use_parallel_residual),
        "rotary_dim": rotary or None, "rotary_emb_base": float(theta), "gpt_neox_type_rotary": True,
        "use_positional_embedding": False, "use_qkv_bias": bias, "use_attn_dense_bias": bias,
        "tie_input_output_embedding": False, "use_lm_head_bias": False}


def hf_gptneox_transformer_forward_hook(input_ids: Any = None, attention_mask: Any = None, position_ids: Any = None,
                                        inputs_embeds: Any = None, cache: Any = None, labels: Any = None,
                                        use_cache: Any = None, logits_to_keep: Any = 0, **kwargs: Any
                                        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``GPTNeoXForCausalLM.forward`` arguments (transformers 5's order) -> ``((input_ids, mask, None,
    position_ids, labels),)``."""
    unsupported = {"cache": cache, "past_key_values": kwargs.pop("past_key_values", None),
                   "inputs_embeds": inputs_embeds, "use_cache": use_cache, "logits_to_keep": logits_to_keep}
    return causal_lm_inputs("GPT-NeoX", input_ids, attention_mask, position_ids, labels, unsupported, kwargs)


def hf_gptneox_transformer_return_hook(outputs: tuple[Any, ...]) -> Any:
    """``(loss, logits)`` or ``(logits,)`` -> a ``CausalLMOutputWithPast``."""
    return causal_lm_output(outputs)


def get_hf_gptneox_transformer_lm_head_hooks() -> tuple[Any, Any, Any]:
    """SMP v1's (init_hook, forward_hook, return_hook) for ``GPTNeoXForCausalLM`` -> `DistributedTransformerLMHead`.

    Registered explicitly, a GPT-NeoX created inside ``smp.tensor_parallelism()`` becomes SMP v1's
    structure (fresh weights, as in SMP v1; load a Hugging Face checkpoint through
    `translate_hf_state_dict_to_smdistributed_gptneox`). Without the registration a marked GPT-NeoX
    keeps the Hugging Face structure (the registry's `transform` path).

    Example::

        smp.tp_register_with_module(transformers.GPTNeoXForCausalLM, smp.nn.DistributedTransformerLMHead,
                                    *get_hf_gptneox_transformer_lm_head_hooks())
        with smp.tensor_parallelism():
            model = transformers.GPTNeoXForCausalLM(config)
    """
    return (hf_gptneox_transformer_init_hook, hf_gptneox_transformer_forward_hook,
            hf_gptneox_transformer_return_hook)


def translate_hf_state_dict_to_smdistributed(state_dict: dict[str, Any], max_seq_len: int | None = None,
                                             num_attention_heads: int | None = None) -> dict[str, Any]:
    """SMP v1's module-level name of `translate_hf_state_dict_to_smdistributed_gptneox` (``max_seq_len`` unused)."""
    return translate_hf_gptneox_state_dict_to_smdistributed(state_dict, max_seq_len, num_attention_heads)
