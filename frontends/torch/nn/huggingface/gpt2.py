"""Hugging Face GPT-2 in SMP v1's structure: translate functions, hooks, and the converted LM head.

The names on each side, for layer N (``H`` = ``n_embd``; Hugging Face's ``Conv1D`` stores the
weight as (in, out), an ``nn.Linear`` as (out, in), hence the transposes)::

    Hugging Face GPT2LMHeadModel                  SMP v1 DistributedTransformerLMHead
    transformer.wte.weight                        word_embedding.weight
    transformer.wpe.weight                        position_embedding.weight
    transformer.h.N.ln_1.*                        transformer.seq_layers.N.attention.pre_layernorm.*
    transformer.h.N.attn.c_attn.weight (H, 3H)    transformer.seq_layers.N.attention.{query,key,value}.weight
                                                  (columns 0:H, H:2H, 2H:3H, each transposed)
    transformer.h.N.attn.c_attn.bias (3H)         transformer.seq_layers.N.attention.{query,key,value}.bias
    transformer.h.N.attn.c_proj.*                 transformer.seq_layers.N.attention.dense.*      (weight^T)
    transformer.h.N.ln_2.*                        transformer.seq_layers.N.output.pre_layernorm.*
    transformer.h.N.mlp.c_fc.*                    transformer.seq_layers.N.output.dense1.*        (weight^T)
    transformer.h.N.mlp.c_proj.*                  transformer.seq_layers.N.output.dense2.*        (weight^T)
    transformer.ln_f.*                            layernorm.*
    lm_head.weight                                (tied to word_embedding.weight)

Under ``smp.tensor_parallelism()`` (or ``smp.model_creation(tensor_parallelism=True)`` /
``smp.set_tensor_parallelism``), ``smp.DistributedModel`` replaces a marked ``GPT2LMHeadModel`` by
`GPT2DistributedTransformerLMHead` holding the same weights in this structure, as SMP v1 did; see
docs/huggingface.md for which path a user gets.
"""

from __future__ import annotations

import inspect
import logging
import re
from typing import Any

import torch

from ..lm_head import DistributedTransformerLMHead
from ..params import full_state_dict
from ._common import (
    HFTranslationError,
    build_from_hf,
    check_max_seq_len,
    layer_index,
    reject_partial,
    unknown_keys_error,
)

__all__ = [
    "GPT2DistributedTransformerLMHead",
    "get_hf_gpt2_transformer_layer_hooks",
    "get_hf_gpt2_transformer_lm_head_hooks",
    "translate_hf_state_dict_to_smdistributed",
    "translate_hf_state_dict_to_smdistributed_gpt2",
    "translate_hf_state_dict_to_smdistributed_gpt2_layer",
    "translate_state_dict_to_hf_gpt2",
    "translate_state_dict_to_hf_gpt2_layer",
]

logger = logging.getLogger("smp")

_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
_HF_LAYER = re.compile(r"^(?P<prefix>(?:.*\.)?)h\.(?P<index>\d+)\.(?P<rest>.+)$")
_SMD_LAYER = re.compile(r"^(?P<prefix>(?:.*\.)?)seq_layers\.(?P<index>\d+)\.(?P<rest>.+)$")
_SMD_HOOKED = re.compile(r"^(?P<prefix>(?:.*\.)?)h\.(?P<index>\d+)\.(?:module\.)?(?P<rest>.+)$")
# one block, relative names: Hugging Face -> SMP v1 (the fused c_attn is handled apart)
_BLOCK = {"ln_1": "attention.pre_layernorm", "attn.c_proj": "attention.dense", "ln_2": "output.pre_layernorm",
          "mlp.c_fc": "output.dense1", "mlp.c_proj": "output.dense2"}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
_QKV = ("query", "key", "value")


# --- config -> SMP v1 arguments ----------------------------------------------------------------

