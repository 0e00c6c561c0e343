"""Calls that do not wait (Note [calls that do not wait] in frontends/torch/engine/requester.py).

From the second step on, a caller's calls inside an owner's open run that repeat the last step's
arguments leave without waiting for their reply, queued together into one message, and the owner
replies to none of them unless its reply differs from the one the caller expects; one
acknowledgement ends the run. So the messages a microbatch costs do not grow with the number of
layers the loop runs on the other rank, and a reply that differs still fails the step with the
error that names the fix.

Both are checked in one launch (2 ranks): a ModuleList loop with 2 and with 6 blocks on rank 1
(messages per step by each rank, after two steps; losses and gradients equal to one process), and
a rank-1 module whose output shape follows the values of its input.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.spawn import run_ranks
from tests.torch.zoo import Block

D, SEQ, BATCH, MICROBATCHES, CLASSES = 8, 4, 4, 2, 3


class Loop(nn.Module):
    """Block 0 on rank 0, the other ``remote`` blocks on rank 1 (placed by the test), head on rank 0."""

    def __init__(self, remote: int) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block(D) for _ in range(1 + remote))
        self.head = nn.Linear(D, CLASSES)
        self.register_buffer("mask", torch.triu(torch.full((SEQ, SEQ), float("-inf")), 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h, self.mask)
        return self.head(h.mean(1))


class _Keep(nn.Module):
    """Keeps the first positions whose input sums are positive: the output shape follows the values."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        n = 1 + int((h.sum((0, 2)) > 0).sum())
        return h[:, :n]


class ShapeByValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(D, D)
        self.keep = _Keep()
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.keep(self.first(x)).mean(1))


def _data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, SEQ, D, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g))
            for _ in range(steps)]


def _reference(remote: int, steps: int) -> list[tuple[list[float], dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    model = Loop(remote)
    out = []
    for x, y in _data(steps):
        model.zero_grad()
        losses = [F.cross_entropy(model(xc), yc) for xc, yc in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES))]
        (sum(losses) / MICROBATCHES).backward()
        out.append(([float(v.detach()) for v in losses], {n: p.grad.clone() for n, p in model.named_parameters()}))
    return out


def _counting(counts: Counter[int]) -> Any:
    """Count the pipeline messages this rank sends, by destination."""
    from smp.torch.engine import wire

    send = wire.Transport.send

    def counted(self: Any, dst: int, *args: Any, **kwargs: Any) -> None:
        counts[dst] += 1
        send(self, dst, *args, **kwargs)

    wire.Transport.send = counted  # type: ignore[method-assign]
    return send


def _loop(remote: int, steps: int) -> dict[str, Any]:
    import smp.torch as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES, "auto_partition": False,
              "default_partition": 0})
    torch.manual_seed(0)
    net = Loop(remote)
    model = smp.DistributedModel(net)
    for b in net.blocks[1:]:
        smp.set_partition(b, 1)

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    counts: Counter[int] = Counter()
    out: dict[str, Any] = {"steps": [], "messages": []}
    for step, (x, y) in enumerate(_data(steps)):
        model.zero_grad()
        if step == steps - 1:
            original = _counting(counts)
        losses = train_step(model, x, y)
        out["steps"].append(([float(v) for v in losses],
                             {n: p.grad.clone() for n, p in model.local_named_parameters() if p.grad is not None}))
    from smp.torch.engine import wire

    wire.Transport.send = original  # type: ignore[method-assign]
    out["messages"] = sum(counts.values())
    smp.reset()
    return out


def _first_error(pp: int, net: nn.Module, placed: list[tuple[nn.Module, int]],
                 steps: Callable[[Callable[[torch.Tensor, torch.Tensor], Any]], None]) -> str:
    """Train ``net`` split over ``pp`` ranks (``placed``: module -> pp_rank; the rest on 0) through
    ``steps(train_step)``, and return the first error as text ("no error" without one)."""
    import smp.torch as smp

    smp.init({"pipeline_parallel_degree": pp, "microbatches": MICROBATCHES, "auto_partition": False,
              "default_partition": 0, "comm_timeout": 20})
    model = smp.DistributedModel(net)
    for module, rank in placed:
        smp.set_partition(module, rank)

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    try:
        steps(lambda x, y: train_step(model, x, y))
    except Exception as e:  # noqa: BLE001 - the error is the result
        return f"{type(e).__name__}: {e}"
    finally:
        smp.reset()
    return "no error"


