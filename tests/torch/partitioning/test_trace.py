"""The partitioner's trace: the step body's work after the model returns counts where it runs."""

from __future__ import annotations

import time

import torch
from smp.torch.partitioning.trace import lower, trace
from torch import nn

from smp.partition import partition_tree


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
