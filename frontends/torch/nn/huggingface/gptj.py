"""Hugging Face GPT-J in SMP v1's names: the translate functions (exact), and why the hooks raise.

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

The hooks: SMP v1 converted ``GPTJForCausalLM`` into its ``DistributedTransformerLMHead`` through
`get_hf_gptj_transformer_hooks`. smp's `DistributedTransformerLMHead` has none of the pieces that
needs (rotary embeddings on ``rotary_dim`` dimensions rotated in interleaved pairs, attention and
MLP summed onto one residual after a single LayerNorm, bias-free projections, an untied LM head
with a bias, no position embedding), so the getter raises and says what to use instead: keep
the Hugging Face structure under tensor parallelism with ``smp.transform(model)`` (its parameter
names stay Hugging Face's, so no translation is needed), and use these functions to read or
write SMP v1 checkpoints.
"""

from __future__ import annotations

import logging
import re
from typing import Any, NoReturn

from ._common import HFTranslationError, check_max_seq_len, reject_partial, rename_keys, unknown_keys_error

__all__ = [
    "get_hf_gptj_transformer_hooks",
    "translate_hf_gptj_state_dict_to_smdistributed",
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


def get_hf_gptj_transformer_hooks() -> NoReturn:
    """SMP v1's (init_hook, forward_hook, return_hook) for ``GPTJForCausalLM``: not available in smp.

    Raises:
        HFTranslationError: always; the message names what smp's `DistributedTransformerLMHead`
            lacks and what to use instead.
    """
    raise HFTranslationError(
        "get_hf_gptj_transformer_hooks: SMP v1 replaced GPTJForCausalLM by a DistributedTransformerLMHead with "
        "rotary embeddings (rotary_dim, interleaved pairs), a parallel attention + MLP residual after one "
        "LayerNorm, bias-free q/k/v/out projections, no position embedding and an untied LM head with a bias; "
        "smp.torch.nn.DistributedTransformerLMHead has none of these, so GPT-J cannot take SMP v1's structure. "
        "Fix: keep the Hugging Face structure under tensor parallelism with smp.transform(model) (parameter "
        "names stay Hugging Face's), and convert SMP v1 checkpoints with translate_state_dict_to_hf_gptj / "
        "translate_hf_state_dict_to_smdistributed_gptj")
