"""Hugging Face GPT-J in SMP v1's structure: the translate functions (exact) and SMP v1's hooks.

The names on each side, for layer N; every weight keeps its ``nn.Linear`` (out, in) layout, so
values are moved, never changed::

    Hugging Face GPTJForCausalLM            SMP v1 DistributedTransformerLMHead
    transformer.wte.weight                  word_embedding.weight
    transformer.h.N.ln_1.*                  transformer.seq_layers.N.pre_layernorm.*   (one LayerNorm per layer)
    transformer.h.N.attn.q_proj.weight      transformer.seq_layers.N.attention.query.weight   (no bias)
    transformer.h.N.attn.k_proj.weight      transformer.seq_layers.N.attention.key.weight     (no bias)
    transformer.h.N.attn.v_proj.weight      transformer.seq_layers.N.attention.value.weight   (no bias)
    transformer.h.N.attn.out_proj.weight    transformer.seq_layers.N.attention.dense.weight   (no bias)
    transformer.h.N.mlp.fc_in.*             transformer.seq_layers.N.output.dense1.*
    transformer.h.N.mlp.fc_out.*            transformer.seq_layers.N.output.dense2.*
    transformer.ln_f.*                      layernorm.*
    lm_head.weight, lm_head.bias            lm_head.weight, lm_head.bias   (untied, biased head)

Where the names come from: SMP v1's own ``smdistributed/modelparallel/torch/nn/huggingface/gptj.py``
(its ``translate_hf_state_dict_to_smdistributed_gptj`` / ``translate_state_dict_to_hf_gptj`` and the
init hook's arguments: ``rotary_dim``, ``parallel_attn_output=True``, ``single_pre_layernorm=True``,
``use_qkv_bias=False``, ``use_attn_dense_bias=False``, ``use_lm_head_bias=True``,
``use_positional_embedding=False``), read in a stored public copy of SMP v1's source. Nothing in
the table is inferred. Two behaviours are kept from that code: the transformers 4.x buffers
(``attn.bias``, ``attn.masked_bias``; here also the rotary table ``attn.embed_positions``, which
the loading model recomputes from its config) are dropped on the way in, and
``transformer.seq_layers.N.output.pre_layernorm.*`` / ``output.layernorm.*``, which SMP v1's code
skips on the way back (GPT-J has one LayerNorm per layer, so they have no counterpart), are
dropped with a log line. State dicts are full (every TP shard gathered), as SMP v1's were; a
partial one is refused.

The hooks (`get_hf_gptj_transformer_hooks`, SMP v1's name): registered with
``smp.tp_register_with_module(GPTJForCausalLM, smp.nn.DistributedTransformerLMHead, *hooks)``, a
GPT-J created inside ``smp.tensor_parallelism()`` becomes a `DistributedTransformerLMHead` with
SMP v1's GPT-J arguments: ``rotary_dim`` (interleaved pairs), ``single_pre_layernorm`` and
``parallel_attn_output`` (``x + Attn(LN(x)) + MLP(LN(x))``), ``use_qkv_bias=False``,
``use_attn_dense_bias=False``, ``use_positional_embedding=False``, and an own LM head with a bias
(``tie_input_output_embedding=False``, ``use_lm_head_bias=True``). It is called like the Hugging
Face model (``input_ids``, ``attention_mask``, ``labels``) and returns a ``CausalLMOutputWithPast``
with the same logits and loss. Its weights are fresh, as in SMP v1; a Hugging Face checkpoint
loads through `translate_hf_state_dict_to_smdistributed_gptj` (SMP v1's names, as they are). Unlike SMP v1,
``gelu_new`` stays the tanh GELU (SMP v1's hook passed ``activation='gelu'``, the exact one unless
``SMP_USE_HF_GELU=1``), so the numbers are Hugging Face's. Without the registration, GPT-J
keeps the Hugging Face structure under tensor parallelism (``smp.transform(model)``);
docs/huggingface.md says which path a user gets.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from ._causal_lm import causal_lm_inputs, causal_lm_output, config_activation
from ._common import HFTranslationError, check_max_seq_len, reject_partial, rename_keys, unknown_keys_error

__all__ = [
    "get_hf_gptj_transformer_hooks",
    "hf_gptj_transformer_forward_hook",
    "hf_gptj_transformer_init_hook",
    "hf_gptj_transformer_return_hook",
    "translate_hf_gptj_state_dict_to_smdistributed",
    "translate_hf_state_dict_to_smdistributed",
    "translate_hf_state_dict_to_smdistributed_gptj",
    "translate_state_dict_to_hf_gptj",
]

logger = logging.getLogger("smp")

_HF_LAYER = re.compile(r"^(?P<prefix>)transformer\.h\.(?P<index>\d+)\.(?P<rest>.+)$")
_SMD_LAYER = re.compile(r"^(?P<prefix>)transformer\.seq_layers\.(?P<index>\d+)\.(?P<rest>.+)$")
# one block, relative names: Hugging Face -> SMP v1
_BLOCK = {"ln_1": "pre_layernorm", "attn.q_proj": "attention.query", "attn.k_proj": "attention.key",
          "attn.v_proj": "attention.value", "attn.out_proj": "attention.dense", "mlp.fc_in": "output.dense1",
          "mlp.fc_out": "output.dense2"}
_TOP = {"transformer.wte.": "word_embedding.", "transformer.ln_f.": "layernorm.", "lm_head.": "lm_head."}
# transformers 4.x buffers, rebuilt from the config by the model that loads the weights
_HF_BUFFERS = (".attn.bias", ".attn.masked_bias", ".attn.embed_positions")
_SMD_UNUSED = re.compile(r"^transformer\.seq_layers\.\d+\.output\.(?:pre_layernorm|layernorm)\.")


def translate_hf_state_dict_to_smdistributed_gptj(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A Hugging Face ``GPTJForCausalLM`` state dict -> SMP v1's names (full tensors, unchanged).

    Example:
        >>> import torch, transformers
        >>> cfg = transformers.GPTJConfig(vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=8, rotary_dim=2)
        >>> sd = translate_hf_state_dict_to_smdistributed_gptj(transformers.GPTJForCausalLM(cfg).state_dict())
        >>> sorted(k for k in sd if ".attention." in k)[:2]
        ['transformer.seq_layers.0.attention.dense.weight', 'transformer.seq_layers.0.attention.key.weight']

    Raises:
        HFTranslationError: a partial state dict, or keys that are not GPT-J's.
    """
    what = "translate_hf_state_dict_to_smdistributed_gptj"
    reject_partial(state_dict, what)
    out, left = rename_keys(state_dict, _TOP, _HF_LAYER, "transformer.seq_layers.", _BLOCK)
    unknown = [k for k in left if not k.endswith(_HF_BUFFERS)]
    if unknown:
        raise unknown_keys_error("gptj", what, unknown, "Hugging Face GPTJForCausalLM keys")
    return out


