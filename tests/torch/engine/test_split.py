"""A backward in two parts (engine/split.py) gives exactly one backward's gradients, or declines.

One process, real autograd graphs: an unmodified Hugging Face Llama's decoder layers, norm and head
(the second half of a pipeline), a weight used twice, a module under non-reentrant activation
checkpointing; each against a copy of the same module run with one ``backward``, compared bit for
bit. The weight pass must not have run before `WeightGrads.run` (no weight has a gradient after the
input pass), and parameter hooks (data parallelism's) fire in it. Graphs that must not split come
back as None with nothing run.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from smp.torch.engine.split import backward_input
from torch import nn


def _same_grads(a: nn.Module, b: nn.Module) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert (pa.grad is None) == (pb.grad is None), name
        if pa.grad is not None:
            assert torch.equal(pa.grad, pb.grad), (name, (pa.grad - pb.grad).abs().max())


def _llama_tail() -> tuple[nn.Module, Any]:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")

    def run(m: nn.Module, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos = m.model.rotary_emb(h, torch.arange(h.shape[1])[None])
        for layer in m.model.layers:  # how the model's own forward loops over them
            out = layer(h, position_embeddings=pos)
            h = out[0] if isinstance(out, tuple) else out
        logits = m.lm_head(m.model.norm(h))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    return model, run


def test_llama_layers_and_head_split_to_exactly_one_backward() -> None:
    model, run = _llama_tail()
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):  # the second microbatch accumulates onto the first's gradients
        h = torch.randn(2, 8, 32, generator=g)
        labels = torch.randint(0, 256, (2, 8), generator=g)
        x, y = h.clone().requires_grad_(), h.clone().requires_grad_()
        run(model, x, labels).backward()
        loss = run(twin, y, labels)
        before = {n: None if p.grad is None else p.grad.clone() for n, p in twin.named_parameters()}
        got = backward_input([loss], [torch.ones_like(loss)], [y])
        assert got is not None
        (dy,), weights = got
        assert y.grad is None  # returned, not accumulated
        for n, p in twin.named_parameters():  # the input pass left every weight alone
            assert (p.grad is None and before[n] is None) or torch.equal(p.grad, before[n]), n
        weights.run()
        assert torch.equal(dy, x.grad)
    _same_grads(model, twin)


def test_weight_used_twice_and_parameter_hooks() -> None:
    lin = nn.Linear(8, 8)
    twin = copy.deepcopy(lin)
    seen: list[str] = []
    for name, p in twin.named_parameters():
        p.register_hook(lambda grad, name=name: seen.append(name) or grad)
    x = torch.randn(3, 8, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    lin(torch.relu(lin(x))).sum().backward()
    out = twin(torch.relu(twin(y)))
    got = backward_input([out], [torch.ones_like(out)], [y])
    assert got is not None
    (dy,), weights = got
    assert not seen
    weights.run()
    assert sorted(seen) == ["bias", "weight"]
    assert torch.equal(dy, x.grad)
    _same_grads(lin, twin)


def test_activation_checkpointing() -> None:
    block = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    twin = copy.deepcopy(block)
    x = torch.randn(4, 8, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    torch_checkpoint.checkpoint(block, x, use_reentrant=False).pow(2).sum().backward()
    out = torch_checkpoint.checkpoint(twin, y, use_reentrant=False).pow(2).sum()
    got = backward_input([out], [torch.ones_like(out)], [y])
    assert got is not None
    got[1].run()
    assert torch.equal(got[0][0], x.grad)
    _same_grads(block, twin)


class _Fetched(torch.autograd.Function):
    """Like the engine's fetch of a value another rank holds: an anchor leaf makes it part of the
    graph, and its backward (which would send a message) must run exactly once."""

    runs = 0

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:  # noqa: ARG004
        _Fetched.runs += 1
        return None, grad


def test_graphs_that_must_not_split_come_back_none_with_nothing_run() -> None:
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    anchor = torch.empty(0, requires_grad=True)
    cases = {
        # nothing received needs a gradient: the whole backward is the weights'
        "input without grad": ([lin(torch.randn(2, 4))], [torch.randn(2, 4)]),
        # an output that does not depend on what was received
        "output of weights only": ([lin(x), lin.weight * 2], [x]),
        # a fetched value on its own (its anchor is a leaf that is no weight)
        "fetched value": ([lin(x) + _Fetched.apply(anchor, torch.zeros(2, 4))], [x]),
        # a function of the user's between the input path and a weight: the weight pass would run it again
        "function before a weight": ([x @ _Fetched.apply(anchor, lin.weight)], [x]),
    }
    for what, (outs, inputs) in cases.items():
        assert backward_input(outs, [torch.ones_like(o) for o in outs], inputs) is None, what
        assert lin.weight.grad is None and x.grad is None and _Fetched.runs == 0, what
