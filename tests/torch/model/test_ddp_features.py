"""DistributedModel options beyond the defaults, each against one process: ``step_timeline()``,
``backward_passes_per_step``, ``broadcast_buffers`` and ``average_grads_across_microbatches``."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.spawn import run_ranks

PP2 = {"pipeline_parallel_degree": 2, "auto_partition": False, "default_partition": 0, "comm_timeout": 60.0}
DP2 = {"pipeline_parallel_degree": 1, "ddp": True, "comm_timeout": 60.0}


class Net(nn.Module):
    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        # BatchNorm first: its statistics depend on the data only, so they can be checked exactly.
        self.norm = nn.BatchNorm1d(4) if norm else nn.Identity()
        self.head = nn.Linear(4, 8)
        self.tail = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(torch.tanh(self.head(self.norm(x))))


def _mse_step() -> Any:
    """The SMP v1 step these tests run: MSE loss, ``model.backward``, the loss."""
    import smp.torch as smp

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    return train_step


def _data(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    # The replicas' inputs differ in mean, so their BatchNorm statistics differ too.
    return torch.randn(8, 4, generator=g) + 3.0 * dp_rank, torch.randn(8, 2, generator=g)


def _clone(named: Any) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in named}


# --- step_timeline ------------------------------------------------------------------------------------


def _timeline() -> dict[str, Any]:
    import smp.torch as smp

    from smp.pipeline import render_chrome_trace, render_svg

    smp.init({**PP2, "microbatches": 4})
    torch.manual_seed(0)
    net = Net()
    model = smp.DistributedModel(net)
    smp.set_partition(net.tail, 1)

    train_step = _mse_step()

    train_step(model, *_data(0, 0))
    first = model.step_timeline()
    time.sleep(0.5)  # a timeline that still held the first step would span this gap
    start = time.perf_counter()
    train_step(model, *_data(1, 0))
    wall_ms = (time.perf_counter() - start) * 1e3
    timeline = model.step_timeline(title="last step")
    return {"events": [(e.rank, e.kind, e.microbatch, e.start, e.end) for e in timeline.events],
            "first": [(e.rank, e.kind, e.microbatch) for e in first.events], "num_ranks": timeline.num_ranks,
            "wall_ms": wall_ms, "svg": render_svg(timeline), "trace": render_chrome_trace(timeline)}


def test_step_timeline_is_the_last_step_measured_on_every_rank() -> None:
    ranks = run_ranks(_timeline, 2)
    assert ranks[0]["events"] == ranks[1]["events"], "every pipeline rank gets the same gathered timeline"
    out = ranks[0]
    events = out["events"]
    assert out["num_ranks"] == 2
    for rank in (0, 1):  # one lane per rank, each microbatch's forward and backward in it
        kinds = {(k, mb) for r, k, mb, _, _ in events if r == rank}
        # (and weight gradients apart on rank 1 where the default's pick is a zero-bubble plan)
        assert {(k, mb) for k in "FB" for mb in range(4)} <= kinds <= {(k, mb) for k in "FBW" for mb in range(4)}, \
            (rank, kinds)
    assert all(0 <= s <= e for _, _, _, s, e in events)
    assert min(s for _, _, _, s, _ in events) == 0.0  # relative to the step's first action
    span = max(e for _, _, _, _, e in events)
    assert span <= out["wall_ms"], f"the timeline spans {span:.1f} ms, more than the last step took"
    # The same actions as the first step (one step's worth), not the two steps together.
    assert sorted((r, k, mb) for r, k, mb, _, _ in events if k != "W") == sorted(out["first"])
    for mb in range(4):  # causal order: 0F before 1F before 1B before the leader's last B
        first_f0 = min(s for r, k, m, s, _ in events if (r, k, m) == (0, "F", mb))
        f1 = [(s, e) for r, k, m, s, e in events if (r, k, m) == (1, "F", mb)]
        b1 = [(s, e) for r, k, m, s, e in events if (r, k, m) == (1, "B", mb)]
        last_b0 = max(e for r, k, m, _, e in events if (r, k, m) == (0, "B", mb))
        assert first_f0 <= f1[0][0] and f1[-1][1] <= b1[0][0] and b1[-1][1] <= last_b0, mb
    assert out["svg"].lstrip().startswith("<svg") and "last step" in out["svg"]
    trace = json.loads(out["trace"])
    drawn = [e for e in (trace["traceEvents"] if isinstance(trace, dict) else trace) if e.get("ph") == "X"]
    assert len(drawn) == len(events)


# --- backward_passes_per_step -------------------------------------------------------------------------


def _accumulating() -> dict[str, Any]:
    import smp.torch as smp

    smp.init({**DP2, "microbatches": 2})
    torch.manual_seed(0)
    model = smp.DistributedModel(Net(), backward_passes_per_step=2)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    train_step = _mse_step()

    grads, params = [], []
    for i in range(4):
        train_step(model, *_data(i, smp.dp_rank()))
        grads.append({n: p.grad.clone() for n, p in model.module.named_parameters()})
        if i % 2:  # the optimizer steps every second step, when the gradients were allreduced
            opt.step()
            opt.zero_grad()
            params.append(_clone(model.module.named_parameters()))
    return {"grads": grads, "params": params}


def _mean_grads(net: nn.Module, step: int, replicas: list[int], microbatches: int) -> None:
    """Accumulate into ``net``'s .grad the gradient of the mean loss over ``replicas``' microbatches."""
    for r in replicas:
        x, y = _data(step, r)
        for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches)):
            (F.mse_loss(net(xm), ym) / (microbatches * len(replicas))).backward()


def test_backward_passes_per_step_allreduces_every_second_step() -> None:
    ranks = run_ranks(_accumulating, 2)
    torch.manual_seed(0)
    ref = Net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for pair in range(2):
        start = {n: p.detach().clone() for n, p in ref.named_parameters()}
        for r, out in enumerate(ranks):  # the first step of the pair: this replica's own gradient only
            local = Net()
            local.load_state_dict(ref.state_dict())
            _mean_grads(local, 2 * pair, [r], 2)
            for n, p in local.named_parameters():
                torch.testing.assert_close(out["grads"][2 * pair][n], p.grad, msg=f"step {2 * pair} replica {r} {n}")
        assert not torch.equal(ranks[0]["grads"][2 * pair]["head.weight"], ranks[1]["grads"][2 * pair]["head.weight"])
        for step in (2 * pair, 2 * pair + 1):
            _mean_grads(ref, step, [0, 1], 2)
        for out in ranks:  # the second: both steps' gradients, averaged over the replicas
            for n, p in ref.named_parameters():
                torch.testing.assert_close(out["grads"][2 * pair + 1][n], p.grad, msg=f"pair {pair} {n}")
        opt.step()
        opt.zero_grad()
        for out in ranks:
            for n, p in ref.named_parameters():
                assert not torch.equal(p, start[n])
                torch.testing.assert_close(out["params"][pair][n], p.detach(), msg=f"params after pair {pair} {n}")


# --- broadcast_buffers --------------------------------------------------------------------------------


def _buffers(broadcast: bool) -> list[dict[str, torch.Tensor]]:
    import smp.torch as smp

    smp.init({**DP2, "microbatches": 2})
    torch.manual_seed(0)
    model = smp.DistributedModel(Net(norm=True), broadcast_buffers=broadcast)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    train_step = _mse_step()

    after = []
    for i in range(3):
        opt.zero_grad()
        train_step(model, *_data(i, smp.dp_rank()))
        opt.step()
        after.append(_clone(model.module.norm.named_buffers()))
    return after


@pytest.mark.parametrize("broadcast", [True, False])
def test_broadcast_buffers_starts_each_step_from_dp_rank_0(broadcast: bool) -> None:
    ranks = run_ranks(_buffers, 2, args=(broadcast,))
    norms = [nn.BatchNorm1d(4) for _ in range(2)]
    for step in range(3):
        if broadcast:  # DDP semantics: each step starts from DP rank 0's buffers
            norms[1].load_state_dict(norms[0].state_dict())
        for r, norm in enumerate(norms):
            for xm in _data(step, r)[0].chunk(2):  # the microbatches, in order
                norm(xm)
            for name, value in norm.named_buffers():
                torch.testing.assert_close(ranks[r][step][name], value, msg=f"step {step} replica {r} {name}")
    # The replicas' statistics differ after every step either way (their data differ), but only
    # without broadcasting does replica 1 keep its own history.
    assert not torch.allclose(ranks[0][2]["running_mean"], ranks[1][2]["running_mean"])


# --- average_grads_across_microbatches ----------------------------------------------------------------


def _summed(average: bool) -> dict[str, torch.Tensor]:
    import smp.torch as smp

    smp.init({**PP2, "microbatches": 4})
    torch.manual_seed(0)
    net = Net()
    model = smp.DistributedModel(net, average_grads_across_microbatches=average)
    smp.set_partition(net.tail, 1)

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y, reduction="sum")
        model.backward(loss)
        return loss

    train_step(model, *_data(0, 0))
    return {n: p.grad.clone() for n, p in model.local_named_parameters()}


@pytest.mark.parametrize("average", [False, True])
def test_average_grads_across_microbatches(average: bool) -> None:
    ranks = run_ranks(_summed, 2, args=(average,))
    torch.manual_seed(0)
    ref = Net()
    x, y = _data(0, 0)
    F.mse_loss(ref(x), y, reduction="sum").backward()  # the whole batch's sum = the microbatches' sum
    assert set(ranks[0]) == {"head.weight", "head.bias"} and set(ranks[1]) == {"tail.weight", "tail.bias"}
    for grads in ranks:
        for n, g in grads.items():
            expected = ref.get_parameter(n).grad / (4 if average else 1)
            torch.testing.assert_close(g, expected, msg=f"average={average} {n}")
