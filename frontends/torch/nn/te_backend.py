"""Transformer Engine backend for the column/row-parallel linears: when it is used, and the swap.

`ColumnParallelLinear` and `RowParallelLinear` compute with ``F.linear`` plus the mappings of
`smp.torch.nn.mappings`. When Transformer Engine (``transformer_engine.pytorch``, "TE") imports,
CUDA is available and the layer's parameters are on CUDA, the same layer can run as
``te.Linear(parallel_mode="column" | "row", tp_group=...)`` holding the same shard::

    fallback                                     TE
    ColumnParallelLinear(gather_output=False)    te.Linear(parallel_mode="column")
    ColumnParallelLinear(gather_output=True)     te.Linear(parallel_mode="column") + gather_from_tp (hook)
    RowParallelLinear(input_is_parallel=True)    te.Linear(parallel_mode="row")
    RowParallelLinear(input_is_parallel=False)   scatter_to_tp (hook) + te.Linear(parallel_mode="row")

TE's column mode allreduces the input gradient (``copy_to_tp``), its row mode allreduces the output
and then adds the replicated bias (``reduce_from_tp`` + bias): the same math, so the numbers agree
up to GEMM rounding (``tests/gpu/check_te.py`` states the tolerance). FP8 and sequence parallelism
are not used. Parameter names stay ``weight`` / ``bias``, shards keep smp's ``tp_sharded`` marks, and
TE's ``_extra_state`` (FP8 metadata, unused here) is kept out of the state dict so checkpoints keep
the fallback's keys.

Selection (`select_backend`), first match wins:

1. forced off: ``enabled=False`` or the environment variable ``SMP_DISABLE_TE=1`` -> torch;
2. the parameters are not on a CUDA device -> torch;
3. ``torch.cuda.is_available()`` is False -> torch;
4. ``transformer_engine.pytorch`` does not import (not installed, or no cuDNN/CUDA libraries) -> torch;
5. otherwise -> te.

The reason for torch is logged once (level INFO) per distinct reason. Importing this module never
imports TE; the first selection that gets past rules 1-3 tries it, once (so a CPU-only run never
imports TE).

Known differences of the TE path: TE's collectives always run, also while rank 0 traces the model
alone for automatic partitioning (`smp.torch.nn.group.communicates`), so swap after partitioning
(`swap_to_te` on the placed modules); layers whose weight is shared with another module (a tied LM
head) are not swapped.
"""

from __future__ import annotations

import functools
import logging
import os
from types import ModuleType
from typing import Any, NamedTuple

import torch
from torch import nn

from smp.runtime.flags import env_flag

from .linear import ColumnParallelLinear, RowParallelLinear
from .mappings import gather_from_tp, scatter_to_tp
from .params import mark_tp_sharded

__all__ = ["DISABLE_ENV", "BackendChoice", "select_backend", "backend", "te_module", "te_linear_from",
           "maybe_te", "column_parallel_linear", "row_parallel_linear", "swap_to_te"]

logger = logging.getLogger("smp")

DISABLE_ENV = "SMP_DISABLE_TE"
"""Environment variable: ``1`` / ``true`` / ``yes`` / ``on`` turns the TE backend off; a value that is
neither on nor off is a `LaunchError` (smp.runtime.flags)."""

# Kept across smp.reset(), as the import cache of `_import_te` is: both describe the process
# (what imports, which reasons were already logged), never a script's setting or a model.
_logged: set[str] = set()


class BackendChoice(NamedTuple):
    """The backend a TP linear runs on: ``name`` is ``"te"`` or ``"torch"``; ``reason`` says why torch."""

    name: str
    reason: str


@functools.lru_cache(maxsize=1)
def _import_te() -> tuple[ModuleType | None, str]:
    try:
        import transformer_engine.pytorch as te_pytorch
    except Exception as e:  # noqa: BLE001 - ImportError, or RuntimeError/OSError for missing cuDNN/CUDA libs
        return None, f"{type(e).__name__}: {e}"
    return te_pytorch, ""