def translate_hf_gptj_state_dict_to_smdistributed(state_dict: dict[str, Any], max_seq_len: int | None = None
                                                  ) -> dict[str, Any]:
    """SMP v1's older name of `translate_hf_state_dict_to_smdistributed_gptj` (``max_seq_len`` unused)."""
    check_max_seq_len(max_seq_len)
    return translate_hf_state_dict_to_smdistributed_gptj(state_dict)


def translate_state_dict_to_hf_gptj(state_dict: dict[str, Any], max_seq_len: int | None = None) -> dict[str, Any]:
    """SMP v1's GPT-J state dict -> Hugging Face ``GPTJForCausalLM`` names.

    ``max_seq_len`` is SMP v1's argument for the ``attn.bias`` buffers of transformers 4.x; the
    state dicts of transformers 5 have none, so it is only checked.

    Example:
        >>> import torch, transformers
        >>> cfg = transformers.GPTJConfig(vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=8, rotary_dim=2)
        >>> hf = transformers.GPTJForCausalLM(cfg).state_dict()
        >>> back = translate_state_dict_to_hf_gptj(translate_hf_state_dict_to_smdistributed_gptj(hf))
        >>> sorted(back) == sorted(hf) and all(torch.equal(back[k], v) for k, v in hf.items())
        True

    Raises:
        HFTranslationError: a partial state dict, or keys that are not SMP v1's GPT-J names.
    """
    what = "translate_state_dict_to_hf_gptj"
    check_max_seq_len(max_seq_len)
    reject_partial(state_dict, what)
    out, left = rename_keys(state_dict, {v: k for k, v in _TOP.items()}, _SMD_LAYER, "transformer.h.",
                            {v: k for k, v in _BLOCK.items()})
    unused = [k for k in left if _SMD_UNUSED.match(k)]
    if unused:
        logger.info("%s: dropped %d key(s) GPT-J has no counterpart for (SMP v1's unused per-layer output "
                    "LayerNorms), e.g. %s", what, len(unused), unused[0])
    unknown = [k for k in left if not _SMD_UNUSED.match(k)]
    if unknown:
        raise unknown_keys_error("gptj", what, unknown, "SMP v1 GPT-J (DistributedTransformerLMHead) keys")
    return out


# --- SMP v1's hooks: GPTJForCausalLM -> DistributedTransformerLMHead -------------------------

