"""SMP v1 model methods scripts call, on 2 pipeline ranks: ``is_local_parameter`` /
``is_local_buffer`` and ``load_saved_partition`` (the saved cut is used, training matches one
process); ``join`` without ddp. One launch (smp.reset between the two models)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.spawn import run_ranks

PP2 = {"pipeline_parallel_degree": 2, "auto_partition": False, "default_partition": 0, "microbatches": 2,
       "comm_timeout": 60.0}
LR = 0.1


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 8)
        self.tail = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(torch.tanh(self.head(self.norm(x))))


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _surface() -> dict[str, Any]:
    import smp.torch as smp

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    smp.init(PP2)
    torch.manual_seed(0)
    net = Net()
    model = smp.DistributedModel(net)
    smp.set_partition(net.tail, 1)
    out: dict[str, Any] = {"before": _error(lambda: model.is_local_parameter(net.head.weight))}
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    train_step(model, *_data(0))
    out["tensors"] = {n: model.is_local_parameter(p) for n, p in net.named_parameters()}
    out["names"] = {n: model.is_local_parameter(n) for n, _ in net.named_parameters()}
    out["prefixed"] = {n: model.is_local_parameter(n) for n, _ in model.named_parameters()}  # "module.head.weight"
    out["buffers"] = {n: model.is_local_buffer(n) for n, _ in net.named_buffers()}
    out["unknown"] = _error(lambda: model.is_local_parameter("head.wieght"))
    out["foreign"] = _error(lambda: model.is_local_parameter(torch.zeros(3)))
    out["type"] = _error(lambda: model.is_local_parameter(3))
    out["join"] = _error(lambda: model.join().__enter__())
    out["no_v1_path"] = not hasattr(net, "module")  # only ddp: True gets SMP v1's model.module.module
    saved = model.partition_assignment
    out["after_step"] = _error(lambda: model.load_saved_partition({p: 0 for p in saved}))
    smp.reset()

    smp.init(PP2)
    torch.manual_seed(0)
    net = Net()
    model = smp.DistributedModel(net)
    out["bad_rank"] = _error(lambda: model.load_saved_partition({**saved, "tail": 5}))
    out["bad_paths"] = _error(lambda: model.load_saved_partition({"body": 0}))
    model.load_saved_partition(saved)
    smp.set_partition(net.head, 1)  # ignored: the saved partition wins (SMP v1)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    losses = []
    for step in range(3):
        opt.zero_grad()
        losses.append(train_step(model, *_data(step)).reduce_mean().item())
        opt.step()
    out["same_partition"] = model.partition_assignment == saved
    out["losses"] = losses
    out["local"] = sorted(n for n, _ in model.local_named_parameters())
    smp.reset()
    return out


def _reference_losses() -> list[float]:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    losses = []
    for step in range(3):
        x, y = _data(step)
        opt.zero_grad()
        total = 0.0
        for mb in (slice(0, 4), slice(4, 8)):
            loss = F.mse_loss(net(x[mb]), y[mb])
            (loss / 2).backward()
            total += loss.item() / 2
        losses.append(total)
        opt.step()
    return losses


def test_v1_model_surface_on_two_pipeline_ranks() -> None:
    ranks = run_ranks(_surface, 2, timeout=180)
    owner = {"norm": 0, "head": 0, "tail": 1}
    for rank, out in enumerate(ranks):
        assert out["before"].startswith("ModelNotPartitionedError"), out["before"]
        expected = {f"{m}.{w}": owner[m] == rank for m in ("norm", "head", "tail") for w in ("weight", "bias")}
        assert out["tensors"] == expected and out["names"] == expected
        assert out["prefixed"] == {f"module.{n}": v for n, v in expected.items()}
        assert out["buffers"] == {f"norm.{b}": rank == 0 for b in ("running_mean", "running_var",
                                                                     "num_batches_tracked")}
        assert "no parameter of this model has that name" in out["unknown"] and "head.weight" in out["unknown"]
        assert out["foreign"].startswith("SMPError") and "shape (3,)" in out["foreign"]
        assert out["type"].startswith("TypeError") and "int" in out["type"]
        assert out["join"].startswith("DDPNotEnabledError") and "ddp: True" in out["join"]
        assert out["no_v1_path"]
        assert "before the first smp.step" in out["after_step"]
        assert "[0, 2)" in out["bad_rank"] and "'tail': 5" in out["bad_rank"]
        assert out["bad_paths"].startswith("SMPError: load_saved_partition: ") and "other modules than this model has" in out["bad_paths"]
        assert out["same_partition"]
        assert out["local"] == (["head.bias", "head.weight", "norm.bias", "norm.weight"] if rank == 0
                                else ["tail.bias", "tail.weight"])
        torch.testing.assert_close(out["losses"], _reference_losses(), msg=f"losses on rank {rank}")


def _hooks_at_pp1(load_path: str) -> dict[str, Any]:
    """SMP v1's load-in-hook at pipeline_parallel_degree 1: the model is partitioned when created here,
    yet a post-partition hook registered afterwards still runs once, in the first step, before its forward."""
    import smp.torch as smp

    smp.init({"microbatches": 1})  # BatchNorm: the one-process batch statistics
    torch.manual_seed(1)
    model = smp.DistributedModel(Net())
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=LR))
    saved = torch.load(load_path, weights_only=False)
    calls: list[str] = []

    def load(m: Any, o: Any) -> None:
        calls.append("partition")
        m.load_state_dict(saved["model"])
        o.load_state_dict(saved["optimizer"])

    model.register_post_partition_hook(load)

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append("forward")
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    losses = []
    for step in range(2):
        opt.zero_grad()
        losses.append(train_step(model, *_data(step)).reduce_mean().item())
        opt.step()
    return {"calls": calls, "losses": losses}


def test_a_post_partition_hook_registered_after_creation_runs_at_pp1(tmp_path: Any) -> None:
    """One process trains a step on batch 0, saves by name (what smp's optimizer.state_dict() returns), then
    trains on batches 0 and 1: the hook-loaded smp run must repeat those two losses."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    names = [n for n, _ in net.named_parameters()]

    def train(step: int) -> float:
        opt.zero_grad()
        loss = F.mse_loss(net(_data(step)[0]), _data(step)[1])
        loss.backward()
        opt.step()
        return loss.item()

    train(0)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": names} for g in opt.param_groups]
    state = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in net.named_parameters()}
    torch.save({"model": {k: v.clone() for k, v in net.state_dict().items()},
                "optimizer": {"state": state, "param_groups": groups, "_smp_by_name": True}}, tmp_path / "one.pt")
    expected = [train(0), train(1)]
    got = run_ranks(_hooks_at_pp1, 1, args=(str(tmp_path / "one.pt"),))[0]
    assert got["calls"][:2] == ["partition", "forward"] and got["calls"].count("partition") == 1, got["calls"]
    torch.testing.assert_close(got["losses"], expected, rtol=1e-5, atol=1e-6)
