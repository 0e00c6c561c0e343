"""Hugging Face models in SMP v1's structure: ``smp.torch.nn.huggingface`` (SMP v1's ``smp.nn.huggingface``).

One module per family, with SMP v1's names: `gpt2` (``GPT2LMHeadModel`` ->
`DistributedTransformerLMHead`, and ``GPT2Block`` -> `DistributedTransformerLayer` through layer
hooks), `bert` and `roberta` (the encoder -> `DistributedTransformer`), `gptj` and `gptneox`
(``GPTJForCausalLM`` / ``GPTNeoXForCausalLM`` -> `DistributedTransformerLMHead` with rotary
embeddings and the parallel residual, through SMP v1's hooks when registered). Each has
``translate_hf_state_dict_to_smdistributed_<family>(state_dict)``,
``translate_state_dict_to_hf_<family>(state_dict, max_seq_len=None)`` and the hook getters.
`translate_hf_state_dict_to_smdistributed` / `translate_state_dict_to_hf` pick the family from
the keys (or ``model_type``). docs/huggingface.md says which structure a user gets and why.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import bert, gpt2, gptj, gptneox, roberta
from ._common import HFTranslationError

__all__ = ["FAMILIES", "Family", "HFTranslationError", "bert", "family_of_state_dict", "gpt2", "gptj", "gptneox",
           "roberta", "translate_hf_state_dict_to_smdistributed", "translate_state_dict_to_hf"]


@dataclass(frozen=True)
class Family:
    """One Hugging Face family SMP v1's structure covers: its two translate functions and how to
    recognise its state dicts (a pattern some key matches, ``re.search``, on each side)."""

    to_smdistributed: Callable[..., dict[str, Any]]
    to_hf: Callable[..., dict[str, Any]]
    hf_marker: str
    smd_marker: str


# Recognised in this order, the first match wins. GPT-2's SMP v1 marker is its position embedding,
# which GPT-J and GPT-NeoX (rotary) lack; a GPT-J SMP v1 state dict also has GPT-NeoX's marker
# (lm_head.weight), so GPT-J is tried before GPT-NeoX, and both after the encoders, whose markers
# are unambiguous.
FAMILIES: dict[str, Family] = {
    "gpt2": Family(gpt2.translate_hf_state_dict_to_smdistributed_gpt2, gpt2.translate_state_dict_to_hf_gpt2,
                   r"\.attn\.c_attn\.", r"^position_embedding\."),
    "bert": Family(bert.translate_hf_state_dict_to_smdistributed_bert, bert.translate_state_dict_to_hf_bert,
                   r"bert\.encoder\.layer\.", r"bert\.encoder\.seq_layers\."),
    "roberta": Family(roberta.translate_hf_state_dict_to_smdistributed_roberta,
                      roberta.translate_state_dict_to_hf_roberta, r"roberta\.encoder\.layer\.",
                      r"roberta\.encoder\.seq_layers\."),
    "gptj": Family(gptj.translate_hf_state_dict_to_smdistributed_gptj, gptj.translate_state_dict_to_hf_gptj,
                   r"^transformer\.h\.\d+\.attn\.q_proj\.", r"^transformer\.seq_layers\.\d+\.pre_layernorm\."),
    "gptneox": Family(gptneox.translate_hf_state_dict_to_smdistributed_gptneox,
                      gptneox.translate_state_dict_to_hf_gptneox, r"^gpt_neox\.layers\.", r"^lm_head\.weight$"),
}


def family_of_state_dict(state_dict: dict[str, Any], hf: bool, model_type: str | None = None) -> str:
    """The family of ``state_dict`` (Hugging Face names when ``hf``): ``model_type`` when given.

    Raises:
        HFTranslationError: an unknown ``model_type``, or keys of no known family.
    """
    if model_type is not None:
        key = model_type.replace("-", "").replace("_", "")
        if key not in FAMILIES:
            raise HFTranslationError(f"model_type={model_type!r}: SMP v1's structure covers {sorted(FAMILIES)}. "
                                     "Fix: use one of those, or smp.transform(model) for other models")
        return key
    for name, family in FAMILIES.items():
        marker = re.compile(family.hf_marker if hf else family.smd_marker)
        if any(marker.search(k) for k in state_dict):
            return name
    raise HFTranslationError(f"no family recognised in a state dict with keys {list(state_dict)[:4]}: expected "
                             f"one of {sorted(FAMILIES)}. Fix: pass model_type=..., or the state dict of one of "
                             "those models")


def translate_hf_state_dict_to_smdistributed(state_dict: dict[str, Any], model_type: str | None = None,
                                             **options: Any) -> dict[str, Any]:
    """A Hugging Face state dict -> SMP v1's structure, for any family in `FAMILIES`.

    ``options`` go to the family's function (GPT-NeoX needs ``num_attention_heads``).

    Example:
        >>> import transformers
        >>> cfg = transformers.GPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=8)
        >>> sd = translate_hf_state_dict_to_smdistributed(transformers.GPT2LMHeadModel(cfg).state_dict())
        >>> "transformer.seq_layers.0.attention.query.weight" in sd
        True
    """
    return FAMILIES[family_of_state_dict(state_dict, True, model_type)].to_smdistributed(state_dict, **options)


def translate_state_dict_to_hf(state_dict: dict[str, Any], model_type: str | None = None,
                               max_seq_len: int | None = None, **options: Any) -> dict[str, Any]:
    """SMP v1's structure -> Hugging Face names, for any family in `FAMILIES` (``options`` as above)."""
    return FAMILIES[family_of_state_dict(state_dict, False, model_type)].to_hf(state_dict, max_seq_len, **options)
