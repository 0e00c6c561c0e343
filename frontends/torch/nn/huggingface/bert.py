"""Hugging Face BERT's encoder in SMP v1's structure: translate functions, hooks, the converted encoder.

SMP v1 replaced ``BertEncoder`` (not the embeddings, pooler or heads) by a `DistributedTransformer`
with post-LayerNorm layers. Names, for layer N under any prefix (``bert.`` in ``BertForMaskedLM``);
every other key is unchanged, and all weights keep their (out, in) layout::

    Hugging Face  <prefix>encoder.layer.N.          SMP v1  <prefix>encoder.seq_layers.N.
    attention.self.query / key / value                      attention.query / key / value
    attention.output.dense                                  attention.dense
    attention.output.LayerNorm                              attention.layernorm
    intermediate.dense                                      output.dense1
    output.dense                                            output.dense2
    output.LayerNorm                                        output.layernorm

RoBERTa's encoder has the same names (`smp.torch.nn.huggingface.roberta`).
"""

from __future__ import annotations

import inspect
import logging
import re
from typing import Any

import torch

from ..transformer import DistributedTransformer
from ._common import HFTranslationError, build_from_hf, check_max_seq_len, layer_index

__all__ = [
    "BertDistributedTransformer",
    "get_hf_bert_transformer_hooks",
    "translate_hf_state_dict_to_smdistributed",
    "translate_hf_state_dict_to_smdistributed_bert",
    "translate_state_dict_to_hf_bert",
]

logger = logging.getLogger("smp")

_HF_LAYER = re.compile(r"^(?P<prefix>(?:.*\.)?)encoder\.layer\.(?P<index>\d+)\.(?P<rest>.+)$")
_SMD_LAYER = re.compile(r"^(?P<prefix>(?:.*\.)?)encoder\.seq_layers\.(?P<index>\d+)\.(?P<rest>.+)$")
_LAYER = {"attention.self.query": "attention.query", "attention.self.key": "attention.key",
          "attention.self.value": "attention.value", "attention.output.dense": "attention.dense",
          "attention.output.LayerNorm": "attention.layernorm", "intermediate.dense": "output.dense1",
          "output.dense": "output.dense2", "output.LayerNorm": "output.layernorm"}
_LAYER_BACK = {v: k for k, v in _LAYER.items()}
_ACTIVATIONS = ("gelu", "relu")


def _translate(state_dict: dict[str, Any], pattern: re.Pattern[str], table: dict[str, str], middle: str,
               what: str) -> dict[str, Any]:
    if state_dict.get("_smp_is_partial"):
        raise HFTranslationError(f"{what}: this is a partial state dict (model.local_state_dict()); translate the "
                                 "full one (model.state_dict(), or a full checkpoint)")
    out: dict[str, Any] = {}
    unknown = []
    for key, value in state_dict.items():
        parsed = layer_index(pattern, key)
        if parsed is None:
            out[key] = value
            continue
        prefix, index, rest = parsed
        owner, _, leaf = rest.rpartition(".")
        if owner not in table:
            unknown.append(key)
            continue
        out[f"{prefix}encoder.{middle}.{index}.{table[owner]}.{leaf}"] = value
    if unknown:
        raise HFTranslationError(f"{what}: {len(unknown)} encoder key(s) have no counterpart, e.g. {unknown[:3]} "
                                 "(cross-attention layers are not supported). Fix: pass a BERT/RoBERTa encoder "
                                 "without cross-attention")
    return out


def translate_hf_state_dict_to_smdistributed_bert(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A Hugging Face BERT state dict -> SMP v1 names (only ``encoder.layer.N.*`` keys change).

    Example:
        >>> sd = {"bert.encoder.layer.0.attention.self.query.weight": torch.zeros(1), "cls.x": torch.ones(1)}
        >>> sorted(translate_hf_state_dict_to_smdistributed_bert(sd))
        ['bert.encoder.seq_layers.0.attention.query.weight', 'cls.x']
    """
    return _translate(state_dict, _HF_LAYER, _LAYER, "seq_layers", "translate_hf_state_dict_to_smdistributed_bert")


def translate_state_dict_to_hf_bert(state_dict: dict[str, Any], max_seq_len: int | None = None) -> dict[str, Any]:
    """SMP v1 names -> Hugging Face BERT names (only ``encoder.seq_layers.N.*`` keys change)."""
    check_max_seq_len(max_seq_len)
    return _translate(state_dict, _SMD_LAYER, _LAYER_BACK, "layer", "translate_state_dict_to_hf_bert")


def _config_problems(config: Any) -> list[str]:
    problems = []
    if config.hidden_size % config.num_attention_heads:
        problems.append(f"hidden_size={config.hidden_size} is not divisible by "
                        f"num_attention_heads={config.num_attention_heads}")
    if config.hidden_act not in _ACTIVATIONS:
        problems.append(f"hidden_act={config.hidden_act!r}: supported {list(_ACTIVATIONS)}")
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        problems.append("is_decoder / add_cross_attention: only the bidirectional encoder is supported")
    return problems


def hf_bert_transformer_init_hook(config: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``BertEncoder(config)`` -> the `DistributedTransformer` arguments (post-LayerNorm layers)."""
    problems = _config_problems(config)
    if problems:
        raise HFTranslationError(f"this {config.model_type} config does not fit SMP v1's DistributedTransformer:\n"
                                 + "\n".join(f"  - {p}" for p in problems)
                                 + "\nFix: change these config values, or leave the encoder undistributed")
    return (), {"num_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
                "attention_head_size": config.hidden_size // config.num_attention_heads,
                "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
                "attention_dropout_prob": config.attention_probs_dropout_prob,
                "hidden_dropout_prob": config.hidden_dropout_prob, "activation": config.hidden_act,
                "layernorm_epsilon": config.layer_norm_eps, "initializer_range": config.initializer_range,
                "use_normal_initialization": True, "pre_layernorm": False, "post_layernorm": True}


def _additive(mask: Any, dtype: torch.dtype) -> Any:
    """The encoder's attention mask as an additive float mask (transformers 5 passes a float or a
    boolean 4-D mask, or None when nothing is masked)."""
    if mask is None or mask.is_floating_point():
        return mask
    if mask.dtype == torch.bool:  # True = attend
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, -10000.0)
    raise HFTranslationError(f"attention_mask of dtype {mask.dtype}: expected a float (additive) or bool mask")