def _shape_by_value() -> str:
    torch.manual_seed(0)
    net = ShapeByValue()
    x = torch.randn(BATCH, SEQ, D)
    y = torch.zeros(BATCH, dtype=torch.long)
    with torch.no_grad():
        net.first.weight.copy_(torch.eye(D))
        net.first.bias.zero_()
    x_few = -x.abs()  # no positive position: one kept
    x_few[:, 0] = 1.0
    x_all = x.abs()  # every position kept

    def steps(train_step: Callable[[torch.Tensor, torch.Tensor], Any]) -> None:
        train_step(x_few, y)
        train_step(x_all, y)  # the same argument shapes, another output shape

    return _first_error(2, net, [(net.first, 1), (net.keep, 1)], steps)


def _ranks(steps: int) -> dict[str, Any]:
    return {"loop2": _loop(2, steps), "loop6": _loop(6, steps), "shape": _shape_by_value()}


def test_messages_do_not_grow_with_remote_layers_and_a_differing_reply_fails() -> None:
    steps = 3
    out = run_ranks(_ranks, 2, args=(steps,), timeout=180)
    for remote in (2, 6):
        ref = _reference(remote, steps)
        for step in range(steps):
            losses = out[0][f"loop{remote}"]["steps"][step][0]
            assert losses == ref[step][0], (remote, step, losses, ref[step][0])
            for r in (0, 1):
                grads = out[r][f"loop{remote}"]["steps"][step][1]
                assert grads, (remote, r)
                for name, g in grads.items():
                    torch.testing.assert_close(g, ref[step][1][name], rtol=0, atol=0, msg=f"{remote} {step} {name}")
    for r in (0, 1):
        few, many = out[r]["loop2"]["messages"], out[r]["loop6"]["messages"]
        # Without queueing and quiet replies each extra remote block costs two messages per microbatch.
        assert few == many, f"rank {r} sent {few} messages with 2 remote blocks and {many} with 6"
    assert out[0]["shape"].startswith("SMPError"), out[0]["shape"]
    assert "other shapes or structure" in out[0]["shape"] and "fast_mode" in out[0]["shape"], out[0]["shape"]
    assert out[1]["shape"] != "no error", out[1]["shape"]


class _Detour(nn.Module):
    """On rank 1; from the step its flag is set, it also calls ``side`` (on rank 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.side = nn.Linear(D, D)
        self.use_side = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.lin(h)
        return self.side(h) if self.use_side else h


class Detour(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.a = _Detour()
        self.b = nn.Linear(D, D)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.a(self.inp(x))).mean(1))


def _detour() -> str:
    """Two steps as recorded, then a step where the call that opens rank 1's run calls rank 2 too."""
    torch.manual_seed(0)
    net = Detour()
    x, y = _data(1)[0]

    def steps(train_step: Callable[[torch.Tensor, torch.Tensor], Any]) -> None:
        train_step(x, y)
        train_step(x, y)
        net.a.use_side = True
        train_step(x, y)

    return _first_error(3, net, [(net.a, 1), (net.b, 1), (net.a.side, 2)], steps)


def test_a_call_that_now_reaches_a_third_rank_fails_with_the_fix() -> None:
    """Rank 1 serves messages while its module waits for rank 2; rank 0's END_RUN and calls sent
    after that call wait until it is done (Note [requests that wait for the one before]), so rank 1
    replies with the trail that differs and rank 0 fails with the error naming the fix."""
    out = run_ranks(_detour, 3, timeout=120, expect_failure=True)
    status, text = out[0]
    assert status == "ok", out[0]
    assert text.startswith("SMPError") and "called other pipeline ranks" in text and "fast_mode" in text, text