def _config_problems(config: Any) -> list[str]:
    problems = []
    if config.n_embd % config.n_head:
        problems.append(f"n_embd={config.n_embd} is not divisible by n_head={config.n_head}")
    if config.activation_function not in _ACTIVATIONS:
        problems.append(f"activation_function={config.activation_function!r}: supported {sorted(_ACTIVATIONS)}")
    if not getattr(config, "scale_attn_weights", True):
        problems.append("scale_attn_weights=False: SMP v1's attention always scales by 1/sqrt(head size)")
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        problems.append("scale_attn_by_inverse_layer_idx=True is not supported")
    if getattr(config, "add_cross_attention", False):
        problems.append("add_cross_attention=True is not supported for GPT-2")
    if not getattr(config, "tie_word_embeddings", True):
        problems.append("tie_word_embeddings=False: SMP v1's LM head is tied to the word embedding")
    return problems


def _check(config: Any) -> None:
    problems = _config_problems(config)
    if problems:
        raise HFTranslationError("this GPT-2 config does not fit SMP v1's structure:\n" +
                                 "\n".join(f"  - {p}" for p in problems) +
                                 "\nFix: change these config values, or keep the Hugging Face structure with "
                                 "smp.transform(model)")


def _layer_kwargs(config: Any) -> dict[str, Any]:
    return {"num_attention_heads": config.n_head, "attention_head_size": config.n_embd // config.n_head,
            "hidden_size": config.n_embd,
            "intermediate_size": config.n_inner if config.n_inner is not None else 4 * config.n_embd,
            "attention_dropout_prob": config.attn_pdrop, "hidden_dropout_prob": config.resid_pdrop,
            "activation": _ACTIVATIONS[config.activation_function], "layernorm_epsilon": config.layer_norm_epsilon,
            "initializer_range": config.initializer_range, "use_normal_initialization": True,
            "causal_mask_size": config.n_positions, "pre_layernorm": True, "post_layernorm": False}


