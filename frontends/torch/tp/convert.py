"""`transform`: turn a Hugging Face causal LM into its tensor-parallel version, keeping its weights.

SMP v2's ``tsm.transform(model)`` for smp. Every TP rank calls it on the same model (same weights:
built from the same seed, or loaded with ``from_pretrained``; or rank 0's, with
``load_state_dict_from_rank0=True``). Each rank replaces, in place, the modules named by
``config.base_model_tp_plan`` with their TP versions holding its slice of the *original*
weights, splits the input embedding and the LM head by vocabulary, and installs a loss that works
on the vocabulary-sharded logits without gathering them. Parameter names do not change.

With tp = 2, a Llama layer becomes::

    self_attn.q_proj/k_proj/v_proj  column-parallel   heads and key/value heads split in two
    self_attn.o_proj                row-parallel      one allreduce
    mlp.gate_proj/up_proj           column-parallel   intermediate_size split in two
    mlp.down_proj                   row-parallel      one allreduce
    embed_tokens, lm_head           vocabulary split  logits [B, S, vocab / 2] per rank
"""

from __future__ import annotations

import re
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as dist
from smp.torch.engine.refs import on_owner
from smp.torch.nn.embedding import VocabParallelEmbedding
from smp.torch.nn.group import TPShardingError, group_size, resolve_group
from smp.torch.nn.linear import ColumnParallelLinear
from smp.torch.nn.mappings import gather_from_tp
from smp.torch.nn.rng import tp_rng
from smp.torch.nn.te_backend import swap_to_te
from torch import nn

from .loss import causal_lm_loss
from .models import check_config, family_for
from .styles import apply_style

__all__ = ["transform"]


def _targets(root: nn.Module, pattern: str) -> list[tuple[nn.Module, str]]:
    """(owner, attr) pairs under ``root`` matching a plan path (``*`` is a layer index)."""
    owner_pat, _, attr = pattern.rpartition(".")
    regex = re.compile("^" + re.escape(owner_pat).replace(r"\*", r"\d+") + "$")
    return [(m, attr) for name, m in root.named_modules() if regex.match(name) and hasattr(m, attr)]


def _sync_from_rank0(model: nn.Module) -> None:
    """Give every rank rank 0's parameters and buffers (meta tensors elsewhere are allocated first)."""
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        model.to_empty(device="cpu")
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)


def _enter_tp_rng(module: nn.Module, args: Any) -> None:
    stack = ExitStack()
    stack.enter_context(tp_rng())
    module._smp_tp_rng = stack


def _leave_tp_rng(module: nn.Module, args: Any, output: Any) -> None:
    stack = module.__dict__.pop("_smp_tp_rng", None)
    if stack is not None:
        stack.close()


def _gather_logits(group: Any) -> Callable[..., Any]:
    def hook(_module: nn.Module, _args: Any, out: Any) -> Any:
        logits = out.get("logits") if isinstance(out, dict) else None
        if isinstance(logits, torch.Tensor):  # with smp's TP group, where the logits are kept (on_owner)
            out["logits"] = (on_owner(_gather_vocabulary, logits) if group is resolve_group(None)
                             else gather_from_tp(logits, group, dim=-1))
        return out

    return hook


def _gather_vocabulary(logits: torch.Tensor) -> torch.Tensor:
    return gather_from_tp(logits, resolve_group(None), dim=-1)


def _fresh_weights(model: nn.Module) -> None:
    """Re-run the Hugging Face initialisation on every module with a seed every rank shares."""
    from smp.torch.nn.rng import _config_seed

    if not callable(getattr(model, "init_weights", None)):
        raise ValueError(f"transform(init_weights=True): {type(model).__name__} has no init_weights(); pass a "
                         "Hugging Face PreTrainedModel")
    for module in model.modules():
        if hasattr(module, "_is_hf_initialized"):  # transformers skips modules it already initialised
            module._is_hf_initialized = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_config_seed())
        with torch.no_grad():
            model.init_weights()  # type: ignore[operator]


def _vocab_parallel(embed: nn.Embedding, group: Any) -> nn.Module:
    """The vocabulary-parallel version of a Hugging Face input embedding, keeping a scaled
    embedding's factor (Gemma's ``GemmaTextScaledWordEmbedding``: output * embed_scale)."""
    new = VocabParallelEmbedding.from_embedding(embed, process_group=group)
    if type(embed) is nn.Embedding:
        return new
    scale = getattr(embed, "embed_scale", None)
    if not isinstance(scale, torch.Tensor):
        raise ValueError(f"{type(embed).__name__} (the input embedding) overrides nn.Embedding in a way smp "
                         "cannot reproduce after splitting it by vocabulary. Fix: mark your own modules with "
                         "smp.torch.nn layers instead of transform")
    new.register_buffer("embed_scale", scale.detach().clone(), persistent=False)
    new.register_forward_hook(lambda m, _args, out: out * m.embed_scale.to(out.dtype))
    return new


