"""Hugging Face checkpoints for converted models: save the full model, load only this rank's shards.

`save_pretrained` gathers every TP shard (a collective over the TP group) and has global rank 0
write ``config.json`` and safetensors with the original Hugging Face names, so
``AutoModelForCausalLM.from_pretrained(path)`` loads it without smp, at any TP degree (resharding
is slicing again). ``smp.DistributedModel.save_pretrained`` does the same from any TP x PP x DP
layout (`smp.torch.model.state_dict`: the model's one full-state gather). `load_hf_checkpoint`
reads a Hugging Face checkpoint into a converted model, each rank reading only its slice of each
sharded tensor (safetensors ``get_slice``).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch
import torch.distributed as dist
from smp.torch.nn.group import group_rank, group_size, resolve_group
from smp.torch.nn.params import gather_named, tp_split_dim
from torch import nn

__all__ = ["full_hf_state_dict", "load_hf_checkpoint", "require_hf", "save_pretrained"]


def full_hf_state_dict(model: nn.Module, process_group: Any = None) -> dict[str, torch.Tensor]:
    """The converted model's full state dict under Hugging Face names (a collective over the TP group).

    Tied weights (``lm_head.weight`` is ``embed_tokens.weight``) appear under both names, both full.
    """
    return gather_named(model.state_dict(keep_vars=True), resolve_group(process_group))


def require_hf(module: nn.Module) -> None:
    if not callable(getattr(module, "save_pretrained", None)) or getattr(module, "config", None) is None:
        raise TypeError(f"save_pretrained: the model is a {type(module).__name__}, not a Hugging Face "
                        "PreTrainedModel (it has no save_pretrained method and config). Fix: wrap a transformers "
                        "model, or save this one with smp.save / model.state_dict()")


def save_pretrained(model: nn.Module, path: str, process_group: Any = None, **kwargs: Any) -> None:
    """Write ``model`` as a plain Hugging Face checkpoint; a collective, call it on every rank.

    ``model`` is a Hugging Face model converted by `transform` (the TP group is ``process_group``),
    or an ``smp.DistributedModel`` wrapping one (any TP x PP x DP layout; its ``save_pretrained``).
    Global rank 0 writes ``config.json`` and safetensors under the original names, which
    ``transformers.AutoModelForCausalLM.from_pretrained(path)`` loads without smp. ``kwargs`` go to
    Hugging Face's ``save_pretrained`` (e.g. ``max_shard_size``).

    Example:
        >>> import tempfile, transformers
        >>> cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
        >>> from smp.torch.tp import transform
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_pretrained(transform(transformers.LlamaForCausalLM(cfg)), d)
        ...     sorted(f for f in os.listdir(d) if f.endswith((".json", ".safetensors")))[:2]
        ['config.json', 'generation_config.json']
    """
    if callable(getattr(model, "local_state_dict", None)):  # an smp.DistributedModel
        model.save_pretrained(path, **kwargs)  # type: ignore[operator]
        return
    require_hf(model)
    state = full_hf_state_dict(model, process_group)
    if not dist.is_initialized() or dist.get_rank() == 0:
        model.save_pretrained(path, state_dict=state, **kwargs)  # type: ignore[operator]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file of a checkpoint directory (single file or indexed)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json (only "
                                "safetensors checkpoints can be read shard by shard)")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {k: single for k in f.keys()}


def _read_shard(piece: Any, param: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    dim = tp_split_dim(param)
    shape = piece.get_shape()
    if dim is None:
        return piece[:]  # type: ignore[no-any-return]
    packed = int(getattr(param, "tp_packed", 1))
    chunk = shape[dim] // packed
    part = chunk // tp
    parts = []
    for k in range(packed):
        index = [slice(None)] * len(shape)
        index[dim] = slice(k * chunk + rank * part, k * chunk + (rank + 1) * part)
        parts.append(piece[tuple(index)])
    return torch.cat(parts, dim=dim)


# transformers 5.x writes Mixtral's fused experts in the legacy per-expert layout:
# mlp.experts.gate_up_proj[e] = cat(block_sparse_moe.experts.e.w1, ...w3), down_proj[e] = ...w2,
# mlp.gate = block_sparse_moe.gate.
_MOE = re.compile(r"^(?P<prefix>.*)\.mlp\.(?P<what>gate\.weight|experts\.gate_up_proj|experts\.down_proj)$")


class _Reader:
    """Open safetensors files of a checkpoint on demand and read (slices of) tensors by name."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.files = _files(path)
        self._open: dict[str, Any] = {}

    def has(self, name: str) -> bool:
        return name in self.files

    def slice(self, name: str) -> Any:
        from safetensors import safe_open

        file = self.files[name]
        if file not in self._open:
            self._open[file] = safe_open(file, framework="pt")
        return self._open[file].get_slice(name)

    def read(self, name: str, param: torch.Tensor, tp: int, rank: int) -> torch.Tensor | None:
        if self.has(name):
            return _read_shard(self.slice(name), param, tp, rank)
        m = _MOE.match(name)
        if m is None:
            return None
        legacy = f"{m['prefix']}.block_sparse_moe"
        if m["what"] == "gate.weight":
            return self.slice(f"{legacy}.gate.weight")[:] if self.has(f"{legacy}.gate.weight") else None
        experts = []
        for e in range(param.shape[0]):
            names = [f"{legacy}.experts.{e}.{w}.weight" for w in
                     (("w1", "w3") if m["what"] == "experts.gate_up_proj" else ("w2",))]
            if not all(self.has(n) for n in names):
                return None
            if m["what"] == "experts.gate_up_proj":
                part = param.shape[1] // 2
                experts.append(torch.cat([self.slice(n)[rank * part:(rank + 1) * part] for n in names]))
            else:
                part = param.shape[2]
                experts.append(self.slice(names[0])[:, rank * part:(rank + 1) * part])
        return torch.stack(experts)


def load_hf_checkpoint(model: nn.Module, path: str, process_group: Any = None, strict: bool = True) -> list[str]:
    """Load a Hugging Face safetensors checkpoint into a converted model, reading only this rank's shards.

    Reads both the model's own parameter names and transformers' legacy per-expert Mixtral layout
    (``block_sparse_moe.experts.<e>.w1/w2/w3``), which is what ``save_pretrained`` writes.

    Returns:
        The model's parameter names missing from the checkpoint (an error when ``strict``).
    """
    group = resolve_group(process_group)
    tp, rank = group_size(group), group_rank(group)
    reader = _Reader(path)
    values: dict[str, torch.Tensor] = {}
    missing = []
    for name, p in model.named_parameters():
        value = reader.read(name, p, tp, rank)
        if value is None:
            missing.append(name)
        elif value.shape != p.shape:
            raise ValueError(f"{name}: checkpoint shard {tuple(value.shape)} does not fit the parameter "
                             f"{tuple(p.shape)} at tensor_parallel_degree={tp}")
        else:
            values[name] = value
    if missing and strict:
        raise KeyError(f"{path} lacks {len(missing)} parameter(s) of the model, e.g. {missing[:3]}. Fix: load a "
                       "checkpoint of the same architecture, or strict=False")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in values:
                p.copy_(values[name].to(p.dtype))
    return missing