def te_module() -> ModuleType | None:
    """``transformer_engine.pytorch``, or None where it does not import (tried once, then cached)."""
    return _import_te()[0]


def _forced_off(enabled: bool | None) -> str:
    if enabled is False:
        return "Transformer Engine disabled by the caller (enabled=False)"
    if env_flag(DISABLE_ENV, "1 runs TP linears on torch even where Transformer Engine imports"):
        return f"Transformer Engine disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}"
    return ""


def select_backend(device: torch.device | str | None = None, enabled: bool | None = None) -> BackendChoice:
    """Which backend a TP linear with parameters on ``device`` uses (see the module docstring).

    Args:
        device: where the layer's parameters are; None checks only that TE and CUDA are available.
        enabled: False forces the torch fallback; None or True leave the choice to the rules
            (True does not force TE where it cannot run).

    Example:
        >>> select_backend("cpu").name
        'torch'
    """
    # Cheap checks first: on a CPU-only machine TE is never imported.
    reason = _forced_off(enabled)
    if not reason and device is not None and torch.device(device).type != "cuda":
        reason = f"parameters are on {torch.device(device)}, not CUDA"
    if not reason and not torch.cuda.is_available():
        reason = "CUDA is not available"
    if not reason:
        te, error = _import_te()
        if te is None:
            reason = f"transformer_engine.pytorch does not import ({error})"
    if not reason:
        return BackendChoice("te", "")
    if reason not in _logged:
        _logged.add(reason)
        logger.info("tensor-parallel linears use the torch fallback: %s", reason)
    return BackendChoice("torch", reason)


def backend(device: torch.device | str | None = None, enabled: bool | None = None) -> str:
    """``"te"`` or ``"torch"``: `select_backend` without the reason.

    Example:
        >>> backend("cpu", enabled=False)
        'torch'
    """
    return select_backend(device, enabled).name


@functools.lru_cache(maxsize=1)
def _te_linear_class() -> type[nn.Module]:
    te = te_module()
    if te is None:
        raise RuntimeError("transformer_engine.pytorch does not import; check select_backend(...).reason")

    class SMPTELinear(te.Linear):  # type: ignore[misc, name-defined]
        """``te.Linear`` without ``_extra_state`` in its state dict (FP8 metadata, never used here),
        so a checkpoint keeps exactly the fallback layer's keys (``weight``, ``bias``)."""

        get_extra_state = nn.Module.get_extra_state
        set_extra_state = nn.Module.set_extra_state

    return SMPTELinear


def _gather_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return gather_from_tp(output, module._smp_tp_group, dim=-1)  # type: ignore[arg-type]


def _scatter_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (scatter_to_tp(args[0], module._smp_tp_group, dim=-1), *args[1:])  # type: ignore[arg-type]


