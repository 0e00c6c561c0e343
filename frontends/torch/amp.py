"""``smp.amp.GradScaler``: torch's gradient scaler, with the inf/NaN check agreed by every rank.

Each pipeline rank only sees its own parameters' gradients, so one rank may find an overflow the
others do not. The scaler allreduces the "found inf" flags (max) over the world before deciding
to skip ``optimizer.step()`` and before ``update()``, so every rank skips or steps together and
keeps the same scale (SMP v1 semantics of ``smp.amp.GradScaler``).

Example:
    >>> scaler = smp.amp.GradScaler()
    >>> # inside the step: model.backward(scaler.scale(loss))
    >>> scaler.step(optimizer); scaler.update()
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .runtime.failure import wait


class GradScaler(torch.amp.GradScaler):
    """A drop-in for ``torch.cuda.amp.GradScaler`` (CPU when CUDA is absent)."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, device: str | None = None) -> None:
        super().__init__("cuda" if device is None and torch.cuda.is_available() else (device or "cpu"),
                         init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval, enabled=enabled)

    def _ensure_scale(self) -> None:
        # The step body (and so ``scaler.scale(loss)``) runs only on pp_rank 0; the other pipeline
        # ranks still unscale and step, with the same initial scale and the same updates.
        if self.is_enabled() and self._scale is None:
            self._lazy_init_scale_growth_tracker(torch.device(self._device))

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self._ensure_scale()
        super().unscale_(optimizer)
        if not (self.is_enabled() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        flags = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        local = torch.zeros(1)
        for flag in flags.values():
            local += flag.detach().float().cpu()
        wait(dist.all_reduce(local, op=dist.ReduceOp.MAX, async_op=True), "GradScaler inf check", "world")
        for flag in flags.values():
            flag.fill_(float(local.item() > 0))

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> float | None:
        self._ensure_scale()
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        self._ensure_scale()
        super().update(new_scale)