def hf_bert_transformer_forward_hook(hidden_states: torch.Tensor, attention_mask: Any = None,
                                     encoder_hidden_states: Any = None, encoder_attention_mask: Any = None,
                                     cache: Any = None, use_cache: Any = None, past_key_values: Any = None,
                                     **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``BertEncoder.forward`` arguments -> ``((hidden_states, additive_mask),)``."""
    if encoder_hidden_states is not None or cache is not None or past_key_values is not None or use_cache:
        raise HFTranslationError("the SMP v1 encoder takes no encoder_hidden_states, cache or use_cache=True")
    return ((hidden_states, _additive(attention_mask, hidden_states.dtype)),), {}


def hf_bert_transformer_return_hook(outputs: tuple[Any, ...]) -> Any:
    """``(hidden, mask)`` -> ``BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=hidden)``."""
    from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

    return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=outputs[0])


def get_hf_bert_transformer_hooks() -> tuple[Any, Any, Any]:
    """(init_hook, forward_hook, return_hook) for ``BertEncoder`` -> `DistributedTransformer` (SMP v1)."""
    return hf_bert_transformer_init_hook, hf_bert_transformer_forward_hook, hf_bert_transformer_return_hook


class BertDistributedTransformer(DistributedTransformer):
    """A Hugging Face BERT/RoBERTa encoder as SMP v1's `DistributedTransformer`, called like the encoder.

    Layers sit at ``encoder.seq_layers.N``; the call takes the encoder's arguments and returns its
    output type.
    """

    def __init__(self, config: Any, process_group: Any = None, **overrides: Any) -> None:
        _, kwargs = hf_bert_transformer_init_hook(config)
        params = inspect.signature(DistributedTransformer.__init__).parameters
        dropped = sorted(set(overrides) - set(params))
        if dropped:
            logger.info("tensor parallelism: %s encoder (SMP v1 structure) ignores %s", config.model_type, dropped)
        super().__init__(**{**kwargs, **{k: v for k, v in overrides.items() if k in params}},
                         process_group=process_group)
        self.config = config

    @classmethod
    def from_hf(cls, encoder: Any, process_group: Any = None, **overrides: Any) -> BertDistributedTransformer:
        """The converted encoder, holding its weights (each TP rank its slice; fresh when meta)."""
        def translated() -> dict[str, torch.Tensor]:
            full = {"encoder." + k: v for k, v in encoder.state_dict().items()}
            out = translate_hf_state_dict_to_smdistributed_bert(full)
            return {k[len("encoder."):]: v for k, v in out.items()}

        return build_from_hf(encoder, lambda: cls(encoder.config, process_group=process_group, **overrides),
                             translated, f"{encoder.config.model_type} encoder -> SMP v1 structure", process_group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if len(args) == 1 and isinstance(args[0], tuple) and not kwargs:
            return super().forward(args[0])
        (inputs,), _ = hf_bert_transformer_forward_hook(*args, **kwargs)
        return hf_bert_transformer_return_hook(super().forward(inputs))


def convert(module: Any, process_group: Any = None, **overrides: Any) -> BertDistributedTransformer:
    """The TP registry's conversion of a marked ``BertEncoder`` / ``RobertaEncoder``."""
    return BertDistributedTransformer.from_hf(module, process_group=process_group, **overrides)


def translate_hf_state_dict_to_smdistributed(state_dict: dict[str, Any], max_seq_len: int | None = None
                                             ) -> dict[str, Any]:
    """SMP v1's name of `translate_hf_state_dict_to_smdistributed_bert` in its releases of 2021-2022."""
    check_max_seq_len(max_seq_len)
    return translate_hf_state_dict_to_smdistributed_bert(state_dict)
