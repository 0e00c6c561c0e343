"""``optimizer.clip_master_grads`` under tensor parallelism: the global norm counts each TP shard and each
replicated parameter once, on every pipeline rank, in float32 and in fp16 (fp32 masters)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.spawn import run_ranks
from tests.torch.test_mixed_precision import DTYPES, LR, MICROBATCHES, _data


def _tp(precision: str, pp: int) -> dict[str, Any]:
    import smp.torch as smp

    smp.init({"tensor_parallel_degree": 2, "pipeline_parallel_degree": pp, "microbatches": MICROBATCHES,
              "ddp": True, "auto_partition": False, "default_partition": 0, "fp16": precision == "fp16",
              "comm_timeout": 60.0})
    torch.manual_seed(0)
    with smp.tensor_parallelism():
        net = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 12))
    net.append(torch.nn.Tanh())
    net.append(torch.nn.Linear(12, 5))  # replicated over the TP group
    model = smp.DistributedModel(net)
    if pp > 1:
        smp.set_partition(net[4], 1)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), static_loss_scale=256.0)

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    losses, norms = [], []
    for step in range(3):
        opt.zero_grad()
        losses.append(float(train_step(model, *_data(step, smp.dp_rank())).reduce_mean()))
        norms.append(opt.clip_master_grads(0.1))
        opt.step()
    return {"coord": (smp.pp_rank(), smp.tp_rank()), "dp": smp.dp_rank(), "losses": losses, "norms": norms}


def _tp_reference(precision: str) -> dict[str, Any]:
    dtype = DTYPES[precision]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 12), torch.nn.Tanh(),
                              torch.nn.Linear(12, 5)).to(dtype)
    masters = [p.detach().float().clone().requires_grad_() for p in net.parameters()]
    opt = torch.optim.SGD(masters, lr=LR)
    losses: list[list[float]] = [[], []]
    norms = []
    scale = 256.0 if precision == "fp16" else 1.0
    for step in range(3):
        net.zero_grad(set_to_none=True)
        for r in range(2):  # the two TP ranks' own batches, averaged over the DP group
            x, y = _data(step, r)
            mb = [F.mse_loss(net(xm.to(dtype)).float(), ym) for xm, ym in zip(x.chunk(2), y.chunk(2))]
            for loss in mb:
                (loss * scale / 4).backward()
            losses[r].append(float(sum(mb).detach() / 2))
        for m, p in zip(masters, net.parameters()):
            m.grad = p.grad.float() / scale
        norms.append(float(torch.nn.utils.clip_grad_norm_(masters, 0.1)))
        opt.step()
        with torch.no_grad():
            for p, m in zip(net.parameters(), masters):
                p.copy_(m)
    return {"losses": losses, "norms": norms}


@pytest.mark.slow
@pytest.mark.parametrize("precision,pp", [("fp32", 1), ("fp16", 2)])
def test_clip_master_grads_takes_the_global_norm_under_tp(precision: str, pp: int) -> None:
    world = 2 * pp
    ranks = run_ranks(_tp, world, args=(precision, pp), timeout=240)
    ref = _tp_reference(precision)
    # TP sums partial products in a different order than one dense matmul: within a few 16-bit ulps.
    tol = {"fp32": 1e-5, "fp16": 5e-3}[precision]
    for r in ranks:
        torch.testing.assert_close(r["norms"], ref["norms"], rtol=tol, atol=0)
        torch.testing.assert_close(r["losses"], ref["losses"][r["dp"]], rtol=tol, atol=0)
    assert len({tuple(r["norms"]) for r in ranks}) == 1, "every rank clips with the same norm"
    assert all(n > 0.1 for n in ref["norms"]) and not any(math.isnan(n) for n in ref["norms"])
