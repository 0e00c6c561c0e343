"""Hugging Face RoBERTa's encoder in SMP v1's structure: the same names and layers as BERT's.

``RobertaEncoder`` -> `DistributedTransformer`, with `smp.torch.nn.huggingface.bert`'s name table
(``roberta.encoder.layer.N.*`` <-> ``roberta.encoder.seq_layers.N.*``); the embeddings (with their
padding-offset positions), pooler and heads stay Hugging Face modules.
"""

from __future__ import annotations

from typing import Any

from ._common import check_max_seq_len
from .bert import (
    BertDistributedTransformer,
    convert,
    hf_bert_transformer_forward_hook,
    hf_bert_transformer_init_hook,
    hf_bert_transformer_return_hook,
    translate_hf_state_dict_to_smdistributed_bert,
    translate_state_dict_to_hf_bert,
)

__all__ = [
    "RobertaDistributedTransformer",
    "convert",
    "get_hf_roberta_transformer_hooks",
    "hf_roberta_transformer_forward_hook",
    "hf_roberta_transformer_init_hook",
    "hf_roberta_transformer_return_hook",
    "translate_hf_state_dict_to_smdistributed",
    "translate_hf_state_dict_to_smdistributed_roberta",
    "translate_state_dict_to_hf_roberta",
]

RobertaDistributedTransformer = BertDistributedTransformer


def translate_hf_state_dict_to_smdistributed_roberta(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A Hugging Face RoBERTa state dict -> SMP v1 names (only ``encoder.layer.N.*`` keys change)."""
    return translate_hf_state_dict_to_smdistributed_bert(state_dict)


def translate_state_dict_to_hf_roberta(state_dict: dict[str, Any], max_seq_len: int | None = None) -> dict[str, Any]:
    """SMP v1 names -> Hugging Face RoBERTa names (only ``encoder.seq_layers.N.*`` keys change)."""
    return translate_state_dict_to_hf_bert(state_dict, max_seq_len)


def get_hf_roberta_transformer_hooks() -> tuple[Any, Any, Any]:
    """(init_hook, forward_hook, return_hook) for ``RobertaEncoder`` -> `DistributedTransformer` (SMP v1)."""
    return hf_bert_transformer_init_hook, hf_bert_transformer_forward_hook, hf_bert_transformer_return_hook


def translate_hf_state_dict_to_smdistributed(state_dict: dict[str, Any], max_seq_len: int | None = None
                                             ) -> dict[str, Any]:
    """SMP v1's name of `translate_hf_state_dict_to_smdistributed_roberta` in its releases of 2021-2022."""
    check_max_seq_len(max_seq_len)
    return translate_hf_state_dict_to_smdistributed_roberta(state_dict)


# SMP v1's RoBERTa module named the encoder hooks after RoBERTa; they are BERT's.
hf_roberta_transformer_init_hook = hf_bert_transformer_init_hook
hf_roberta_transformer_forward_hook = hf_bert_transformer_forward_hook
hf_roberta_transformer_return_hook = hf_bert_transformer_return_hook
