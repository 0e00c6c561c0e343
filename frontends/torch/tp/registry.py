"""Which module classes tensor parallelism can replace, and by what (``smp.tp_register``).

A `Registration` says how a marked module of a class becomes its distributed version: either a
``convert(module, **overrides)`` that keeps the module's weights (built in: ``nn.Linear`` ->
`DistributedLinear`, ``nn.Embedding`` -> `DistributedEmbedding`, the Hugging Face causal LMs
of `MODEL_FAMILIES` through `transform`, and GPT-2 / the BERT and RoBERTa encoders into SMP v1's
structure through `smp.torch.nn.huggingface`), or SMP v1's hooks: the distributed module is built
from the original constructor arguments through ``init_hook`` (fresh weights, as in SMP v1), its
calls are translated by ``forward_hook`` and its outputs by ``return_hook``.

Example:
    >>> class MyAttention(nn.Module):
    ...     def __init__(self, hidden: int, heads: int) -> None:
    ...         super().__init__()
    >>> from smp.torch.nn import DistributedAttentionLayer
    >>> tp_register_with_module(MyAttention, DistributedAttentionLayer,
    ...     init_hook=lambda hidden, heads: ((), {"num_attention_heads": heads,
    ...         "attention_head_size": hidden // heads, "hidden_size": hidden}))
    >>> registration_for(MyAttention(8, 2)).dist_module.__name__
    'DistributedAttentionLayer'
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from smp.torch.nn.basic import DistributedEmbedding, DistributedLinear
from torch import nn

__all__ = ["Registration", "REGISTRY", "tp_register", "tp_register_with_module", "registration_for",
           "HF_CAUSAL_LM_CLASSES", "HF_SMP_V1_CLASSES"]

M = TypeVar("M", bound=type)
InitHook = Callable[..., tuple[tuple[Any, ...], dict[str, Any]]]


@dataclass(frozen=True)
class Registration:
    """How one module class is distributed: a weight-keeping ``convert``, or SMP v1's hooks."""

    dist_module: Any
    init_hook: InitHook | None = None
    forward_hook: InitHook | None = None
    return_hook: Callable[[Any], Any] | None = None
    convert: Callable[..., nn.Module] | None = None


def _linear(module: nn.Linear, process_group: Any = None) -> nn.Module:
    return DistributedLinear.from_linear(module, process_group=process_group)


def _embedding(module: nn.Embedding, _skip_allgather: bool = False, process_group: Any = None) -> nn.Module:
    return DistributedEmbedding(module.num_embeddings, module.embedding_dim, padding_idx=module.padding_idx,
                                max_norm=module.max_norm, norm_type=module.norm_type,
                                scale_grad_by_freq=module.scale_grad_by_freq, sparse=module.sparse,
                                _weight=module.weight.detach(), _skip_allgather=_skip_allgather,
                                process_group=process_group)


def _hf(module: nn.Module, device: Any = None, dtype: Any = None, load_state_dict_from_rank0: bool = False,
        parallel_loss: bool = True, process_group: Any = None, gather_logits: bool = True,
        init_weights: bool = False) -> nn.Module:
    from .convert import transform

    return transform(module, device=device, dtype=dtype, load_state_dict_from_rank0=load_state_dict_from_rank0,
                     parallel_loss=parallel_loss, process_group=process_group, gather_logits=gather_logits,
                     init_weights=init_weights)


REGISTRY: dict[type, Registration] = {
    nn.Linear: Registration(DistributedLinear, convert=_linear),
    nn.Embedding: Registration(DistributedEmbedding, convert=_embedding),
}

# Marked, these become SMP v1's structure (smp.torch.nn.huggingface; docs/huggingface.md says why):
# class name -> (transformers module, smp.torch.nn.huggingface module, distributed module name).
HF_SMP_V1_CLASSES = {
    "GPT2LMHeadModel": ("transformers.models.gpt2.modeling_gpt2", "gpt2", "DistributedTransformerLMHead"),
    "BertEncoder": ("transformers.models.bert.modeling_bert", "bert", "DistributedTransformer"),
    "RobertaEncoder": ("transformers.models.roberta.modeling_roberta", "roberta", "DistributedTransformer"),
}
# Marked, these are converted by `transform`, keeping the Hugging Face structure.
HF_CAUSAL_LM_CLASSES = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "GPTNeoXForCausalLM",
                        "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM")


def _hf_registrations() -> dict[type, Registration]:
    """The Hugging Face models, when transformers is already imported (never imported here)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return {}
    classes = [getattr(transformers, name, None) for name in HF_CAUSAL_LM_CLASSES]
    out = {cls: Registration(_hf, convert=_hf) for cls in classes if cls is not None}
    import importlib

    from smp.torch.nn import huggingface

    for name, (module_name, family, dist_name) in HF_SMP_V1_CLASSES.items():
        try:
            cls = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):
            continue
        fam = getattr(huggingface, family)
        dist_module = getattr(importlib.import_module("smp.torch.nn"), dist_name)
        out[cls] = Registration(dist_module, convert=fam.convert)
    return out


def all_registrations() -> dict[type, Registration]:
    """Built-in, Hugging Face and user registrations (user ones win)."""
    return {**_hf_registrations(), **REGISTRY}


def registration_for(module: nn.Module) -> Registration | None:
    """The registration of ``module``'s exact class, or None when it is not supported."""
    return all_registrations().get(type(module))


def tp_register_with_module(module_cls: type, dist_module: Any, init_hook: InitHook | None = None,
                            forward_hook: InitHook | None = None,
                            return_hook: Callable[[Any], Any] | None = None) -> None:
    """Register ``dist_module`` as the TP replacement of ``module_cls`` (a class you cannot edit).

    ``init_hook`` / ``forward_hook`` take exactly the original ``__init__`` / ``forward``
    arguments (without self) and return ``(args, kwargs)`` for the distributed module;
    ``return_hook(output)`` turns its output back into what the original returned.
    """
    if not (isinstance(module_cls, type) and issubclass(module_cls, nn.Module)):
        raise TypeError(f"tp_register_with_module: module_cls={module_cls!r} must be an nn.Module subclass")
    REGISTRY[module_cls] = Registration(dist_module, init_hook, forward_hook, return_hook)


def tp_register(dist_module: Any, init_hook: InitHook | None = None, forward_hook: InitHook | None = None,
                return_hook: Callable[[Any], Any] | None = None) -> Callable[[M], M]:
    """Class decorator form of `tp_register_with_module` (SMP v1 ``@smp.tp_register``)."""

    def decorate(cls: M) -> M:
        tp_register_with_module(cls, dist_module, init_hook, forward_hook, return_hook)
        return cls

    return decorate
