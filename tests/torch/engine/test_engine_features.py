"""Pipeline engine behaviours beyond plain training: evaluation steps, a module called twice,
data-dependent control flow, BatchNorm buffers, hooks, activation checkpointing, cpu(), and every
rank returning the same values. Each is compared with the same model in one process."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.spawn import run_ranks

CFG = {"pipeline_parallel_degree": 2, "microbatches": 4, "auto_partition": False, "default_partition": 0,
       "comm_timeout": 60.0}


class Twice(nn.Module):
    """Root on rank 0 calls one block (owned by rank 1) twice, with a data-dependent branch."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 6)
        self.shared = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.extra = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, deep: bool = False) -> torch.Tensor:
        h = self.shared(self.inp(x))
        h = self.shared(h) + h  # the same module again
        if deep:  # a different chain on some steps
            h = self.extra(h)
        return self.out(self.norm(h))


def _data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _reference(branch: bool = True) -> dict[str, Any]:
    torch.manual_seed(0)
    net = Twice()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for i in range(3):
        x, y = _data(i)
        opt.zero_grad()
        total = 0.0
        for xm, ym in zip(x.chunk(4), y.chunk(4)):  # microbatch by microbatch, like the pipeline
            loss = F.cross_entropy(net(xm, deep=branch and i == 1), ym)
            (loss / 4).backward()
            total += loss.item() / 4
        opt.step()
        losses.append(total)
    net.eval()
    with torch.no_grad():
        evaluated = net(_data(9)[0])
    return {"losses": losses, "state": {k: v.clone() for k, v in net.state_dict().items()}, "eval": evaluated}


