"""A small GPT used by the demo and the benchmarks: embedding, pre-norm blocks, LM head.

Written two ways from the same ``Embed``/``Block``/``Head`` classes: ``GPT`` is the usual
``nn.Module`` with a ``ModuleList`` of blocks and a ``for`` loop in ``forward`` (the demo uses it),
``gpt()`` builds an ``nn.Sequential`` (the benchmarks run both). Both create their modules in the
same order, so with the same seed they hold the same parameters (``sequential_to_modulelist_keys``
maps the state dicts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Embed(nn.Module):
    def __init__(self, vocab: int, width: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, w = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, s, w))
        return h + self.out(F.gelu(self.fc(self.ln2(h))))


class Head(nn.Module):
    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.lm = nn.Linear(width, vocab, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(h))


def gpt(vocab: int = 4096, width: int = 256, layers: int = 8, heads: int = 4, seq: int = 128) -> nn.Sequential:
    """The model: ``Sequential(Embed, Block x layers, Head)``; returns logits (batch, seq, vocab)."""
    return nn.Sequential(Embed(vocab, width, seq), *[Block(width, heads) for _ in range(layers)], Head(width, vocab))


class GPT(nn.Module):
    """The same model written the usual way: ``self.blocks = nn.ModuleList(...)`` and a loop."""

    def __init__(self, vocab: int = 4096, width: int = 256, layers: int = 8, heads: int = 4, seq: int = 128) -> None:
        super().__init__()
        self.embed = Embed(vocab, width, seq)
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(layers)])
        self.head = Head(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def sequential_to_modulelist_keys(layers: int = 8) -> dict[str, str]:
    """Prefix map from ``gpt()``'s state-dict keys to ``GPT``'s: ``"0."`` -> ``"embed."``, ..."""
    out = {"0.": "embed."}
    out.update({f"{i + 1}.": f"blocks.{i}." for i in range(layers)})
    out[f"{layers + 1}."] = "head."
    return out


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
