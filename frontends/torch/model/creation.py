"""Model creation: the one context that builds a model for smp (tensor parallelism, delayed init, dtype).

It combines two independent contexts, `smp.torch.tp.marking.tensor_parallelism` and
`smp.torch.model.delayed.delay_param_initialization`; it lives apart from both so that neither imports
the other (the TP conversion reads the delayed-init plan, so `tp.marking` imports `delayed`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

import smp.state as smp_state

from ..tp.marking import tensor_parallelism as tp_context
from .delayed import delay_param_initialization

__all__ = ["model_creation"]


@contextmanager
def model_creation(tensor_parallelism: bool = False, dtype: torch.dtype | None = None,
                   **tensor_parallel_config: Any) -> Iterator[None]:
    """Build a model for smp (SMP v1 ``smp.model_creation``).

    Combines ``smp.tensor_parallelism(enabled=tensor_parallelism, **tensor_parallel_config)``,
    `delay_param_initialization` (``enabled`` = the config's ``delayed_parameter_initialization``)
    and ``torch.set_default_dtype(dtype)`` for the duration of the block.

    Example:
        >>> with model_creation(dtype=torch.float64):
        ...     layer = nn.Linear(4, 4)
        >>> layer.weight.dtype
        torch.float64
    """
    cfg = smp_state.current().cfg
    delayed = bool(getattr(cfg, "delayed_parameter_initialization", False)) if cfg is not None else False
    with ExitStack() as stack:
        stack.enter_context(tp_context(enabled=tensor_parallelism, **tensor_parallel_config))
        stack.enter_context(delay_param_initialization(enabled=delayed))
        if dtype is not None:
            previous = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            stack.callback(torch.set_default_dtype, previous)
        yield
