"""The forward and return hooks GPT-J and GPT-NeoX share: a Hugging Face causal-LM call <-> SMP v1's tuple.

``model(input_ids=..., attention_mask=..., labels=...)`` becomes
``((input_ids, v1_mask, None, position_ids, labels),)`` for `DistributedTransformerLMHead`, whose
``(loss, logits)`` / ``(logits,)`` come back as a ``CausalLMOutputWithPast``. Everything a
training step does not use (a KV cache, ``inputs_embeds``, ``logits_to_keep``) is refused by name.
"""

from __future__ import annotations

from typing import Any

import torch

from ._common import HFTranslationError

__all__ = ["causal_lm_inputs", "causal_lm_output", "config_activation"]

# Hugging Face activation name -> smp.torch.nn.transformer.ACTIVATIONS (the same function)
_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
# accepted when left at these values (transformers passes some of them itself)
_IGNORED = {"cache_position": None, "return_dict": True, "output_attentions": False, "output_hidden_states": False}


def config_activation(name: str, problems: list[str], key: str) -> str:
    """The smp activation for Hugging Face's ``name``; an unknown one is added to ``problems``."""
    if name not in _ACTIVATIONS:
        problems.append(f"{key}={name!r}: supported {sorted(_ACTIVATIONS)}")
        return "gelu"
    return _ACTIVATIONS[name]


def _v1_mask(attention_mask: Any, family: str) -> Any:
    """Hugging Face's [N, S] padding mask (1 = attend) as SMP v1's (1 = masked)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise HFTranslationError(f"attention_mask of shape {tuple(attention_mask.shape)}: {family} in SMP v1's "
                                 "structure takes the [batch, seq] padding mask (1 = attend)")
    return (attention_mask == 0).to(torch.long if attention_mask.dtype == torch.bool else attention_mask.dtype)


def causal_lm_inputs(family: str, input_ids: Any, attention_mask: Any, position_ids: Any, labels: Any,
                     unsupported: dict[str, Any], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The forward hook's result; ``unsupported`` / ``kwargs`` must be unset (None, False, 0 or absent).

    Raises:
        HFTranslationError: an unsupported argument is set, or ``input_ids`` is missing.
    """
    given = sorted(k for k, v in unsupported.items() if v is not None and v is not False and not
                   (isinstance(v, int) and not isinstance(v, bool) and v == 0))
    given += sorted(k for k, v in kwargs.items() if k not in _IGNORED or v not in (None, _IGNORED[k]))
    if given:
        raise HFTranslationError(f"{family} in SMP v1's structure does not take {given}. Fix: pass input_ids, "
                                 "attention_mask and labels only (use_cache=False), or keep the Hugging Face "
                                 "structure (unregister the hooks)")
    if input_ids is None:
        raise HFTranslationError(f"{family} in SMP v1's structure: input_ids is required")
    return ((input_ids, _v1_mask(attention_mask, family), None, position_ids, labels),), {}


def causal_lm_output(outputs: tuple[torch.Tensor, ...]) -> Any:
    """``(loss, logits)`` or ``(logits,)`` -> a ``CausalLMOutputWithPast`` (SMP v1's return hook)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(loss=outputs[0] if len(outputs) == 2 else None, logits=outputs[-1])