def te_linear_from(layer: ColumnParallelLinear | RowParallelLinear) -> nn.Module:
    """A ``te.Linear`` computing what ``layer`` computes, holding copies of its shard.

    ``layer``'s parameters must be on CUDA and TE must import (`select_backend` says "te"). The
    result's ``weight`` / ``bias`` are marked like the fallback's (`smp.torch.nn.params`).
    """
    column = isinstance(layer, ColumnParallelLinear)
    if not column and not isinstance(layer, RowParallelLinear):
        raise TypeError(f"te_linear_from: expected ColumnParallelLinear or RowParallelLinear, "
                        f"found {type(layer).__name__}")
    weight = layer.weight
    module = _te_linear_class()(
        layer.in_features, layer.out_features, bias=layer.bias is not None,
        parallel_mode="column" if column else "row", tp_group=layer.group, tp_size=layer.tp,
        sequence_parallel=False, params_dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        module.weight.copy_(weight)
        if layer.bias is not None:
            module.bias.copy_(layer.bias)
    module.weight.requires_grad_(weight.requires_grad)
    mark_tp_sharded(module.weight, 0 if column else 1)
    if layer.bias is not None:
        module.bias.requires_grad_(layer.bias.requires_grad)
        if column:
            mark_tp_sharded(module.bias, 0)
    module._smp_tp_group = layer.group
    module._smp_parallel_mode = "column" if column else "row"
    if column and layer.gather_output:
        module.register_forward_hook(_gather_output)
    if not column and not layer.input_is_parallel:
        module.register_forward_pre_hook(_scatter_input)
    return module


def maybe_te(layer: ColumnParallelLinear | RowParallelLinear, enabled: bool | None = None) -> nn.Module:
    """``te_linear_from(layer)`` where `select_backend` picks TE for its device, else ``layer`` itself."""
    if select_backend(layer.weight.device, enabled).name == "te":
        return te_linear_from(layer)
    return layer


def column_parallel_linear(in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                           process_group: Any = None, dtype: torch.dtype | None = None,
                           device: torch.device | str | None = None, linear: nn.Linear | None = None,
                           enabled: bool | None = None) -> nn.Module:
    """A column-parallel linear on the selected backend (`ColumnParallelLinear` arguments).

    ``linear`` slices an existing dense layer (``ColumnParallelLinear.from_linear``); ``device``
    moves the layer there before the backend is chosen.

    Example:
        >>> type(column_parallel_linear(8, 4)).__name__
        'ColumnParallelLinear'
    """
    if linear is not None:
        layer = ColumnParallelLinear.from_linear(linear, gather_output=gather_output, process_group=process_group)
    else:
        layer = ColumnParallelLinear(in_features, out_features, bias=bias, gather_output=gather_output,
                                     process_group=process_group, dtype=dtype)
    if device is not None:
        layer.to(device)
    return maybe_te(layer, enabled)


def row_parallel_linear(in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                        process_group: Any = None, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None, linear: nn.Linear | None = None,
                        enabled: bool | None = None) -> nn.Module:
    """A row-parallel linear on the selected backend (`RowParallelLinear` arguments).

    Example:
        >>> type(row_parallel_linear(8, 4)).__name__
        'RowParallelLinear'
    """
    if linear is not None:
        layer = RowParallelLinear.from_linear(linear, input_is_parallel=input_is_parallel,
                                              process_group=process_group)
    else:
        layer = RowParallelLinear(in_features, out_features, bias=bias, input_is_parallel=input_is_parallel,
                                  process_group=process_group, dtype=dtype)
    if device is not None:
        layer.to(device)
    return maybe_te(layer, enabled)


def swap_to_te(root: nn.Module, enabled: bool | None = None) -> list[str]:
    """Replace, in place, the column/row-parallel linears under ``root`` by TE modules where selected.

    Call it after the model is on its CUDA device and before the optimizer is built (the TE
    modules own new parameters). ``root`` itself is never replaced. A layer whose parameters are
    shared with another module (a tied LM head) stays on the fallback. Returns the swapped names;
    where TE is not selected nothing under ``root`` is touched.

    Example:
        >>> swap_to_te(nn.Sequential(ColumnParallelLinear(8, 4)))
        []
    """
    if select_backend(None, enabled).name != "te":
        return []
    uses: dict[int, int] = {}
    for _, p in root.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    swapped = []
    for name, parent in list(root.named_modules()):
        for attr, child in list(parent.named_children()):
            if not isinstance(child, (ColumnParallelLinear, RowParallelLinear)):
                continue
            if any(uses.get(id(p), 0) > 1 for p in child.parameters(recurse=False)):
                continue
            replacement = maybe_te(child, enabled)
            if replacement is not child:
                setattr(parent, attr, replacement)
                swapped.append(f"{name}.{attr}" if name else attr)
    return swapped