def hf_gpt2_transformer_lm_head_init_hook(config: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``GPT2LMHeadModel(config)`` -> the `DistributedTransformerLMHead` arguments."""
    _check(config)
    return (), {**_layer_kwargs(config), "num_layers": config.n_layer, "vocab_size": config.vocab_size,
                "num_positions": config.n_positions, "final_layernorm": True}


def _v1_mask(attention_mask: Any) -> Any:
    """Hugging Face's [N, S] mask (1 = attend) as SMP v1's (1 = masked)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise HFTranslationError(f"attention_mask of shape {tuple(attention_mask.shape)}: the SMP v1 GPT-2 "
                                 "structure takes the [batch, seq] padding mask (1 = attend)")
    return (attention_mask == 0).to(torch.long if attention_mask.dtype == torch.bool else attention_mask.dtype)


def hf_gpt2_transformer_lm_head_forward_hook(input_ids: Any = None, past_key_values: Any = None,
                                             attention_mask: Any = None, token_type_ids: Any = None,
                                             position_ids: Any = None, inputs_embeds: Any = None,
                                             labels: Any = None, use_cache: Any = None,
                                             output_attentions: Any = None, output_hidden_states: Any = None,
                                             return_dict: Any = None, **kwargs: Any
                                             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``GPT2LMHeadModel.forward`` arguments -> ``((input_ids, mask, None, position_ids, labels),)``."""
    unsupported = {"past_key_values": past_key_values, "token_type_ids": token_type_ids,
                   "inputs_embeds": inputs_embeds, "use_cache": use_cache, "output_attentions": output_attentions,
                   "output_hidden_states": output_hidden_states,
                   **{k: v for k, v in kwargs.items() if k not in ("cache_position", "logits_to_keep")}}
    given = sorted(k for k, v in unsupported.items() if v not in (None, False))
    if given:
        raise HFTranslationError(f"GPT-2 in SMP v1's structure does not take {given}. Fix: pass input_ids, "
                                 "attention_mask, position_ids and labels only, or keep the Hugging Face "
                                 "structure with smp.transform(model)")
    if return_dict is False:
        raise HFTranslationError("return_dict=False is not supported (SMP v1 returns a CausalLMOutput)")
    if input_ids is None:
        raise HFTranslationError("input_ids is required")
    return ((input_ids, _v1_mask(attention_mask), None, position_ids, labels),), {}


def hf_gpt2_transformer_lm_head_return_hook(outputs: tuple[torch.Tensor, ...]) -> Any:
    """``(loss, logits)`` or ``(logits,)`` -> a ``CausalLMOutputWithCrossAttentions``."""
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

    return CausalLMOutputWithCrossAttentions(loss=outputs[0] if len(outputs) == 2 else None, logits=outputs[-1])


def get_hf_gpt2_transformer_lm_head_hooks() -> tuple[Any, Any, Any]:
    """(init_hook, forward_hook, return_hook) for ``GPT2LMHeadModel`` -> `DistributedTransformerLMHead`.

    Example:
        >>> import smp.torch as smp, transformers
        >>> smp.tp_register_with_module(transformers.GPT2LMHeadModel, smp.nn.DistributedTransformerLMHead,
        ...                             *get_hf_gpt2_transformer_lm_head_hooks())  # doctest: +SKIP
    """
    return (hf_gpt2_transformer_lm_head_init_hook, hf_gpt2_transformer_lm_head_forward_hook,
            hf_gpt2_transformer_lm_head_return_hook)


def hf_gpt2_transformer_layer_init_hook(config: Any, layer_idx: Any = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``GPT2Block(config, layer_idx)`` -> the `DistributedTransformerLayer` arguments."""
    _check(config)
    return (), _layer_kwargs(config)


def hf_gpt2_transformer_layer_forward_hook(hidden_states: torch.Tensor, cache: Any = None, attention_mask: Any = None,
                                           encoder_hidden_states: Any = None, encoder_attention_mask: Any = None,
                                           use_cache: Any = False, **kwargs: Any
                                           ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``GPT2Block.forward`` arguments -> ``((hidden_states, additive_mask),)`` (the layer adds causality)."""
    if encoder_hidden_states is not None or use_cache:
        raise HFTranslationError("GPT2Block as DistributedTransformerLayer: cross-attention and use_cache=True "
                                 "are not supported. Fix: use_cache=False")
    mask = attention_mask
    if mask is not None and mask.dtype == torch.bool:  # True = attend
        mask = torch.zeros(mask.shape, dtype=hidden_states.dtype, device=mask.device).masked_fill(~mask, -10000.0)
    return ((hidden_states, mask),), {}


def hf_gpt2_transformer_layer_return_hook(outputs: tuple[Any, ...]) -> torch.Tensor:
    """``(hidden, mask)`` -> ``hidden`` (what a transformers 5 ``GPT2Block`` returns)."""
    return outputs[0]  # type: ignore[no-any-return]


def get_hf_gpt2_transformer_layer_hooks() -> tuple[Any, Any, Any]:
    """(init_hook, forward_hook, return_hook) for ``GPT2Block`` -> `DistributedTransformerLayer` (SMP v1).

    Example (fresh weights, as in SMP v1; ``translate_hf_state_dict_to_smdistributed_gpt2_layer``
    maps a Hugging Face checkpoint onto the layers)::

        smp.tp_register_with_module(GPT2Block, smp.nn.DistributedTransformerLayer,
                                    *get_hf_gpt2_transformer_layer_hooks())
        smp.set_tensor_parallelism(model.transformer.h, True)
    """
    return (hf_gpt2_transformer_layer_init_hook, hf_gpt2_transformer_layer_forward_hook,
            hf_gpt2_transformer_layer_return_hook)


# --- state dicts -------------------------------------------------------------------------------

def _block_to_smd(rest: str, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
    owner, _, leaf = rest.rpartition(".")
    if owner == "attn.c_attn":
        parts = value.chunk(3, dim=-1)
        return {f"attention.{n}.{leaf}": (p.t() if leaf == "weight" else p).contiguous() for n, p in zip(_QKV, parts)}
    if owner in _BLOCK:
        out = value.t().contiguous() if leaf == "weight" and owner not in ("ln_1", "ln_2") else value
        return {f"{_BLOCK[owner]}.{leaf}": out}
    return None


def _blocks_to_smd(state_dict: dict[str, Any], pattern: re.Pattern[str], new_prefix: Any,
                   what: str) -> tuple[dict[str, Any], list[str]]:
    """Translate every ``<prefix>h.N.<block key>``; returns (translated, keys that did not match)."""
    out: dict[str, Any] = {}
    left: list[str] = []
    for key, value in state_dict.items():
        parsed = layer_index(pattern, key)
        pieces = _block_to_smd(parsed[2], value) if parsed else None
        if parsed is None or pieces is None:
            left.append(key)
            continue
        prefix = new_prefix(parsed[0])
        if prefix is None:
            left.append(key)
            continue
        out.update({f"{prefix}{parsed[1]}.{k}": v for k, v in pieces.items()})
    return out, left


def _blocks_to_hf(state_dict: dict[str, Any], pattern: re.Pattern[str], new_prefix: Any,
                  what: str) -> tuple[dict[str, Any], list[str]]:
    out: dict[str, Any] = {}
    left: list[str] = []
    qkv: dict[tuple[str, int, str], dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        parsed = layer_index(pattern, key)
        if parsed is None:
            left.append(key)
            continue
        prefix, index, rest = parsed
        owner, _, leaf = rest.rpartition(".")
        head = f"{new_prefix(prefix)}{index}."
        if owner.startswith("attention.") and owner.split(".", 1)[1] in _QKV:
            qkv.setdefault((head, index, leaf), {})[owner.split(".", 1)[1]] = value
        elif owner in _BLOCK_BACK:
            back = _BLOCK_BACK[owner]
            out[f"{head}{back}.{leaf}"] = value.t().contiguous() if leaf == "weight" and back not in ("ln_1", "ln_2") \
                else value
        else:
            left.append(key)
    for (head, _, leaf), parts in qkv.items():
        if set(parts) != set(_QKV):
            raise HFTranslationError(f"{what}: {head}attention has {sorted(parts)} {leaf} but needs query, key "
                                     "and value together (they form GPT-2's fused c_attn)")
        cols = [parts[n].t() if leaf == "weight" else parts[n] for n in _QKV]
        out[f"{head}attn.c_attn.{leaf}"] = torch.cat(cols, dim=-1).contiguous()
    return out, left


def translate_hf_state_dict_to_smdistributed_gpt2(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A Hugging Face ``GPT2LMHeadModel`` state dict -> SMP v1's `DistributedTransformerLMHead` names.

    Load the result into the converted model with ``model.load_state_dict(...)`` (full tensors;
    each TP rank keeps its slice).

    Raises:
        HFTranslationError: keys of another model, or an untied ``lm_head.weight``.
    """
    what = "translate_hf_state_dict_to_smdistributed_gpt2"
    reject_partial(state_dict, what)
    out, left = _blocks_to_smd(state_dict, _HF_LAYER, lambda p: "transformer.seq_layers." if p == "transformer."
                               else None, what)
    unknown = []
    for key in left:
        value = state_dict[key]
        if key.startswith("transformer.wte."):
            out["word_embedding." + key[len("transformer.wte."):]] = value
        elif key.startswith("transformer.wpe."):
            out["position_embedding." + key[len("transformer.wpe."):]] = value
        elif key.startswith("transformer.ln_f."):
            out["layernorm." + key[len("transformer.ln_f."):]] = value
        elif key == "lm_head.weight":
            wte = state_dict.get("transformer.wte.weight")
            if wte is None or not (value is wte or torch.equal(value, wte)):
                raise HFTranslationError(f"{what}: lm_head.weight differs from transformer.wte.weight; SMP v1's "
                                         "LM head is tied to the word embedding. Fix: tie them "
                                         "(tie_word_embeddings=True), or use smp.transform(model)")
        elif key.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # transformers 4.x causal-mask buffers: recomputed by the distributed layers
        else:
            unknown.append(key)
    if unknown:
        raise unknown_keys_error("gpt2", what, unknown, "Hugging Face GPT2LMHeadModel keys")
    return out


def translate_state_dict_to_hf_gpt2(state_dict: dict[str, Any], max_seq_len: int | None = None) -> dict[str, Any]:
    """SMP v1's `DistributedTransformerLMHead` state dict -> Hugging Face ``GPT2LMHeadModel`` names.

    ``max_seq_len`` is SMP v1's argument for the ``attn.bias`` buffers of transformers 4.x; the
    state dicts of transformers 5 have none, so it is only checked. ``lm_head.weight`` is the same
    tensor as ``transformer.wte.weight`` (tied).

    Example:
        >>> import transformers
        >>> cfg = transformers.GPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=8)
        >>> hf = transformers.GPT2LMHeadModel(cfg)
        >>> smd = translate_hf_state_dict_to_smdistributed_gpt2(hf.state_dict())
        >>> back = translate_state_dict_to_hf_gpt2(smd)
        >>> sorted(back) == sorted(hf.state_dict()) and all(torch.equal(back[k], v) for k, v in hf.state_dict().items())
        True
    """
    what = "translate_state_dict_to_hf_gpt2"
    check_max_seq_len(max_seq_len)
    reject_partial(state_dict, what)
    out, left = _blocks_to_hf(state_dict, _SMD_LAYER, lambda p: "transformer.h.", what)
    unknown = []
    for key in left:
        value = state_dict[key]
        if key.startswith("word_embedding."):
            out["transformer.wte." + key[len("word_embedding."):]] = value
        elif key.startswith("position_embedding."):
            out["transformer.wpe." + key[len("position_embedding."):]] = value
        elif key.startswith("layernorm."):
            out["transformer.ln_f." + key[len("layernorm."):]] = value
        else:
            unknown.append(key)
    if unknown:
        raise unknown_keys_error("gpt2", what, unknown, "SMP v1 DistributedTransformerLMHead keys")
    if "transformer.wte.weight" in out:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def translate_hf_state_dict_to_smdistributed_gpt2_layer(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Translate the ``h.N.*`` blocks of a Hugging Face GPT-2 state dict to `DistributedTransformerLayer`
    names (``h.N.attention.query.weight``, ...); every other key is kept as it is.

    For a model whose ``GPT2Block`` s were replaced through `get_hf_gpt2_transformer_layer_hooks`
    (the layer sits at ``h.N`` itself, as in SMP v1; `translate_state_dict_to_hf_gpt2_layer` also
    accepts the ``h.N.module.*`` keys of earlier smp versions).
    """
    what = "translate_hf_state_dict_to_smdistributed_gpt2_layer"
    reject_partial(state_dict, what)
    out, left = _blocks_to_smd(state_dict, _HF_LAYER, lambda p: f"{p}h.", what)
    out.update({k: state_dict[k] for k in left if not k.endswith((".attn.bias", ".attn.masked_bias"))})
    return out


def translate_state_dict_to_hf_gpt2_layer(state_dict: dict[str, Any], max_seq_len: int | None = None
                                          ) -> dict[str, Any]:
    """The inverse of `translate_hf_state_dict_to_smdistributed_gpt2_layer` (``h.N.module.*`` too)."""
    what = "translate_state_dict_to_hf_gpt2_layer"
    check_max_seq_len(max_seq_len)
    reject_partial(state_dict, what)
    out, left = _blocks_to_hf(state_dict, _SMD_HOOKED, lambda p: f"{p}h.", what)
    out.update({k: state_dict[k] for k in left})
    if "transformer.wte.weight" in out and "lm_head.weight" not in out:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


# --- the converted model -----------------------------------------------------------------------

def _accepted_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """SMP v1 performance knobs (fused_softmax, attention_in_fp32, ...) do not change the numbers."""
    params = inspect.signature(DistributedTransformerLMHead.__init__).parameters
    dropped = sorted(set(overrides) - set(params))
    if dropped:
        logger.info("tensor parallelism: GPT-2 (SMP v1 structure) ignores %s", dropped)
    return {k: v for k, v in overrides.items() if k in params}


class GPT2DistributedTransformerLMHead(DistributedTransformerLMHead):
    """A Hugging Face GPT-2 as SMP v1's `DistributedTransformerLMHead`, called like the HF model.

    ``model(input_ids=..., attention_mask=..., labels=...)`` returns a
    ``CausalLMOutputWithCrossAttentions`` (``loss``, full ``logits``); the layers sit at
    ``transformer.seq_layers.N`` as SMP v1 scripts expect, and ``config`` / `save_pretrained`
    keep it a Hugging Face citizen (``save_pretrained`` writes plain GPT-2 safetensors).

    Example:
        >>> import transformers
        >>> cfg = transformers.GPT2Config(vocab_size=16, n_embd=8, n_layer=2, n_head=2, n_positions=8)
        >>> lm = GPT2DistributedTransformerLMHead.from_hf(transformers.GPT2LMHeadModel(cfg))
        >>> len(lm.transformer.seq_layers), tuple(lm(input_ids=torch.tensor([[1, 2, 3]])).logits.shape)
        (2, (1, 3, 16))
    """

    def __init__(self, config: Any, process_group: Any = None, **overrides: Any) -> None:
        _, kwargs = hf_gpt2_transformer_lm_head_init_hook(config)
        super().__init__(**{**kwargs, **_accepted_overrides(overrides)}, process_group=process_group)
        self.embedding_dropout.p = config.embd_pdrop  # SMP v1's embedding_dropout_prob
        self.config = config

    @classmethod
    def from_hf(cls, model: Any, process_group: Any = None, **overrides: Any) -> GPT2DistributedTransformerLMHead:
        """The converted ``GPT2LMHeadModel``, holding its weights (each TP rank its slice).

        A model whose parameters are still on the meta device (delayed initialisation) gives a
        freshly initialised one (SMP v1 did so for every model; see `build_from_hf`).
        """
        return build_from_hf(model, lambda: cls(model.config, process_group=process_group, **overrides),
                             lambda: translate_hf_state_dict_to_smdistributed_gpt2(_tied_state(model)),
                             "GPT-2 -> SMP v1 structure", process_group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if len(args) == 1 and isinstance(args[0], tuple) and not kwargs:
            return super().forward(args[0])  # SMP v1's own tuple call
        (inputs,), _ = hf_gpt2_transformer_lm_head_forward_hook(*args, **kwargs)
        return hf_gpt2_transformer_lm_head_return_hook(super().forward(inputs))

    def save_pretrained(self, path: str, state_dict: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """Write a plain Hugging Face GPT-2 checkpoint (``GPT2LMHeadModel.from_pretrained`` loads it).

        ``state_dict`` is a full state dict in this structure (``smp.DistributedModel.save_pretrained``
        passes the gathered one); without it the TP shards are gathered here (a collective).
        """
        import transformers

        full = state_dict if state_dict is not None else full_state_dict(self, self.group)
        hf_state = translate_state_dict_to_hf_gpt2(full)
        with torch.device("meta"):
            shell = transformers.GPT2LMHeadModel(self.config)
        shell.save_pretrained(path, state_dict=hf_state, **kwargs)


def _tied_state(model: Any) -> dict[str, Any]:
    """``model``'s state dict with the LM head tied to the word embedding, as SMP v1's structure has it.

    The config asks for tied weights (`_check`), so a head that differs was untied behind the config's
    back; it takes the embedding's weights, and the user is told.
    """
    state = model.state_dict()
    head, wte = state.get("lm_head.weight"), state.get("transformer.wte.weight")
    if head is not None and wte is not None and head is not wte and not torch.equal(head, wte):
        logger.warning("GPT-2 -> SMP v1 structure: lm_head.weight differs from transformer.wte.weight although the "
                       "config ties them (tie_word_embeddings=True); the LM head takes the word embedding's weights")
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    return state


def convert(module: Any, process_group: Any = None, **overrides: Any) -> GPT2DistributedTransformerLMHead:
    """The TP registry's conversion of a marked ``GPT2LMHeadModel`` (`smp.torch.tp.registry`)."""
    return GPT2DistributedTransformerLMHead.from_hf(module, process_group=process_group, **overrides)


def translate_hf_state_dict_to_smdistributed(state_dict: dict[str, Any], max_seq_len: int | None = None
                                             ) -> dict[str, Any]:
    """SMP v1's name of `translate_hf_state_dict_to_smdistributed_gpt2` in its releases of 2021-2022,
    called ``(state_dict, max_seq_len)`` (``max_seq_len`` rebuilt transformers 4.x mask buffers: checked only)."""
    check_max_seq_len(max_seq_len)
    return translate_hf_state_dict_to_smdistributed_gpt2(state_dict)
