"""Backward of a reference (Note [backward of a reference] in frontends/torch/engine/engine.py).

When the loss is computed from the output of a module on another rank (an SMP v1 step body with
the model's head on the last rank), ``model.backward(loss)`` starts where the loss lives: no hop
back to the leader to hold it, no acknowledgement round trip, and the loss value comes back with
the gradients. Checked in one 2-rank launch, each step body against one process (losses, outputs
and gradients bitwise): the loss as SMP v1 scripts write it (also: the chain recorded is 0 -> 1,
and from the second step on rank 1 sends one message per microbatch, the gradients), the loss read before backward, a scaled loss, and ``model.backward(out,
grad)`` on a non-scalar output with its gradient given.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F

from tests.helpers.spawn import run_ranks
from tests.torch.engine.test_calls_ahead import BATCH, CLASSES, MICROBATCHES, SEQ, D, Loop

# The model: Loop(2), its input layer and block 0 on rank 0, blocks 1-2 and the head on rank 1.
STEPS = 3
BODIES = ("loss", "read", "scaled", "grad")


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(BATCH, SEQ, D, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g))
            for _ in range(STEPS)]


def _grad_of(out: torch.Tensor) -> torch.Tensor:
    """The gradient the "grad" body gives for an output (fixed, not read from the output's value)."""
    return torch.linspace(-1, 1, out.numel()).reshape(out.shape)


def _microbatch(body: str, out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the step body backpropagates (and the gradient it gives) for one microbatch."""
    if body == "grad":
        return out, _grad_of(out)
    loss = F.cross_entropy(out, y)
    return (loss * 0.5, None) if body == "scaled" else (loss, None)


def _reference(body: str) -> list[tuple[list[torch.Tensor], dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    model = Loop(2)
    steps = []
    for x, y in _data():
        model.zero_grad()
        results = []
        for xc, yc in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
            root, grad = _microbatch(body, model(xc), yc)
            root.backward(grad)
            results.append(root.detach())
        # smp averages the microbatches' gradients when the step ends (their sum, divided once).
        steps.append((results, {n: p.grad / MICROBATCHES for n, p in model.named_parameters()}))
    return steps


def _train(body: str) -> dict[str, Any]:
    import smp.torch as smp
    from smp.torch.engine import wire

    smp.init({"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES, "auto_partition": False,
              "default_partition": 0})
    torch.manual_seed(0)
    net = Loop(2)
    model = smp.DistributedModel(net)
    for module in (net.blocks[1], net.blocks[2], net.head):
        smp.set_partition(module, 1)

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        root, grad = _microbatch(body, model(x), y)
        if body == "read":
            assert float(root) > 0  # the loss read before backward: its value comes to this rank first
        model.backward(root, grad)
        return root

    kinds: Counter[int] = Counter()
    send = wire.Transport.send
    out: dict[str, Any] = {"steps": []}
    for step, (x, y) in enumerate(_data()):
        model.zero_grad()
        if step == STEPS - 1:
            def counted(self: Any, dst: int, kind: int, *args: Any, **kwargs: Any) -> None:
                kinds[kind] += 1
                send(self, dst, kind, *args, **kwargs)

            wire.Transport.send = counted  # type: ignore[method-assign]
        results = train_step(model, x, y)
        out["steps"].append(([r.detach().clone() for r in results],
                             {n: p.grad.clone() for n, p in model.local_named_parameters() if p.grad is not None}))
    wire.Transport.send = send  # type: ignore[method-assign]
    names = {v: k for k, v in vars(wire).items() if k.isupper() and isinstance(v, int) and 0 < v < 20}
    out["kinds"] = {names[k]: n for k, n in kinds.items()}
    out["chain"] = list(next(iter(model.plans.values())).chain) if model.plans else []
    smp.reset()
    return out


def _ranks() -> dict[str, Any]:
    return {body: _train(body) for body in BODIES}


def test_backward_starts_where_the_loss_lives_and_matches_one_process() -> None:
    out = run_ranks(_ranks, 2, timeout=240)
    for body in BODIES:
        ref = _reference(body)
        for step in range(STEPS):
            results = out[0][body]["steps"][step][0]
            for got, want in zip(results, ref[step][0]):
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{body} step {step}")
            for r in (0, 1):
                grads = out[r][body]["steps"][step][1]
                assert grads, (body, r)
                for name, g in grads.items():
                    torch.testing.assert_close(g, ref[step][1][name], rtol=0, atol=0, msg=f"{body} {step} {name}")
    loss = out[0]["loss"]
    assert loss["chain"] == [0, 1], loss["chain"]
    # Rank 1 on the last step: per microbatch only the gradients, then its STOP. No reply to the
    # calls (the one that opens its run included), no acknowledgement, no fetch of the loss.
    assert out[1]["loss"]["kinds"] == {"BWD_REP": MICROBATCHES, "STOP": 1}, out[1]["loss"]["kinds"]
    assert "END_RUN" not in loss["kinds"] and "FETCH" not in loss["kinds"], loss["kinds"]
