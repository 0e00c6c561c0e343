"""The partitioner's trace: the step body's work after the model returns counts where it runs."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from smp.torch.partitioning.trace import lower, rehome_split_layers, trace
from torch import nn

from smp.partition import ModuleTree, partition_tree
from tests.helpers.spawn import run_ranks


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_loss_in_the_step_body_is_counted_on_the_module_that_made_the_output() -> None:
    net = _Net()
    x = torch.randn(2, 8)

    def step() -> None:
        for layer in net.layers:  # each layer: 5 ms of work inside its forward
            layer.register_forward_hook(lambda *_: _busy(0.005))
        out = net(x)
        _busy(0.03)  # the loss: 30 ms after the model returned
        out.sum()

    def body() -> None:
        step()
        for layer in net.layers:
            layer._forward_hooks.clear()

    tr = trace(net, body)
    assert tr.last == "head"
    assert 0.03 <= tr.after < 0.06, tr.after
    tree = lower(net, tr)
    compute = {n.path: n.compute for n in tree}
    assert compute["head"] >= 0.03 > compute["layers.0"]
    # Counted there, it moves the cut: head + its loss (30 ms) weigh as much as the 4 layers (20 ms)
    # and more, so the second rank gets the head alone.
    part = partition_tree(tree, 2, memory_weight=0.0)
    assert [p for p, r in part.assignment.items() if r == 1 and p] == ["head"]


class _Attention(nn.Module):
    """A block whose own code between its children is heavy: ``qkv``, 30 ms on its output, ``proj``."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.qkv, self.proj = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _busy(0.01)  # before any child: on the block's own inputs, where the block runs
        a = self.qkv(self.first(x))
        _busy(0.03)  # the attention on qkv's output: runs where qkv's output is
        return x + self.proj(a)


def test_own_work_after_a_child_counts_with_that_child() -> None:
    # Note [own work after a child] (trace.py): an op on a child's output runs where the output is.
    net = _Attention()
    x = torch.randn(2, 8)
    tr = trace(net, lambda: net(x))
    assert 0.03 <= tr.tails[("", "qkv")] < 0.06, tr.tails
    assert tr.tails.get(("", "first"), 0.0) < 0.01  # qkv was called right after it
    compute = {n.path: n.compute for n in lower(net, tr)}
    assert compute["qkv"] >= 0.03 > compute["proj"]
    assert 0.01 <= compute[""] < 0.03, compute  # the work before the first child stays
    # With the backward traced, the caller's own backward moves with the same share.
    tr = trace(net, lambda: pending.append(net(x).sum()), backward=lambda: [([pending.pop()], None)]
               if pending else [])
    compute = {n.path: n.compute for n in lower(net, tr)}
    assert compute["qkv"] >= 0.03 > compute["proj"]


pending: list[torch.Tensor] = []


def test_no_work_after_the_model_adds_nothing() -> None:
    net = _Net()
    tr = trace(net, lambda: net(torch.randn(2, 8)))
    assert tr.last == "head" and tr.after < 0.01
    tr = trace(net, lambda: net(torch.randn(2, 8)), measure_time=False)
    assert tr.after == 0.0 and tr.time == {}


def _opened(tree: ModuleTree, path: str) -> bool:
    return not tree.node(path).atomic


def test_layers_open_one_level_and_their_children_stay_whole() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     max_position_embeddings=32, use_cache=False)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    tree = lower(hf)
    layer = "model.layers.0"
    moe = f"{layer}.mlp"  # router + experts
    assert _opened(tree, "") and _opened(tree, "model") and _opened(tree, "model.layers")
    # A decoder layer may be cut between its attention and its MLP ...
    assert _opened(tree, layer)
    # ... but not inside them: the attention's projections and the MoE block's experts stay together.
    assert not _opened(tree, f"{layer}.self_attn")
    assert not _opened(tree, moe)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.act, self.mlp = nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.act(self.mlp(x))


class _Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(3))
        self.net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.net(x)


def test_a_split_layer_runs_its_own_code_where_its_caller_does() -> None:
    """The way back of a V (rank 0 -> 1 -> 0) cut inside a layer: the layer's code, and a Sequential's,
    run where the loop runs (rank 0), not with their first child on rank 1."""
    body = _Body()
    assignment = {path: 0 for path, _ in body.named_modules()}
    for path in ("layers.1", "layers.1.attn", "layers.1.act", "layers.1.mlp",  # whole on rank 1: stays
                 "layers.2", "layers.2.attn", "layers.2.act",  # own and attention on 1, MLP on 0
                 "net", "net.0", "net.1"):  # a Sequential on 1, its last child on 0
        assignment[path] = 1
    out = rehome_split_layers(body, assignment)
    moved = {p for p in assignment if out[p] != assignment[p]}
    assert moved == {"layers.2", "layers.2.act", "net"}, moved
    assert out["layers.2.attn"] == 1 and out["net.1"] == 1  # children keep their ranks
    # An in-layer cut on the way out (own and attention on rank 0, MLP on rank 1) is already right.
    forward = {path: 0 for path, _ in body.named_modules()} | {"layers.0.mlp": 1, "layers.1": 1,
                                                                 "layers.1.attn": 1, "layers.1.mlp": 1}
    assert rehome_split_layers(body, forward) == forward