def _pipelined(checkpoint: bool, branch: bool = True) -> dict[str, Any]:
    import smp.torch as smp

    smp.init(CFG)
    torch.manual_seed(0)
    net = Twice()
    model = smp.DistributedModel(net)
    smp.set_partition(net.shared, 1)
    smp.set_partition(net.extra, 1)
    calls = {"partition": [], "step": [], "shared_forward": 0}
    model.register_post_partition_hook(lambda m, o: calls["partition"].append((m is model, o is not None)))
    model.register_post_step_hook(lambda m, o: calls["step"].append(m is model))
    forward = net.shared[0].forward

    def counting(*args: Any) -> Any:  # counts recomputations too (hooks do not run for those)
        calls["shared_forward"] += 1
        return forward(*args)

    net.shared[0].forward = counting
    if checkpoint:
        smp.set_activation_checkpointing(net.shared[0])
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor, deep: bool) -> tuple[torch.Tensor, float]:
        loss = F.cross_entropy(model(x, deep=deep), y)
        model.backward(loss)
        return loss, loss.item()

    @smp.step
    def eval_step(model: Any, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    records = logging.getLogger("smp").handlers
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logging.getLogger("smp").addHandler(Keep())
    losses, floats = [], []
    for i in range(3):
        x, y = _data(i)
        opt.zero_grad()
        loss_mb, loss_floats = train_step(model, x, y, branch and i == 1)
        opt.step()
        losses.append(loss_mb.reduce_mean().item())
        floats.append(loss_floats)
        if i == 0:
            calls["after_first"] = calls["shared_forward"]
    trained = {k: v.clone() for k, v in net.state_dict().items() if k.startswith("norm.")}
    model.eval()
    with torch.no_grad():
        evaluated = eval_step(model, _data(9)[0]).concat()
        again = eval_step(model, _data(9)[0]).concat()
    state = model.state_dict()
    model.cpu()
    full = {k: v.clone() for k, v in net.state_dict().items()}
    del records
    return {"trained": trained, "losses": losses, "floats": floats, "state": state, "eval": evaluated, "again": again, "calls": calls,
            "cpu": full, "fallback": any("left the recorded chain" in m for m in messages)}


def test_engine_features_match_one_process() -> None:
    """Step 2 takes another chain, so it runs in SMP v1's dynamic order: BatchNorm sees that step's
    microbatches in the order they reach it, and its running statistics are compared loosely."""
    ref = _reference()
    res = run_ranks(_pipelined, 2, args=(False,), timeout=120)
    for rank, r in enumerate(res):
        # Every rank of the pipeline returns the same values (tensors and non-tensor leaves).
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
        assert all(len(f) == 4 and isinstance(f[0], float) for f in r["floats"])
        torch.testing.assert_close(r["eval"], ref["eval"], rtol=1e-5, atol=1e-2)  # uses running stats
        torch.testing.assert_close(r["again"], r["eval"])
        # cpu() gathers every rank's parameters and buffers into the local module.
        for name, value in ref["state"].items():
            tol = 1e-2 if name.startswith("norm.running") else 1e-6
            torch.testing.assert_close(r["cpu"][name], value, rtol=1e-5, atol=tol, msg=lambda m, n=name: f"{n}: {m}")
        assert r["calls"]["partition"] == [(True, True)], r["calls"]
        assert r["calls"]["step"] == [True]
        assert r["fallback"], f"rank {rank}: step 2 takes another chain, the dynamic order must be logged"
    for name, value in ref["state"].items():
        tol = 1e-2 if name.startswith("norm.running") else 1e-6
        torch.testing.assert_close(res[0]["state"][name], value, rtol=1e-5, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


def test_batchnorm_buffers_follow_the_microbatches_in_order() -> None:
    """Without a chain change the plan runs a segment's microbatches in order, so running statistics
    equal one process that feeds the same microbatches one after the other (exactly)."""
    ref = _reference(branch=False)
    res = run_ranks(_pipelined, 2, args=(False, False), timeout=120)
    for name in ("norm.running_mean", "norm.running_var", "norm.num_batches_tracked"):
        torch.testing.assert_close(res[0]["state"][name], ref["state"][name], rtol=1e-6, atol=1e-7)


def test_activation_checkpointing_recomputes_and_matches() -> None:
    ref = _reference(branch=False)
    plain = run_ranks(_pipelined, 2, args=(False, False), timeout=120)[1]
    ckpt = run_ranks(_pipelined, 2, args=(True, False), timeout=120)[1]
    torch.testing.assert_close(torch.tensor(ckpt["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    for name, value in ref["state"].items():
        torch.testing.assert_close(ckpt["cpu"][name], value, rtol=1e-5, atol=1e-6)
    # Rank 1 owns the checkpointed layer: 2 calls per microbatch, plus one recomputation each in backward.
    assert plain["calls"]["after_first"] == 8
    assert ckpt["calls"]["after_first"] == 16


def _costed() -> list[dict[str, float]]:
    import smp.torch as smp

    smp.init(CFG)
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            with smp.partition(0):
                self.first = nn.ModuleList([nn.Linear(6, 6) for _ in range(2)])
            with smp.partition(1):
                self.second = nn.ModuleList([nn.Linear(6, 6) for _ in range(2)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in [*self.first, *self.second]:
                x = torch.tanh(layer(x))
            return x

    model = smp.DistributedModel(Net())

    @smp.step
    def step(model: Any, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        model.backward(loss)
        return loss

    out = []
    for i in range(3):
        step(model, _data(i)[0])
        out.append(model.engine.costs.as_dict())
    return out


def test_engine_counts_its_own_work_per_step() -> None:
    """``model.engine.costs``: the messages, calls and served requests of the last step on each rank."""
    res = run_ranks(_costed, 2, timeout=120)
    for step in (1, 2):
        zero, one = res[0][step], res[1][step]
        # Renewed each step: the planned steps make and serve the same calls. (How many messages carry
        # them depends on timing: calls queued longer than 2 ms leave in a message of their own.)
        for rank in (0, 1):
            assert [res[rank][step][k] for k in ("calls", "served")] == [res[rank][1][k] for k in ("calls", "served")]
        assert zero["sent"] == one["received"] and one["sent"] == zero["received"], (zero, one)
        # The leader calls rank 1's layers and the ops on their outputs; rank 1 serves them and the
        # backward of each microbatch, and calls nothing back.
        assert zero["calls"] >= 4 and one["calls"] == 0 and zero["served"] == 0, (zero, one)
        assert one["served"] >= 2 * 4, one
        assert all(v >= 0 for v in (*zero.values(), *one.values()))
        assert zero["call_ms"] > 0 and one["serve_ms"] > 0 and zero["send_ms"] > 0 and one["receive_ms"] > 0
