"""`FusedLayerNorm`: SMP v1's ``smp.nn.FusedLayerNorm`` (apex's layer, apex's constructor).

SMP v1 told scripts to take ``FusedLayerNorm`` from ``smp.nn`` instead of apex. Where apex's
fused kernels import, this is apex's layer (run on the input's CUDA device, as SMP v1 did);
elsewhere it is torch's layer norm (``F.layer_norm``: torch's own fused CPU and CUDA kernels)
behind apex's constructor. Both normalise over the last ``len(normalized_shape)`` dims and keep
``weight``/``bias`` (ones/zeros, or ``None`` without ``elementwise_affine``), so a model and its
state dict are the same either way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["APEX_FUSED_LAYER_NORM", "FusedLayerNorm"]

try:  # apex is optional: it needs a CUDA build that matches torch's
    from apex.normalization import FusedLayerNorm as _ApexFusedLayerNorm  # type: ignore[import-not-found]

    APEX_FUSED_LAYER_NORM = True
except Exception:  # noqa: BLE001 - a broken apex install (missing CUDA extension) counts as absent
    _ApexFusedLayerNorm = None
    APEX_FUSED_LAYER_NORM = False

Shape = int | list[int] | tuple[int, ...] | torch.Size


class _TorchFusedLayerNorm(nn.LayerNorm):
    """apex's ``FusedLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True)`` on torch's kernel.

    ``memory_efficient`` (newer apex: recompute the normalised input in backward from the
    output) is accepted for the signature; torch's kernel keeps what it keeps.

    Example:
        >>> from smp.torch.nn import FusedLayerNorm
        >>> ln = FusedLayerNorm(1024, eps=1e-5)
        >>> y = ln(torch.randn(2, 8, 1024))
    """

    def __init__(self, normalized_shape: Shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 memory_efficient: bool = False, *, device: Any = None, dtype: Any = None) -> None:
        if isinstance(normalized_shape, bool) or not isinstance(normalized_shape, (int, list, tuple, torch.Size)):
            raise TypeError(f"FusedLayerNorm: normalized_shape={normalized_shape!r} must be an int or a sequence "
                            f"of ints (the trailing dims to normalise, e.g. hidden_size)")
        dims = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if not dims or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in dims):
            raise ValueError(f"FusedLayerNorm: normalized_shape={normalized_shape!r} must be positive ints")
        if not eps > 0:
            raise ValueError(f"FusedLayerNorm: eps={eps!r} must be > 0 (apex's default is 1e-5)")
        super().__init__(dims, eps=eps, elementwise_affine=elementwise_affine, device=device, dtype=dtype)
        self.memory_efficient = memory_efficient


if _ApexFusedLayerNorm is not None:

    class _ApexOnDevice(_ApexFusedLayerNorm):  # type: ignore[misc, valid-type]
        """apex's FusedLayerNorm, run on the input's CUDA device (SMP v1 set the device first)."""

        def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - apex's name
            if input.is_cuda:
                with torch.cuda.device(input.device):
                    return super().forward(input)  # type: ignore[no-any-return]
            return super().forward(input)  # type: ignore[no-any-return]

    FusedLayerNorm: type[nn.Module] = _ApexOnDevice
else:
    FusedLayerNorm = _TorchFusedLayerNorm
FusedLayerNorm.__name__ = FusedLayerNorm.__qualname__ = "FusedLayerNorm"
