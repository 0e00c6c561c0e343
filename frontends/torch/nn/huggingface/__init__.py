"""Hugging Face models in SMP v1's structure: ``smp.torch.nn.huggingface`` (SMP v1's ``smp.nn.huggingface``).

One module per family, with SMP v1's names: `gpt2` (``GPT2LMHeadModel`` ->
`DistributedTransformerLMHead`, and ``GPT2Block`` -> `DistributedTransformerLayer` through layer
hooks), `bert` and `roberta` (the encoder -> `DistributedTransformer`). Each has
``translate_hf_state_dict_to_smdistributed_<family>(state_dict)``,
``translate_state_dict_to_hf_<family>(state_dict, max_seq_len=None)`` and the hook getters.
`translate_hf_state_dict_to_smdistributed` / `translate_state_dict_to_hf` pick the family from
the keys (or ``model_type``). docs/huggingface.md says which structure a user gets and why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import bert, gpt2, roberta
from ._common import HFTranslationError

__all__ = ["FAMILIES", "Family", "HFTranslationError", "bert", "family_of_state_dict", "gpt2", "roberta",
           "translate_hf_state_dict_to_smdistributed", "translate_state_dict_to_hf"]


@dataclass(frozen=True)
class Family:
    """One Hugging Face family SMP v1's structure covers: its two translate functions and how to
    recognise its state dicts (a key fragment on each side)."""

    to_smdistributed: Callable[[dict[str, Any]], dict[str, Any]]
    to_hf: Callable[..., dict[str, Any]]
    hf_marker: str
    smd_marker: str


FAMILIES: dict[str, Family] = {
    "gpt2": Family(gpt2.translate_hf_state_dict_to_smdistributed_gpt2, gpt2.translate_state_dict_to_hf_gpt2,
                   ".attn.c_attn.", "word_embedding."),
    "bert": Family(bert.translate_hf_state_dict_to_smdistributed_bert, bert.translate_state_dict_to_hf_bert,
                   "bert.encoder.layer.", "bert.encoder.seq_layers."),
    "roberta": Family(roberta.translate_hf_state_dict_to_smdistributed_roberta,
                      roberta.translate_state_dict_to_hf_roberta, "roberta.encoder.layer.",
                      "roberta.encoder.seq_layers."),
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
        marker = family.hf_marker if hf else family.smd_marker
        if any(marker in k for k in state_dict):
            return name
    raise HFTranslationError(f"no family recognised in a state dict with keys {list(state_dict)[:4]}: expected "
                             f"one of {sorted(FAMILIES)}. Fix: pass model_type=..., or the state dict of one of "
                             "those models")


def translate_hf_state_dict_to_smdistributed(state_dict: dict[str, Any], model_type: str | None = None
                                             ) -> dict[str, Any]:
    """A Hugging Face state dict -> SMP v1's structure, for any family in `FAMILIES`.

    Example:
        >>> import transformers
        >>> cfg = transformers.GPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=8)
        >>> sd = translate_hf_state_dict_to_smdistributed(transformers.GPT2LMHeadModel(cfg).state_dict())
        >>> "transformer.seq_layers.0.attention.query.weight" in sd
        True
    """
    return FAMILIES[family_of_state_dict(state_dict, True, model_type)].to_smdistributed(state_dict)


def translate_state_dict_to_hf(state_dict: dict[str, Any], model_type: str | None = None,
                               max_seq_len: int | None = None) -> dict[str, Any]:
    """SMP v1's structure -> Hugging Face names, for any family in `FAMILIES`."""
    return FAMILIES[family_of_state_dict(state_dict, False, model_type)].to_hf(state_dict, max_seq_len)
