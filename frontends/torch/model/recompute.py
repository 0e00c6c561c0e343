"""``smp.set_activation_checkpointing``: recompute a module's forward during backward.

The module's activations are not kept between forward and backward; only its inputs are, and its
forward runs again when backward reaches it (``torch.utils.checkpoint``, non-reentrant). On a
pipeline this happens on the rank that owns the module, inside the backward request. With
``offload_activations`` the kept inputs wait in host memory until backward needs them (offload.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import smp.state as smp_state

from ..errors import DistributedModelNotWrappedError
from . import offload

STRATEGIES = ("each", "contiguous")


def checkpointed(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 preserve_rng_state: bool) -> Any:
    """``fn(*args, **kwargs)``, its activations recomputed in backward (and its inputs offloaded when configured).

    Keyword arguments reach ``checkpoint`` as positional ones, so it keeps them as saved tensors, as
    it keeps the positional ones (and the offload hooks see them), rather than in a closure.
    """
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    names = tuple(kwargs)
    split = len(args)

    def call(*flat: Any) -> Any:
        return fn(*flat[:split], **dict(zip(names, flat[split:])))

    with offload.saved_inputs():
        return torch_checkpoint.checkpoint(call, *args, *kwargs.values(), use_reentrant=False,
                                           preserve_rng_state=preserve_rng_state)


def _wrap(module: nn.Module, preserve_rng_state: bool) -> None:
    if getattr(module, "_smp_checkpointed", False):
        return
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpointed(inner, args, kwargs, preserve_rng_state)

    module.forward = forward  # type: ignore[method-assign]
    module._smp_checkpointed = True  # type: ignore[assignment]


def set_activation_checkpointing(module: nn.Module, preserve_rng_state: bool = True, pack_args_as_tuple: bool = False,
                                 strategy: str = "each") -> None:
    """Recompute ``module``'s forward in backward instead of keeping its activations (SMP v1 signature).

    Call it after ``smp.DistributedModel(...)`` and before the first step. For an ``nn.Sequential``,
    ``strategy="each"`` checkpoints every child separately and ``"contiguous"`` the whole sequence
    (one recomputation per run of children on one rank); other modules are checkpointed whole.
    ``pack_args_as_tuple`` is accepted and ignored (a no-op since SMP v1.12).

    Example:
        >>> model = smp.DistributedModel(net)
        >>> for block in net.blocks:
        ...     smp.set_activation_checkpointing(block)
    """
    model = smp_state.current().model
    if model is None:
        raise DistributedModelNotWrappedError(
            "call smp.set_activation_checkpointing after smp.DistributedModel(...) and before the first step")
    if model.partitioned and smp_state.current().cfg is not None and \
            smp_state.current().cfg.pipeline_parallel_degree > 1:
        raise DistributedModelNotWrappedError("set_activation_checkpointing must be called before the first step")
    if strategy not in STRATEGIES and not strategy.startswith("group_"):
        raise ValueError(f"strategy={strategy!r}: use 'each', 'contiguous' or 'group_<n>'")
    if strategy != "each" and not isinstance(module, nn.Sequential):
        raise ValueError(f"strategy={strategy!r} is only for nn.Sequential modules (SMP v1 rule); use 'each'")
    if isinstance(module, nn.Sequential) and strategy == "each":
        for child in module:
            _wrap(child, preserve_rng_state)
    else:
        _wrap(module, preserve_rng_state)