def test_a_module_with_children_outside_containers_stays_whole() -> None:
    inner = nn.Sequential(nn.Linear(2, 2))
    block = nn.Module()
    block.a, block.b = nn.Linear(2, 2), nn.Linear(2, 2)
    root = nn.Module()
    root.block, root.inner = block, inner
    tree = lower(root)
    assert not _opened(tree, "block")  # its own forward interleaves a and b: kept whole
    assert _opened(tree, "inner")


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward takes ``seconds`` (a head whose backward outweighs its forward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _busy(ctx.seconds)
        return grad, None


class _SlowLinear(nn.Linear):
    """A layer of 5 ms forward (when ``timed``) and next to no backward."""

    timed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.timed:
            _busy(0.005)
        return super().forward(x)


class _SlowHead(nn.Linear):
    """A head that is free forward and takes ``seconds`` backward."""

    seconds = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(_SlowBackward.apply(x, self.seconds))


class _HeavyBackwardNet(nn.Module):
    """Four layers of 5 ms forward each; a head that is free forward and takes 100 ms backward."""

    def __init__(self, timed: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_SlowLinear(8, 8) for _ in range(4))
        for layer in self.layers:
            layer.timed = timed
        self.head = _SlowHead(8, 8)
        self.head.seconds = 0.1 if timed else 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _rank1(part: Any) -> list[str]:
    return [p for p, r in part.assignment.items() if r == 1 and p]


def test_the_traced_backward_counts_where_the_forward_alone_would_not() -> None:
    net = _HeavyBackwardNet()
    x = torch.randn(2, 8)
    kept = torch.ones_like(net.layers[0].weight)
    net.layers[0].weight.grad = kept  # a gradient the user holds before the first step
    pending: list[tuple[Any, Any]] = []

    def body() -> None:
        pending.append((net(x).sum(), None))  # what model.backward(loss) records while tracing

    def taken() -> list[tuple[Any, Any]]:
        out = pending[:]
        pending.clear()
        return out

    forward_only = trace(net, body)
    pending.clear()
    both = trace(net, body, backward=taken)
    assert forward_only.backward_time == {}
    assert both.backward_time["head"] >= 0.1 > both.backward_time["layers.0"]
    # Forward alone: the head weighs nothing, the cut splits the layers 2 | 2 + head. With the
    # backward the head (100 ms) outweighs the four layers (20 ms): it goes to rank 1 alone.
    assert _rank1(partition_tree(lower(net, forward_only), 2, memory_weight=0.0)) == ["layers.2", "layers.3", "head"]
    assert _rank1(partition_tree(lower(net, both), 2, memory_weight=0.0)) == ["head"]
    # The traced backward leaves no gradient behind and puts back the one that was there.
    assert net.layers[0].weight.grad is kept and torch.equal(kept, torch.ones_like(kept))
    assert all(p.grad is None for name, p in net.named_parameters() if name != "layers.0.weight")


def test_a_backward_that_fails_leaves_forward_times() -> None:
    net = _Net()

    def body() -> None:
        net(torch.randn(2, 8))

    tr = trace(net, body, backward=lambda: [(torch.zeros(()), None)])  # a "loss" without grad
    assert tr.backward_time == {} and tr.time["head"] > 0


def _auto_heavy_head() -> tuple[list[str], list[float], dict[str, torch.Tensor]]:
    import smp.torch as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": True, "comm_timeout": 60.0})
    torch.manual_seed(0)
    net = _HeavyBackwardNet()
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train(model: Any, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        model.backward(loss)
        return loss

    losses = []
    for step in range(2):
        opt.zero_grad()
        losses.append(train(model, torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).reduce_mean().item())
        grads = {n: p.grad.clone() for n, p in model.local_named_parameters()}
        opt.step()
    rank1 = [p for p, r in model.partition_assignment.items() if r == 1 and p]
    return rank1, losses, grads


def test_automatic_partition_times_the_step_bodys_backward_and_keeps_the_numbers() -> None:
    (rank1, losses, grads0), (_, _, grads1) = run_ranks(_auto_heavy_head, 2, timeout=120)
    assert rank1 == ["head"]  # placed by its 100 ms backward (its forward is free)
    torch.manual_seed(0)
    net = _HeavyBackwardNet(timed=False)  # the same weights, without the waits
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ref = []
    for step in range(2):
        opt.zero_grad()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = sum(net(half).square().mean() for half in x.chunk(2)) / 2
        loss.backward()
        ref.append(loss.item())
        if step == 0:
            opt.step()
    assert losses == pytest.approx(ref, rel=1e-6)
    # The trace's backward left nothing in the first step's gradients: the last step's match.
    for name, g in {**grads0, **grads1}.items():
        torch.testing.assert_close(g, dict(net.named_parameters())[name].grad)


def test_a_forward_out_of_memory_with_grad_is_traced_again_without() -> None:
    net = _Net()
    x = torch.randn(2, 8)

    def body() -> None:
        if torch.is_grad_enabled():
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (the test's)")
        net(x)

    tr = trace(net, body, backward=lambda: [])
    assert tr.backward_time == {} and tr.time["head"] > 0 and tr.last == "head"


def test_tracing_leaves_buffers_and_random_state_as_they_were() -> None:
    """The trace runs the step body several times on rank 0: BatchNorm statistics and the random
    generator (dropout) must be as before, or rank 0 would train on other numbers than one process."""
    net = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    x = torch.randn(16, 8)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    rng = torch.get_rng_state()
    tr = trace(net, lambda: net(x))
    assert tr.time[""] > 0
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(torch.get_rng_state(), rng)
