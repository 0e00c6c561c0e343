"""The causal-LM loss of a converted Hugging Face model, on vocabulary-sharded logits.

Hugging Face models call ``self.loss_function(logits, labels, vocab_size, **kwargs)``
(``ForCausalLMLoss``); after conversion the logits are this rank's vocabulary slice, so
`smp.torch.tp.transform` installs `causal_lm_loss` instead: the same label shift, ignore index and
``num_items_in_batch`` handling, computed by `smp.torch.nn.parallel_cross_entropy`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from smp.torch.engine.refs import on_owner
from smp.torch.nn.cross_entropy import parallel_cross_entropy
from smp.torch.nn.group import resolve_group

__all__ = ["causal_lm_loss"]


def causal_lm_loss(group: Any) -> Callable[..., torch.Tensor]:
    """A drop-in ``ForCausalLMLoss`` for vocabulary-sharded logits over TP group ``group``.

    With smp's TP group, logits another pipeline rank keeps are reduced on that rank
    (`smp.torch.engine.refs.on_owner`) and do not travel.

    Example:
        >>> loss_fn = causal_lm_loss(None)
        >>> logits, labels = torch.randn(1, 4, 6), torch.tensor([[1, 2, 3, 4]])
        >>> from transformers.loss.loss_utils import ForCausalLMLoss
        >>> bool(torch.allclose(loss_fn(logits, labels, 6), ForCausalLMLoss(logits, labels, 6)))
        True
    """

    def loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None,
             num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
             shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        if group is None or group is resolve_group(None):
            return on_owner(_loss, logits, labels, None, num_items_in_batch, ignore_index, shift_labels)
        return _loss(logits, labels, group, num_items_in_batch, ignore_index, shift_labels)

    return loss


def _loss(logits: torch.Tensor, labels: torch.Tensor, group: Any, num_items_in_batch: torch.Tensor | int | None,
          ignore_index: int, shift_labels: torch.Tensor | None) -> torch.Tensor:
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
    flat_logits = logits.float().reshape(-1, logits.shape[-1])
    flat_labels = shift_labels.reshape(-1).to(logits.device)
    if num_items_in_batch is None:
        return parallel_cross_entropy(flat_logits, flat_labels, ignore_index, "mean", group)
    total = parallel_cross_entropy(flat_logits, flat_labels, ignore_index, "sum", group)
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
