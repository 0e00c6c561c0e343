"""A partial checkpoint (``local_state_dict()`` of model and optimizer, one file per rank) loaded where
the model is partitioned another way, as a full-model resume or a changed automatic partition gives:
loaded before the first step the model takes the saved partition (SMP v1); loaded after it, the
pipeline's files are joined and every rank takes what it owns now. Either way training continues
like one process."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tests.helpers.spawn import run_ranks
from tests.torch.zoo import MLP

CFG = {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0,
       "comm_timeout": 60.0}
FIRST = 3  # linear layers on rank 0 when saving (of 5); loading puts 1 there


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 12, generator=g), torch.randn(8, 5, generator=g)


def _place(net: MLP, first: int, set_partition: Any) -> None:
    linear = 0
    for layer in net.net:
        set_partition(layer, 0 if linear < first else 1)
        linear += isinstance(layer, torch.nn.Linear)


def _run(path: str, mode: str) -> dict[str, Any]:
    import smp.torch as smp

    smp.init(CFG)
    torch.manual_seed(0)
    net = MLP()
    model = smp.DistributedModel(net)
    _place(net, FIRST if mode == "save" else 1, smp.set_partition)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    def load(m: Any, o: Any) -> None:
        saved = smp.load(path, partial=True)
        m.load_state_dict(saved["model"])
        o.load_state_dict(saved["optimizer"])

    if mode == "before first step":
        load(model, opt)
    elif mode == "in a post-partition hook":
        model.register_post_partition_hook(load)
    steps = range(3) if mode == "save" else range(3, 6)
    losses = []
    for step in steps:
        opt.zero_grad()
        losses.append(train_step(model, *_data(step)).reduce_mean().item())
        opt.step()
    if mode == "save":
        smp.save({"model": model.local_state_dict(), "optimizer": opt.local_state_dict()}, path, partial=True)
    return {"losses": losses, "owners": sorted(set(model.partition_assignment.values())),
            "rank0_linears": sum(1 for n, r in model.partition_assignment.items() if r == 0 and n.startswith("net.")
                                 and isinstance(net.get_submodule(n), torch.nn.Linear))}


def _reference() -> list[float]:
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    out = []
    for step in range(6):
        x, y = _data(step)
        opt.zero_grad()
        loss = sum(F.mse_loss(net(x[i:i + 4]), y[i:i + 4]) for i in (0, 4)) / 2
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def test_a_partial_checkpoint_loads_into_another_partition(tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt.pt")
    ref = _reference()
    saved = run_ranks(_run, 2, args=(path, "save"))
    torch.testing.assert_close(saved[0]["losses"], ref[:3], rtol=1e-5, atol=1e-6)
    before = run_ranks(_run, 2, args=(path, "before first step"))
    hook = run_ranks(_run, 2, args=(path, "in a post-partition hook"))
    assert before[0]["rank0_linears"] == FIRST, "loaded before the first step: the saved partition is taken"
    assert hook[0]["rank0_linears"] == 1, "loaded after partitioning: the model keeps its own"
    for mode, ranks in (("before", before), ("hook", hook)):
        for rank, got in enumerate(ranks):
            torch.testing.assert_close(got["losses"], ref[3:], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, r=rank, w=mode: f"{w}, rank {r}: {m}")
