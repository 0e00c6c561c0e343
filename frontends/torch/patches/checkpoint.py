"""``smp.checkpoint`` / ``checkpoint_sequential``: activation checkpointing of a module call (SMP v1 names).

The module's forward is recomputed during backward (``torch.utils.checkpoint``, non-reentrant);
the whole module must sit on one pipeline rank, as in SMP v1. For a model you cannot edit, use
``smp.set_activation_checkpointing(module)`` instead. With ``offload_activations`` the inputs kept
for the recomputation wait in host memory (smp.torch.model.offload).

Example:
    >>> h = smp.checkpoint(self.block, h)                       # inside a forward
    >>> out = checkpoint_sequential(self.layers, x, strategy="each")
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..model.recompute import checkpointed


def checkpoint(module: nn.Module, *args: Any, preserve_rng_state: bool = True) -> Any:
    """Call ``module(*args)``, recomputing it in backward instead of keeping its activations."""
    if not isinstance(module, nn.Module):
        raise TypeError("smp.checkpoint checkpoints a module call (SMP v1): pass an nn.Module, not a function")
    return checkpointed(module, args, {}, preserve_rng_state)


def checkpoint_sequential(sequential_module: nn.Sequential, input: Any, strategy: str = "each",  # noqa: A002
                          preserve_rng_state: bool = True, pack_args_as_tuple: bool = False) -> Any:
    """Run an ``nn.Sequential`` checkpointing ``"each"`` layer, the whole ``"contiguous"`` run, or
    groups of ``"group_<n>"`` consecutive layers."""
    layers = list(sequential_module)
    if strategy == "each":
        size = 1
    elif strategy == "contiguous":
        size = max(1, len(layers))
    elif strategy.startswith("group_") and strategy[6:].isdigit() and int(strategy[6:]) > 0:
        size = int(strategy[6:])
    else:
        raise ValueError(f"strategy={strategy!r}: use 'each', 'contiguous' or 'group_<n>'")
    x = input
    for start in range(0, len(layers), size):
        group = nn.Sequential(*layers[start:start + size])
        x = checkpoint(group, x, preserve_rng_state=preserve_rng_state)
    return x
