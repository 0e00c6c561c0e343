"""Small models and data for the pipeline correctness tests, each with a manual placement per pp."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """A plain stack (nn.Sequential): the chain is 0 -> 1 -> ... (consecutive children fused)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(12, 12), nn.Tanh())], nn.Linear(12, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def place(self, pp: int, set_partition: Callable[[nn.Module, int], None], virtual_stages: int = 1) -> None:
        # Stage k of pp * virtual_stages sits on rank k % pp: with 2 virtual stages on pp=2 the
        # chain loops, 0 -> 1 -> 0 -> 1 (the Megatron interleaved placement).
        layers = list(self.net)
        stages = pp * virtual_stages
        for i, layer in enumerate(layers):
            set_partition(layer, (i * stages // len(layers)) % pp)


class ReluLoop(nn.Module):
    """Four ``width`` x ``width`` linears with ReLU in a ModuleList loop (the runtime tests' model)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def train_relu_loop(smp: Any, width: int, steps: int, **config: Any) -> None:
    """``smp.init`` (pp=2, 4 microbatches, plus ``config``), then ``steps`` steps of a `ReluLoop`."""
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4, **config})
    torch.manual_seed(0)
    model = smp.DistributedModel(ReluLoop(width))

    @smp.step
    def step(model: Any, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        model.backward(loss)
        return loss

    for _ in range(steps):
        step(model, torch.randn(8, width))


class CNN(nn.Module):
    """A small CNN whose forward does work between child calls (relu, pooling, flatten)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 3 * 3, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)

    def place(self, pp: int, set_partition: Callable[[nn.Module, int], None]) -> None:
        for i, m in enumerate([self.conv1, self.conv2, self.fc1, self.fc2]):
            set_partition(m, min(pp - 1, i * pp // 4))


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        a = self.ln(h)
        h = h + self.attn(a, a, a, attn_mask=mask, need_weights=False)[0]
        return h + self.mlp(h)


class TinyGPT(nn.Module):
    """Token + position embeddings, blocks in a ModuleList loop, LM head tied to the embedding."""

    def __init__(self, vocab: int = 32, d: int = 16, layers: int = 4, seq: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: both modules must sit on one rank
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        h = self.tok(ids) + self.pos(torch.arange(n))
        for block in self.blocks:
            h = block(h, mask=self.mask[:n, :n])
        return self.head(self.norm(h))

    def place(self, pp: int, set_partition: Callable[[nn.Module, int], None]) -> None:
        # Embedding, tied head and final norm on rank 0; blocks spread over the other ranks.
        others = list(range(1, pp)) or [0]
        for i, block in enumerate(self.blocks):
            set_partition(block, others[i * len(others) // len(self.blocks)])


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Outer(nn.Module):
    """Owned by rank 1, with a child owned by rank 0: a nested call back to the caller's rank."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(10, 10)
        self.inner = Inner()
        self.post = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.inner(torch.relu(self.pre(x)))) + x


class PingPong(nn.Module):
    """Chain 0 -> 1 -> 0 -> 1 -> 0 -> 1 -> 0: rank 0 and rank 1 take turns, with a nested call."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Outer()
        self.b = nn.Linear(10, 10)
        self.c = nn.Linear(10, 10)
        self.out = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> dict[str, torch.Tensor]:
        h = self.a(x)
        h = torch.sigmoid(self.b(h)) * scale
        h = self.c(h) + h
        return {"logits": self.out(h), "hidden": h}

    def place(self, pp: int, set_partition: Callable[[nn.Module, int], None]) -> None:
        last = pp - 1
        set_partition(self.a, min(1, last))
        set_partition(self.a.inner, 0)
        if pp > 2:
            set_partition(self.b, pp - 2)
        set_partition(self.c, last)


def batches(kind: str, steps: int = 3, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        if kind == "mlp":
            out.append((torch.randn(batch, 12, generator=g), torch.randint(0, 5, (batch,), generator=g)))
        elif kind == "cnn":
            out.append((torch.randn(batch, 1, 14, 14, generator=g), torch.randint(0, 10, (batch,), generator=g)))
        elif kind == "gpt":
            ids = torch.randint(0, 32, (batch, 9), generator=g)
            out.append((ids[:, :-1], ids[:, 1:]))
        else:
            out.append((torch.randn(batch, 10, generator=g), torch.randint(0, 3, (batch,), generator=g)))
    return out


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": MLP, "cnn": CNN, "gpt": TinyGPT, "pingpong": PingPong}


def loss_of(kind: str, out: Any, y: torch.Tensor) -> torch.Tensor:
    if kind == "cnn":
        return F.nll_loss(out, y)
    if kind == "gpt":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    if kind == "pingpong":
        return F.cross_entropy(out["logits"], y) + 0.01 * out["hidden"].pow(2).mean()
    return F.cross_entropy(out, y)


def train_step(kind: str) -> Any:
    """The SMP v1 training step the zoo tests run: ``kind``'s loss, ``model.backward``, the loss."""
    import smp.torch as smp

    @smp.step
    def step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(kind, model(x), y)
        model.backward(loss)
        return loss

    return step


def train_losses(model: Any, opt: Any, step: Any, data: Any) -> list[float]:
    """The SMP v1 training loop over ``data`` (``(x, y)`` pairs): each step's mean loss over microbatches."""
    losses = []
    for x, y in data:
        opt.zero_grad()
        losses.append(step(model, x, y).reduce_mean().item())
        opt.step()
    return losses


def hf_train_step() -> Any:
    """The same for a Hugging Face causal LM called with ``labels`` (the loss it computes)."""
    import smp.torch as smp

    @smp.step
    def step(model: Any, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=labels).loss
        model.backward(loss)
        return loss

    return step


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[kind]()


def reference(kind: str, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same model trained in one process on the same data: the ground truth."""
    model = build(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in batches(kind, steps):
        opt.zero_grad()
        loss = loss_of(kind, model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
