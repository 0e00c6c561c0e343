"""``model.join()`` (uneven batch counts across DP replicas) against one process, and SMP v1's
``model.module.module`` path under ``ddp: True``. One launch of 3 DP ranks (smp.reset between runs),
and pp=2 x dp=2 on 4 ranks."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.spawn import run_ranks

DP3 = {"pipeline_parallel_degree": 1, "ddp": True, "microbatches": 2, "comm_timeout": 60.0}
PP2_DP2 = {**DP3, "pipeline_parallel_degree": 2, "auto_partition": False, "default_partition": 0}
COUNTS = [2, 4, 3]  # batches per DP rank: rank 1 trains longest, rank 0 stops first
PP_COUNTS = [3, 2]
LR = 0.1


class Net(nn.Module):
    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4) if norm else nn.Identity()
        self.head = nn.Linear(4, 8)
        self.tail = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(torch.tanh(self.head(self.norm(x))))


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 4, generator=g) + rank, torch.randn(8, 2, generator=g)


def _train(divide: bool, norm: bool, throw: bool = False, cfg: dict[str, Any] = DP3,
           counts: list[int] = COUNTS, fp16: bool = False) -> dict[str, Any]:
    import smp.torch as smp

    smp.init({**cfg, "fp16": fp16})
    torch.manual_seed(0)
    net = Net(norm)
    model = smp.DistributedModel(net)
    if cfg["pipeline_parallel_degree"] > 1:
        smp.set_partition(net.tail, 1)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   **({"static_loss_scale": 128.0} if fp16 else {}))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    losses = []
    error = None
    try:
        with model.join(divide_by_initial_world_size=divide, throw_on_early_termination=throw):
            for step in range(counts[smp.dp_rank()]):
                opt.zero_grad()
                losses.append(train_step(model, *_data(step, smp.dp_rank())).reduce_mean().item())
                if fp16:
                    opt.clip_master_grads(1e3)  # a collective of the replicas still training
                opt.step()
    except smp.exceptions.SMPError as e:
        error = f"{type(e).__name__}: {e}"
    masters = opt.master_weights.masters if fp16 else {}
    out = {"losses": losses, "error": error,
           "masters_hold_the_model": all(torch.equal(masters[id(p)].to(p.dtype), p) for p in model.local_parameters()
                                         if fp16),
           "params": {n: p.detach().clone() for n, p in model.local_named_parameters()},
           "buffers": {n: b.detach().clone() for n, b in model.local_named_buffers()}}
    smp.reset()
    return out


def _v1_path() -> dict[str, Any]:
    import smp.torch as smp

    smp.init(DP3)
    torch.manual_seed(0)
    net = Net(norm=False)
    model = smp.DistributedModel(net)
    x = torch.randn(3, 4)
    out: dict[str, Any] = {
        "same_child": model.module.module.tail is net.tail,
        "same_output": torch.equal(model.module.module(x), net(x)),
        "state_dict": sorted(net.state_dict()),
        "children": sorted(n for n, _ in net.named_children()),
    }
    model.module.module.flag = 3  # a write reaches the model
    out["flag"] = net.flag
    try:
        model.module.module.module.tail  # noqa: B018 - SMP v1's fp16 path: three levels
    except AttributeError as e:
        out["third"] = str(e)
    out["pickled"] = pickle.loads(pickle.dumps(net)).module
    twin = copy.deepcopy(net)
    out["deepcopy"] = twin.module.tail is twin.tail and twin.module.tail is not net.tail
    smp.reset()
    return out


def _runs() -> dict[str, Any]:
    return {"initial": _train(divide=True, norm=False), "training": _train(divide=False, norm=False),
            "norm": _train(divide=True, norm=True), "throw": _train(divide=True, norm=False, throw=True),
            "v1_path": _v1_path()}


def _reference(divide: bool, norm: bool, counts: list[int] = COUNTS) -> dict[str, Any]:
    """One process: each step, the replicas still training average their microbatch gradients
    (divided by 3, or by their number), and BatchNorm statistics follow the protocol in join.py:
    at a step's start every replica takes the highest training rank's, then updates its own."""
    torch.manual_seed(0)
    net = Net(norm)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    n = len(counts)
    stats = {r: copy.deepcopy(net.norm) for r in range(n)}
    losses: dict[int, list[float]] = {r: [] for r in range(n)}
    for step in range(max(counts)):
        active = [r for r in range(n) if counts[r] > step]
        opt.zero_grad()
        source = copy.deepcopy(stats[max(active)].state_dict())
        for r in active:
            x, y = _data(step, r)
            stats[r].load_state_dict(source)
            total = 0.0
            for mb in (slice(0, 4), slice(4, 8)):
                loss = F.mse_loss(net(x[mb]), y[mb])
                (loss / 2).backward()  # the microbatch average
                total += loss.item() / 2
                stats[r].train()(x[mb])
            losses[r].append(total)
        with torch.no_grad():
            for p in net.parameters():
                p.grad /= n if divide else len(active)
        opt.step()
    last = counts.index(max(counts))
    buffers = {f"norm.{n}": b for n, b in stats[last].named_buffers()} if norm else {}
    return {"losses": losses, "params": dict(net.named_parameters()), "buffers": buffers}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_runs, 3, timeout=240)


def test_join_trains_uneven_replicas_like_one_process(ranks: list[dict[str, Any]]) -> None:
    for name, divide, norm in (("initial", True, False), ("training", False, False), ("norm", True, True)):
        ref = _reference(divide, norm)
        for rank, out in enumerate(ranks):
            run = out[name]
            assert run["error"] is None, (name, rank, run["error"])
            torch.testing.assert_close(run["losses"], ref["losses"][rank], msg=f"{name}: losses of rank {rank}")
            # After the block every replica holds the model of the one that trained longest.
            for p, value in run["params"].items():
                torch.testing.assert_close(value, ref["params"][p].detach(), msg=f"{name}: {p} on rank {rank}")
            for b, value in ref["buffers"].items():
                torch.testing.assert_close(run["buffers"][b], value, msg=f"{name}: buffer {b} on rank {rank}")
    # divide_by_initial_world_size changes the result once a replica has stopped (else the test is blind).
    assert not torch.allclose(ranks[0]["initial"]["params"]["tail.weight"],
                              ranks[0]["training"]["params"]["tail.weight"])


def test_join_throw_on_early_termination_raises_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    errors = [out["throw"]["error"] for out in ranks]
    assert all(e is not None and e.startswith("UnevenInputsError") for e in errors), errors
    assert "ran out of batches" in errors[0] and "DP ranks [0]" in errors[1] and "DistributedSampler" in errors[2]
    assert [len(out["throw"]["losses"]) for out in ranks] == [2, 2, 2]  # all stopped at the same step


def test_v1_ddp_path_reaches_the_model(ranks: list[dict[str, Any]]) -> None:
    for out in (r["v1_path"] for r in ranks):
        assert out["same_child"] and out["same_output"] and out["flag"] == 3
        assert out["state_dict"] == ["head.bias", "head.weight", "tail.bias", "tail.weight"]
        assert out["children"] == ["head", "norm", "tail"]  # no submodule named "module" appeared
        assert "write model.module" in out["third"]
        assert out["pickled"] is None  # a pickled model carries nothing of smp
        assert out["deepcopy"]


def _pipelined() -> dict[str, Any]:
    return _train(divide=True, norm=True, cfg=PP2_DP2, counts=PP_COUNTS)


def test_join_with_two_pipeline_stages_per_replica() -> None:
    """Each stage's DP group runs the protocol on its own; a replica's stages stop together."""
    ref = _reference(divide=True, norm=True, counts=PP_COUNTS)
    outs = run_ranks(_pipelined, 4, timeout=240)
    stages: dict[str, list[torch.Tensor]] = {}
    for out in outs:
        assert out["error"] is None, out["error"]
        for p, value in {**out["params"], **out["buffers"]}.items():
            stages.setdefault(p, []).append(value)
    # Every parameter and buffer lives on the 2 ranks of its stage (one per replica); both hold the reference.
    assert sorted(stages) == sorted([*ref["params"], *ref["buffers"]])
    for name, values in stages.items():
        expected = ref["params"][name].detach() if name in ref["params"] else ref["buffers"][name]
        assert len(values) == 2, name
        for value in values:
            torch.testing.assert_close(value, expected, msg=name)



def _fp16() -> dict[str, Any]:
    return _train(divide=True, norm=False, cfg={**DP3, "comm_timeout": 20.0}, counts=[2, 3], fp16=True)


def test_join_with_fp16_masters_and_clip_master_grads() -> None:
    """The overflow check and the clip norm agree over the MP group inside the block (a replica out of
    batches waits in the join's collectives: over the world they waited for it until the timeout), and
    after the block the fp32 masters take the weights of the replica that trained longest."""
    ref = _reference(divide=True, norm=False, counts=[2, 3])
    outs = run_ranks(_fp16, 2, timeout=120)
    for rank, out in enumerate(outs):
        assert out["error"] is None, out["error"]
        assert out["masters_hold_the_model"], rank
        torch.testing.assert_close(out["losses"], ref["losses"][rank], rtol=1e-2, atol=1e-3)
        for p, value in out["params"].items():
            assert value.dtype == torch.float16
            torch.testing.assert_close(value.float(), ref["params"][p].detach(), rtol=1e-2, atol=1e-3, msg=p)
    assert all(torch.equal(outs[0]["params"][p], outs[1]["params"][p]) for p in outs[0]["params"])