def transform(model: nn.Module, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
              config: Any = None, load_state_dict_from_rank0: bool = False, cp_comm_type: str = "p2p",
              parallel_loss: bool = True, process_group: Any = None, init_weights: bool = False,
              gather_logits: bool = True) -> nn.Module:
    """Convert a supported Hugging Face causal LM for TP, in place: GPT-NeoX, Llama, Mistral, Mixtral,
    GPT-2, and models whose ``base_model_tp_plan`` uses only implemented styles (Qwen2/3, Gemma, GPT-J).

    Args:
        model: a ``*ForCausalLM`` from transformers 5.x, identical on every TP rank (or on rank 0
            only, with ``load_state_dict_from_rank0``).
        device: move the converted model there. On a CUDA device with Transformer Engine
            importable, the column/row-parallel linears then become ``te.Linear`` modules holding
            the same shards (`smp.torch.nn.te_backend`; ``SMP_DISABLE_TE=1`` keeps the fallback).
        dtype: cast the model to this dtype before converting.
        config: SMP v2's extra config (e.g. ``MoEConfig``); only None is supported.
        init_weights: re-initialise the weights (SMP v2's default) instead of keeping the
            original ones: the model's own Hugging Face initialisation, run on the full tensors
            with a generator seeded from ``random_seed`` (else ``tensor_parallel_seed``), so
            every TP rank slices the same model; the caller's random state is left untouched.
        load_state_dict_from_rank0: broadcast rank 0's weights first; other ranks may hold
            different or meta-device weights.
        cp_comm_type: SMP v2 context-parallel argument; accepted, context parallelism is not
            implemented.
        parallel_loss: compute the loss with `smp.torch.nn.parallel_cross_entropy` on this rank's
            vocabulary slice of the logits (default), so no rank holds the full softmax. False
            gathers the logits first and keeps Hugging Face's loss.
        process_group: the TP group (default: smp's TP group).
        gather_logits: with ``parallel_loss``, return the full logits (default, as the dense model
            and SMP v1 do: an allgather per forward). False returns this rank's ``vocab / tp`` slice
            (``smp.torch.nn.gather_from_tp(logits, group)`` gives the full logits) and saves that
            memory when only the loss is used. With per-rank batches (``prescaled_batch: False``)
            the sliced logits' rows are the rank's own samples.

    Returns:
        ``model``, converted.

    Raises:
        TPShardingError: listing every size that does not split (heads, key/value heads,
            intermediate size, vocabulary).
        ValueError: an unsupported ``model_type``.

    Example:
        >>> import transformers
        >>> cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
        >>> model = transform(transformers.LlamaForCausalLM(cfg))
        >>> type(model.model.layers[0].self_attn.q_proj).__name__
        'ColumnParallelLinear'
    """
    if getattr(model, "_smp_tp_transformed", False):
        raise ValueError(f"{type(model).__name__} was already converted by smp.torch.transform; convert the "
                         "original model once")
    if config is not None:
        raise ValueError(f"transform(config={config!r}): SMP v2 MoE/extra configs are not supported; pass None")
    hf_config = model.config
    group = resolve_group(process_group)
    tp = group_size(group)
    problems = check_config(hf_config, tp)
    if problems:
        raise TPShardingError(f"{type(model).__name__} cannot be split over tensor_parallel_degree={tp}:\n"
                              + "\n".join(f"  - {p}" for p in problems)
                              + "\nFix: choose a tensor_parallel_degree that divides these sizes.")
    family = family_for(hf_config)
    if init_weights:
        _fresh_weights(model)
    elif load_state_dict_from_rank0:
        _sync_from_rank0(model)
    if dtype is not None:
        model.to(dtype)
    embed = model.get_input_embeddings()  # type: ignore[operator]
    head = model.get_output_embeddings()  # type: ignore[operator]
    tied = head is not None and head.weight is embed.weight
    base = model.base_model  # type: ignore[union-attr]
    for pattern, style in (dict(family.plan) or getattr(hf_config, "base_model_tp_plan", None) or {}).items():
        for owner, attr in _targets(base, pattern):
            apply_style(style, owner, attr, group)
    if isinstance(embed, nn.Embedding):
        model.set_input_embeddings(_vocab_parallel(embed, group))  # type: ignore[operator]
    new_embed = model.get_input_embeddings()  # type: ignore[operator]
    if isinstance(head, nn.Linear):
        new_head = ColumnParallelLinear.from_linear(head, gather_output=not parallel_loss, process_group=group)
        if tied:
            new_head.weight = new_embed.weight
        model.set_output_embeddings(new_head)  # type: ignore[operator]
        if parallel_loss:
            model.loss_function = causal_lm_loss(group)
            if gather_logits:
                # The loss above works on this rank's vocabulary slice; the caller gets the full
                # logits, as from the dense model (and from SMP v1).
                model.register_forward_hook(_gather_logits(group))
    for owner, attr in _targets(base, family.attention):
        # Attention-probability dropout acts on this rank's heads: draw it from the TP-region
        # generator (always_call restores the default generator even when forward raises).
        attention = getattr(owner, attr)
        if family.local_heads:
            for count in ("num_heads", "num_attention_heads", "num_key_value_heads"):
                if isinstance(getattr(attention, count, None), int):
                    setattr(attention, count, getattr(attention, count) // tp)
        attention.register_forward_pre_hook(_enter_tp_rng)
        attention.register_forward_hook(_leave_tp_rng, always_call=True)
    model._smp_tp_transformed = True
    if device is not None:
        model.to(device)
        # On CUDA with Transformer Engine importable, the TP linears run as te.Linear (same numbers;
        # see smp.torch.nn.te_backend). Elsewhere, or with SMP_DISABLE_TE=1, nothing changes.
        swap_to_te(model)
    return model
