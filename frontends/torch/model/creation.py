"""Model creation: the one context that builds a model for smp (tensor parallelism, delayed init, dtype).

It combines two independent contexts, `smp.torch.tp.marking.tensor_parallelism` and
`smp.torch.model.delayed.delay_param_initialization`; it lives apart from both so that neither imports
the other (the TP conversion reads the delayed-init plan, so `tp.marking` imports `delayed`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

import smp.state as smp_state
from smp.errors import ConfigProblem, SMPInvalidArgumentError

from ..tp.marking import tensor_parallelism as tp_context
from .delayed import delay_param_initialization
from .precision import half_dtype

__all__ = ["model_creation"]

logger = logging.getLogger("smp")
_HALF = (torch.float16, torch.bfloat16)
_warned_pure_half = False


def _check_dtype(dtype: torch.dtype | None, trained: torch.dtype | None) -> None:
    """Refuse a 16-bit ``dtype`` other than the config's; say once what a 16-bit model without fp16/bf16 gets."""
    global _warned_pure_half
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise SMPInvalidArgumentError([ConfigProblem("smp.model_creation(dtype=...)", dtype,
                                                     "must be a floating torch.dtype or None",
                                                     "pass e.g. torch.float16, torch.bfloat16 or None")])
    if dtype in _HALF and trained is not None and dtype != trained:
        key = "fp16" if trained == torch.float16 else "bf16"
        raise SMPInvalidArgumentError([ConfigProblem(
            "smp.model_creation(dtype=...)", dtype, f"the config trains in {trained} ({key}: True), and "
            f"smp.DistributedModel casts the model to it", f"pass dtype={trained}, or set "
            f"{'bf16' if dtype == torch.bfloat16 else 'fp16'}: True (and {key}: False) in the config")])
    if dtype in _HALF and trained is None and not _warned_pure_half:
        _warned_pure_half = True
        logger.warning("smp.model_creation(dtype=%s) without fp16/bf16 in the config: the model trains in pure %s "
                       "(no fp32 master weights, no loss scaling). For mixed precision set %s: True", dtype, dtype,
                       "fp16" if dtype == torch.float16 else "bf16")


@contextmanager
def model_creation(tensor_parallelism: bool = False, dtype: torch.dtype | None = None,
                   **tensor_parallel_config: Any) -> Iterator[None]:
    """Build a model for smp (SMP v1 ``smp.model_creation``).

    Combines ``smp.tensor_parallelism(enabled=tensor_parallelism, **tensor_parallel_config)``,
    `delay_param_initialization` (``enabled`` = the config's ``delayed_parameter_initialization``)
    and ``torch.set_default_dtype(dtype)`` for the duration of the block. With ``fp16: True`` /
    ``bf16: True`` in the config, ``dtype`` float16 / bfloat16 builds the model in 16 bits directly
    (``smp.DistributedModel`` casts it anyway, and the optimizer keeps fp32 master weights); the other
    16-bit dtype is refused.

    Example:
        >>> with model_creation(dtype=torch.float64):
        ...     layer = nn.Linear(4, 4)
        >>> layer.weight.dtype
        torch.float64
    """
    cfg = smp_state.current().cfg
    _check_dtype(dtype, half_dtype(cfg))
    delayed = bool(getattr(cfg, "delayed_parameter_initialization", False)) if cfg is not None else False
    with ExitStack() as stack:
        stack.enter_context(tp_context(enabled=tensor_parallelism, **tensor_parallel_config))
        stack.enter_context(delay_param_initialization(enabled=delayed))
        if dtype is not None:
            previous = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            stack.callback(torch.set_default_dtype, previous)
        yield
