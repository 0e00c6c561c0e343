"""``smp.amp.GradScaler``: an inf/NaN seen by one rank makes every rank skip the step and back off the
scale together; the steps around it match torch's own GradScaler in one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.spawn import run_ranks

STEPS, OVERFLOW_STEP, MICROBATCHES = 5, 2, 2
SCALER = {"init_scale": 2.0**10, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2}
POISONED = "tail.weight"  # lives on pp_rank 1 only


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 8)
        self.tail = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(torch.tanh(self.head(x)))


def _data(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)


def _poison(grad: torch.Tensor) -> None:
    grad[0, 0] = float("inf")  # what a real fp16 overflow leaves in one gradient


def _pipelined(world: int, overflow_at: tuple[int, int]) -> dict[str, Any]:
    import smp.torch as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES, "auto_partition": False,
              "default_partition": 0, "ddp": world > 2, "comm_timeout": 60.0})
    torch.manual_seed(0)
    net = Net()
    model = smp.DistributedModel(net)
    smp.set_partition(net.tail, 1)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = smp.amp.GradScaler(**SCALER)

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(scaler.scale(loss))  # runs on pp_rank 0 only: pp_rank 1 never calls scale()
        return loss

    scales, stepped = [], []
    for i in range(STEPS):
        opt.zero_grad()
        train_step(model, *_data(i, smp.dp_rank()))
        params = dict(model.local_named_parameters())
        if i == OVERFLOW_STEP and (smp.pp_rank(), smp.dp_rank()) == overflow_at:
            # After the step, so the data-parallel allreduce has not spread it: one rank alone sees it.
            _poison(params[POISONED].grad)
        before = {n: p.detach().clone() for n, p in params.items()}
        scaler.step(opt)
        scaler.update()
        stepped.append([not torch.equal(before[n], p) for n, p in params.items()])
        scales.append(float(scaler.get_scale()))
    return {"coord": (smp.pp_rank(), smp.dp_rank()), "scales": scales, "stepped": stepped,
            "params": {n: p.detach().clone() for n, p in model.local_named_parameters()}}


def _reference(replicas: int) -> dict[str, Any]:
    """One process, torch's GradScaler: the replicas' microbatches accumulated, the same poisoned step."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    scales = []
    for i in range(STEPS):
        opt.zero_grad()
        for r in range(replicas):
            x, y = _data(i, r)
            for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
                scaler.scale(F.mse_loss(net(xm), ym) / (MICROBATCHES * replicas)).backward()
        if i == OVERFLOW_STEP:
            _poison(dict(net.named_parameters())[POISONED].grad)
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
    return {"scales": scales, "params": {n: p.detach().clone() for n, p in net.named_parameters()}}


@pytest.mark.parametrize("world,overflow_at", [
    pytest.param(2, (1, 0), id="pp2-on-pp1"),
    pytest.param(4, (1, 1), id="pp2xdp2-on-one-replica", marks=pytest.mark.slow),
])
def test_an_overflow_on_one_rank_skips_the_step_everywhere(world: int, overflow_at: tuple[int, int]) -> None:
    ranks = run_ranks(_pipelined, world, args=(world, overflow_at))
    ref = _reference(world // 2)
    init, backoff = SCALER["init_scale"], SCALER["backoff_factor"]
    # Growth after every 2 clean steps (growth_interval), backoff at the poisoned one, growth
    # tracker restarted after it.
    assert ref["scales"] == [init, init * 2, init * 2 * backoff, init, init * 2]
    for r in ranks:
        assert r["scales"] == ref["scales"], r["coord"]
        assert [all(s) for s in r["stepped"]] == [i != OVERFLOW_STEP for i in range(STEPS)], r["coord"]
        assert not any(r["stepped"][OVERFLOW_STEP]), r["coord"]
        for name, value in r["params"].items():
            torch.testing.assert_close(value, ref["params"][name], msg=lambda m, n=name, c=r["coord"]: f"{c} {n}: {m}")
    assert sorted(r["coord"] for r in ranks) == sorted((pp, dp) for pp in range(2) for dp in range(world // 2))
