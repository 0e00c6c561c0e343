"""Rotary position embeddings on the first ``rotary_dim`` dims of each attention head (GPT-J's and GPT-NeoX's).

For position p and frequency pair i (``inv_freq[i] = base ** (-2i / rotary_dim)``), the pair
(a, b) of a query or key is rotated by the angle ``p * inv_freq[i]``::

    a' = a cos - b sin,   b' = b cos + a sin

The two families pair the dims differently (rotary_dim = 4 shown; dims past rotary_dim pass through)::

    GPT-J    (interleaved):  pairs (0, 1) (2, 3)     angles  f0 f0 f1 f1
    GPT-NeoX (halves):       pairs (0, 2) (1, 3)     angles  f0 f1 f0 f1

The rotation acts on each head alone, so heads split over TP ranks (`DistributedAttentionLayer`)
need nothing more: every rank rotates its own heads with the same table.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rotary", "check_rotary_dim", "rotary_sin_cos"]


def check_rotary_dim(rotary_dim: int | None, head_size: int) -> None:
    """``rotary_dim`` must be None (no rotary) or an even int in 2..head_size."""
    if rotary_dim is None:
        return
    if type(rotary_dim) is not int or rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_size:
        raise ValueError(f"rotary_dim={rotary_dim!r}: expected None or an even int from 2 to "
                         f"attention_head_size={head_size}. Fix: pass the number of rotated dims per head "
                         "(GPT-J: config.rotary_dim; GPT-NeoX: int(head size * partial_rotary_factor))")


def rotary_sin_cos(seq_len: int, rotary_dim: int, base: float, interleaved: bool,
                   device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin, cos) of shape [seq_len, rotary_dim] in float32 for positions 0 .. seq_len - 1.

    Example:
        >>> sin, cos = rotary_sin_cos(3, 4, 10000.0, interleaved=True)
        >>> tuple(sin.shape), bool(torch.equal(sin[:, 0], sin[:, 1]))
        ((3, 4), True)
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, device=device, dtype=torch.int64).float() / rotary_dim))
    angles = torch.arange(seq_len, device=device, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    sin, cos = torch.sin(angles), torch.cos(angles)
    if interleaved:
        return sin.repeat_interleave(2, dim=-1), cos.repeat_interleave(2, dim=-1)
    return torch.cat((sin, sin), dim=-1), torch.cat((cos, cos), dim=-1)


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:  # (a, b) -> (-b, a) for each adjacent pair
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the first ``sin.shape[-1]`` dims of ``x`` [..., S, head_size]; the rest pass through.

    Example:
        >>> sin, cos = rotary_sin_cos(2, 2, 10000.0, interleaved=False)
        >>> apply_rotary(torch.tensor([[1.0, 0.0, 5.0], [1.0, 0.0, 5.0]]), sin, cos, False)[1, 2].item()
        5.0
    """
    r = sin.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    sin, cos = sin.to(x.dtype), cos.to(x.dtype)
    return torch.cat((rot * cos + _rotate(rot, interleaved) * sin, rest), dim=-1)
