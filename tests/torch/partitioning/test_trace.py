"""The partitioner's trace: the step body's work after the model returns counts where it runs."""

from __future__ import annotations

import time

import pytest
import torch
from smp.torch.partitioning.trace import lower, trace
from torch import nn

from smp.partition import ModuleTree, partition_tree


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


def test_a_module_with_children_outside_containers_stays_whole() -> None:
    inner = nn.Sequential(nn.Linear(2, 2))
    block = nn.Module()
    block.a, block.b = nn.Linear(2, 2), nn.Linear(2, 2)
    root = nn.Module()
    root.block, root.inner = block, inner
    tree = lower(root)
    assert not _opened(tree, "block")  # its own forward interleaves a and b: kept whole
    assert _opened(tree, "inner")
