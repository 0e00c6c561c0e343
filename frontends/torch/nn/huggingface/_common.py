"""What every Hugging Face family module shares: the translation error, key walking, loading full weights.

A translate function maps names (and, for GPT-2's fused ``c_attn`` and ``Conv1D`` layout, values)
between a Hugging Face state dict and the state dict of SMP v1's structure (`smp.torch.nn`
modules). Values are moved, transposed, split or concatenated, never recomputed, so a round trip
gives back the very same numbers.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

import smp.state as smp_state
from smp.errors import SMPError

from ..group import resolve_group
from ..params import shard_packed, tp_split_dim
from ..rng import _config_seed

logger = logging.getLogger("smp")
M = TypeVar("M", bound=nn.Module)

__all__ = ["HFTranslationError", "build_from_hf", "check_max_seq_len", "hf_init_skipped", "load_full_weights",
           "reject_partial", "rename_keys", "unknown_keys_error"]


class HFTranslationError(SMPError, ValueError):
    """A state dict (or config) does not fit the Hugging Face family it is translated for."""


def unknown_keys_error(family: str, direction: str, keys: list[str], expected: str) -> HFTranslationError:
    shown = ", ".join(repr(k) for k in keys[:5]) + (f" (and {len(keys) - 5} more)" if len(keys) > 5 else "")
    return HFTranslationError(
        f"{direction} ({family}): {len(keys)} key(s) are not {expected}: {shown}. Fix: pass the state dict of "
        f"a {family} model (strip any prefix a wrapper added, e.g. 'module.'), or use the translate function "
        "of the model's family (smp.torch.nn.huggingface.FAMILIES lists them)")


def check_max_seq_len(max_seq_len: Any) -> None:
    """SMP v1's ``max_seq_len`` rebuilt the ``attn.bias`` causal-mask buffers of transformers 4.x.

    transformers 5 keeps no such buffer in its state dicts, so the value is only checked.
    """
    if max_seq_len is not None and (type(max_seq_len) is not int or max_seq_len < 1):
        raise HFTranslationError(f"max_seq_len={max_seq_len!r} must be a positive int or None")


def reject_partial(state_dict: dict[str, Any], what: str) -> None:
    """SMP v1's translate functions take full state dicts (every TP shard gathered)."""
    if state_dict.get("_smp_is_partial"):
        raise HFTranslationError(f"{what}: this is a partial state dict (model.local_state_dict()); translate the "
                                 "full one (model.state_dict(), or a full checkpoint)")


def rename_keys(state_dict: dict[str, Any], top: dict[str, str], layer_in: re.Pattern[str], layer_out: str,
                layer: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
    r"""Rename by prefix: ``top`` maps whole-key prefixes, ``layer`` maps the owner (the name before
    the last dot) of each key ``layer_in`` matches (groups: prefix, index, rest), which becomes
    ``<layer_out><index>.<new owner>.<leaf>``. Returns (renamed, keys neither table covers).

    Example:
        >>> pat = re.compile(r"^(?P<prefix>)h\.(?P<index>\d+)\.(?P<rest>.+)$")
        >>> rename_keys({"wte.weight": 1, "h.0.ln_1.bias": 2, "x": 3}, {"wte.": "word_embedding."}, pat,
        ...             "seq_layers.", {"ln_1": "pre_layernorm"})
        ({'word_embedding.weight': 1, 'seq_layers.0.pre_layernorm.bias': 2}, ['x'])
    """
    out: dict[str, Any] = {}
    left: list[str] = []
    for key, value in state_dict.items():
        parsed = layer_index(layer_in, key)
        if parsed is not None:
            owner, _, leaf = parsed[2].rpartition(".")
            if owner in layer:
                out[f"{layer_out}{parsed[1]}.{layer[owner]}.{leaf}"] = value
                continue
        else:
            head = next((p for p in top if key.startswith(p)), None)
            if head is not None:
                out[top[head] + key[len(head):]] = value
                continue
        left.append(key)
    return out, left


def layer_index(pattern: re.Pattern[str], key: str) -> tuple[str, int, str] | None:
    """(prefix, layer index, rest) of ``key`` under ``pattern`` (groups: prefix, index, rest)."""
    m = pattern.match(key)
    return (m["prefix"], int(m["index"]), m["rest"]) if m else None


def load_full_weights(module: nn.Module, full: dict[str, torch.Tensor], what: str,
                      process_group: Any = None) -> None:
    """Copy unsharded tensors into ``module``; each TP shard takes this rank's slice.

    Raises:
        HFTranslationError: a parameter of ``module`` is missing from ``full``, or a shape differs.
    """
    group = resolve_group(process_group)
    own = module.state_dict(keep_vars=True)
    missing = [k for k in own if k not in full]
    extra = [k for k in full if k not in own]
    if missing or extra:
        raise HFTranslationError(
            f"{what}: the translated state dict does not match {type(module).__name__}: missing {missing[:5]}, "
            f"unexpected {extra[:5]}. Fix: build the model from the same config as the weights")
    with torch.no_grad():
        for name, t in own.items():
            value = full[name]
            dim = tp_split_dim(t)
            if dim is not None:
                value = shard_packed(value, dim, int(getattr(t, "tp_packed", 1)), group, name)
            if tuple(value.shape) != tuple(t.shape):
                raise HFTranslationError(f"{what}: {name} is {tuple(value.shape)} in the weights but "
                                         f"{tuple(t.shape)} in {type(module).__name__}")
            t.copy_(value.to(t.dtype))


def build_from_hf(hf: nn.Module, build: Callable[[], M], translated: Callable[[], dict[str, torch.Tensor]],
                  what: str, process_group: Any = None) -> M:
    """``build()`` the SMP v1 module for the Hugging Face module ``hf`` and give it ``hf``'s weights.

    When there are no weights to keep, the new module is initialised afresh, as SMP v1 initialised
    every model it converted: ``hf`` still has meta parameters (delayed initialisation), or the script
    replaced ``PreTrainedModel.init_weights`` (SMP v1's GPT-2 example does, "DistributedModel will
    override those weights anyway"), so Hugging Face never initialised (nor tied) them. A generator
    seeded with ``random_seed`` (else ``tensor_parallel_seed``) makes every TP rank slice the same
    full tensors and leaves the caller's random state untouched.
    """
    meta = any(p.is_meta for p in hf.parameters())
    if meta or hf_init_skipped(hf):
        why = ("delayed (meta) parameters" if meta else
               "PreTrainedModel.init_weights was replaced, so the Hugging Face weights were never initialised")
        if smp_state.current().rank == 0:
            log = logger.info if meta else logger.warning
            log("%s: %s; the SMP v1 structure is initialised afresh, as SMP v1 did (seed %d)", what, why,
                _config_seed())
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_config_seed())
            new = build()
    else:
        new = build()
        load_full_weights(new, translated(), what, process_group)
    new.train(hf.training)
    return new


def hf_init_skipped(hf: nn.Module) -> bool:
    """Whether ``hf``'s ``init_weights`` is not Hugging Face's (a script replaced it to start faster)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    init = getattr(type(hf), "init_weights", PreTrainedModel.init_weights)
    return not str(getattr(init, "__module__", "") or "").startswith("transformers")
