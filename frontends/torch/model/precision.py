"""Half-precision models (``fp16: True`` / ``bf16: True``): the model's weights in 16 bits, its boundary in 32.

SMP v1 wrapped the module in ``FP16_Module`` (``Bit16_Module``): the module is cast to half
precision, floating inputs are cast to it on the way in and half outputs back to float32 on the way
out, so the loss is computed in float32 (the same as apex's and Megatron's ``FP16_Module``). smp does
the same in place, without a wrapper module: ``DistributedModel.module`` is still the user's module.
The fp32 master weights and the loss scale live in the optimizer (``smp.torch.optimizer``).

Example:
    >>> net = cast_module(torch.nn.Linear(2, 2), torch.float16)
    >>> net.weight.dtype
    torch.float16
    >>> args, _ = cast_inputs((torch.ones(1, 2), torch.tensor([3])), {}, torch.float16)
    >>> [a.dtype for a in args]
    [torch.float16, torch.int64]
    >>> cast_outputs(net(*args[:1]), torch.float16).dtype
    torch.float32
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from smp.structure import map_structure

__all__ = ["cast_inputs", "cast_module", "cast_outputs", "half_dtype"]


def half_dtype(cfg: Any) -> torch.dtype | None:
    """The 16-bit dtype the config trains in: float16 (``fp16``, or the deprecated ``fp16_params``),
    bfloat16 (``bf16``), or None (float32 training)."""
    if cfg is None:
        return None
    if getattr(cfg, "fp16", False) or getattr(cfg, "fp16_params", False):
        return torch.float16
    if getattr(cfg, "bf16", False):
        return torch.bfloat16
    return None


def cast_module(module: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """Cast every floating parameter and buffer of ``module`` to ``dtype`` in place (the Parameter objects
    stay the same, with their attributes); None leaves it as it is."""
    return module if dtype is None else module.to(dtype)


def cast_inputs(args: tuple[Any, ...], kwargs: dict[str, Any],
                dtype: torch.dtype | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Floating tensors in ``args``/``kwargs`` (at any depth) cast to ``dtype``; other values unchanged."""
    if dtype is None:
        return args, kwargs

    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype else x

    return map_structure(args, cast), map_structure(kwargs, cast)


def cast_outputs(out: Any, dtype: torch.dtype | None) -> Any:
    """Tensors of ``dtype`` in ``out`` (at any depth) cast to float32, so the loss is computed in float32."""
    if dtype is None:
        return out
    return map_structure(out, lambda x: x.float() if isinstance(x, torch.Tensor) and x.dtype == dtype else x)