def _config_problems(config: Any) -> tuple[list[str], str]:
    problems = []
    if config.n_embd % config.n_head:
        problems.append(f"n_embd={config.n_embd} is not divisible by n_head={config.n_head}")
    activation = config_activation(config.activation_function, problems, "activation_function")
    head = config.n_embd // max(config.n_head, 1)
    rotary = config.rotary_dim
    if rotary is None or type(rotary) is not int or rotary < 2 or rotary % 2 or rotary > head:
        problems.append(f"rotary_dim={rotary!r}: expected an even int from 2 to the head size {head} (Hugging "
                        "Face's rotary_dim=None rotates with a table of n_embd dims, which no head has)")
    if getattr(config, "tie_word_embeddings", False):
        problems.append("tie_word_embeddings=True: GPT-J's LM head is its own, with a bias")
    return problems, activation


def hf_gptj_transformer_init_hook(config: Any, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``GPTJForCausalLM(config)`` -> the `DistributedTransformerLMHead` arguments (SMP v1's, from its init hook).

    Raises:
        HFTranslationError: a config SMP v1's structure cannot compute, every problem named.
    """
    problems, activation = _config_problems(config)
    if problems:
        raise HFTranslationError("this GPT-J config does not fit SMP v1's structure:\n" +
                                 "\n".join(f"  - {p}" for p in problems) +
                                 "\nFix: change these config values, or keep the Hugging Face structure (do not "
                                 "register the hooks; smp.transform(model))")
    return (), {
        "num_layers": config.n_layer, "num_attention_heads": config.n_head,
        "attention_head_size": config.n_embd // config.n_head, "hidden_size": config.n_embd,
        "intermediate_size": config.n_inner if config.n_inner is not None else 4 * config.n_embd,
        "vocab_size": config.vocab_size, "num_positions": config.n_positions,
        "attention_dropout_prob": config.attn_pdrop, "hidden_dropout_prob": config.resid_pdrop,
        "embedding_dropout_prob": config.embd_pdrop, "activation": activation,
        "layernorm_epsilon": config.layer_norm_epsilon, "initializer_range": config.initializer_range,
        "use_normal_initialization": True, "causal_mask_size": config.n_positions,
        "pre_layernorm": False, "post_layernorm": False, "final_layernorm": True, "single_pre_layernorm": True,
        "parallel_attn_output": True, "rotary_dim": config.rotary_dim, "use_positional_embedding": False,
        "use_qkv_bias": False, "use_attn_dense_bias": False, "tie_input_output_embedding": False,
        "use_lm_head_bias": True}


def hf_gptj_transformer_forward_hook(input_ids: Any = None, cache: Any = None, attention_mask: Any = None,
                                     token_type_ids: Any = None, position_ids: Any = None, inputs_embeds: Any = None,
                                     labels: Any = None, use_cache: Any = None, logits_to_keep: Any = 0,
                                     **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``GPTJForCausalLM.forward`` arguments (transformers 5's order) -> ``((input_ids, mask, None,
    position_ids, labels),)``."""
    unsupported = {"cache": cache, "past_key_values": kwargs.pop("past_key_values", None),
                   "token_type_ids": token_type_ids, "inputs_embeds": inputs_embeds, "use_cache": use_cache,
                   "logits_to_keep": logits_to_keep}
    return causal_lm_inputs("GPT-J", input_ids, attention_mask, position_ids, labels, unsupported, kwargs)


def hf_gptj_transformer_return_hook(outputs: tuple[Any, ...]) -> Any:
    """``(loss, logits)`` or ``(logits,)`` -> a ``CausalLMOutputWithPast``."""
    return causal_lm_output(outputs)


def get_hf_gptj_transformer_hooks() -> tuple[Any, Any, Any]:
    """SMP v1's (init_hook, forward_hook, return_hook) for ``GPTJForCausalLM`` -> `DistributedTransformerLMHead`.

    Registered explicitly, a GPT-J created inside ``smp.tensor_parallelism()`` becomes SMP v1's
    structure (fresh weights, as in SMP v1; load a Hugging Face checkpoint through
    `translate_hf_state_dict_to_smdistributed_gptj`). Without the registration GPT-J keeps the Hugging
    Face structure.

    Example::

        smp.tp_register_with_module(transformers.GPTJForCausalLM, smp.nn.DistributedTransformerLMHead,
                                    *get_hf_gptj_transformer_hooks())
        with smp.tensor_parallelism():
            model = transformers.GPTJForCausalLM(config)
    """
    return hf_gptj_transformer_init_hook, hf_gptj_transformer_forward_hook, hf_gptj_transformer_return_hook


def translate_hf_state_dict_to_smdistributed(state_dict: dict[str, Any], max_seq_len: int | None = None
                                             ) -> dict[str, Any]:
    """SMP v1's first name of `translate_hf_state_dict_to_smdistributed_gptj`, called ``(state_dict, max_seq_len)``."""
    return translate_hf_gptj_state_dict_to_smdistributed(state_dict, max_seq_len)
