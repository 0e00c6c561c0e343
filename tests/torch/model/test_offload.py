"""``offload_activations`` with activation checkpointing (smp.torch.model.offload).

The offload queue runs for real on a CPU through `LoopbackTarget`, which copies the inputs of each
checkpointed call into separate host storage and loads them into new storage again, so the
recomputation in backward reads the round-tripped copies. Checked: losses and every gradient
bit-identical to the same checkpointed model without offload (one process, and 2 pipeline ranks
with a looping chain, 4 microbatches in flight); the horizon bound; no records left after a
step, an evaluation forward or a forward without backward, flat over 50 steps; per-microbatch
prefetch with interleaved microbatches; and the production path on a CPU rank (one log line, no
copies).

What "on the device" counts: `Offloader.stats.peak_waiting` is the most records loaded ahead and
not yet taken by backward (at most ``activation_loading_horizon``); `LoopbackTarget.peak_alive` is
the most loads whose storage is alive at once, measured at each load from outside the queue: the
waiting ones plus the one backward is using (at most horizon + 1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from tests.helpers.spawn import run_ranks

HORIZON = 2
LR = 0.1


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # Tiny tensors: intra-op threads only contend (30x slower on a busy 2-core machine). The
    # spawned ranks get OMP_NUM_THREADS=1 from the spawn helper.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Block(nn.Module):
    def __init__(self, d: int, dropout: float) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        a = self.drop(self.fc2(F.gelu(self.fc1(self.ln(h)))))
        return h + (a if mask is None else a * mask)


class Net(nn.Module):
    """Blocks in a ModuleList loop, each given a mask (which needs no grad) by keyword."""

    def __init__(self, layers: int = 6, d: int = 8, dropout: float = 0.1) -> None:
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.blocks = nn.ModuleList(Block(d, dropout) for _ in range(layers))
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        mask = (x[:, :1] > -1.0).float()
        for block in self.blocks:
            h = block(h, mask=mask)
        return self.out(h)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)


def _setup(cfg: dict[str, Any], layers: int = 6, dropout: float = 0.1) -> tuple[Any, Net, Any, Any, Any]:
    import smp.torch as smp

    smp.init(cfg)
    torch.manual_seed(0)
    net = Net(layers, dropout=dropout)
    model = smp.DistributedModel(net)
    if cfg.get("pipeline_parallel_degree", 1) > 1:
        # Pairs of blocks alternate between the ranks: the chain loops 0 -> 1 -> 0 -> 1, so rank 0
        # runs each microbatch's blocks in two visits, with other microbatches in between.
        smp.set_partition(net.inp, 0)
        smp.set_partition(net.out, 1)
        for i, block in enumerate(net.blocks):
            smp.set_partition(block, (i // 2) % 2)
    for block in net.blocks:
        smp.set_activation_checkpointing(block)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    @smp.step
    def forward_step(model: Any, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    return model, net, opt, train_step, forward_step


def _train(cfg: dict[str, Any], steps: int, loopback: bool, layers: int = 6, dropout: float = 0.1) -> dict[str, Any]:
    """``steps`` training steps, an evaluation forward and a forward without backward."""
    import smp.torch as smp
    from smp.torch.model import offload

    model, net, opt, train_step, forward_step = _setup(cfg, layers, dropout)
    target = offload.LoopbackTarget()
    out: dict[str, Any] = {"losses": [], "grads": [], "live": [], "alive": [], "tracked": []}
    with offload.use_target(target) if loopback else contextlib.nullcontext() as off:
        for step in range(steps):
            opt.zero_grad()
            out["losses"].append(train_step(model, *_data(step)).reduce_mean().item())
            out["grads"].append({n: p.grad.clone() for n, p in model.local_named_parameters() if p.grad is not None})
            opt.step()
            if off is not None:
                out["live"].append(off.live())
                out["alive"].append(target.alive())
                out["tracked"].append(off.tracked())
        if off is not None:
            out["stats"] = dataclasses.replace(off.stats)
            out["copies"] = (target.to_host_copies, target.to_device_copies)
            before = off.stats.records
            with torch.no_grad():
                forward_step(model, _data(99)[0])
            out["eval"] = (off.stats.records - before, off.live())
            forward_step(model, _data(98)[0])  # grad enabled, no backward: its graph ends with the step
            out["forward_only"] = (off.stats.records - before, off.live())
            out["peak_alive"] = target.peak_alive
    out["pp_rank"] = smp.pp_rank()
    smp.reset()
    return out


def _assert_same(plain: dict[str, Any], offloaded: dict[str, Any]) -> None:
    assert offloaded["losses"] == plain["losses"]
    for step, (g0, g1) in enumerate(zip(plain["grads"], offloaded["grads"])):
        assert g0 and sorted(g0) == sorted(g1), step
        for name in g0:
            assert torch.equal(g0[name], g1[name]), (step, name)


# --- the premise: what torch's non-reentrant checkpoint passes to outer saved-tensor hooks ----------

def test_checkpoint_keeps_exactly_its_tensor_arguments_through_outer_hooks() -> None:
    """offload.py relies on this: hooks around ``checkpoint(...)`` see its tensor arguments only
    (the tensors its forward saves go to checkpoint's own hooks), and unpack them in backward."""
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    h, gate = x * 2, x * 3
    packed: list[torch.Tensor] = []
    unpacked: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t)
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        unpacked.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y = torch_checkpoint.checkpoint(lambda a, g: torch.tanh(lin(torch.tanh(lin(a)))) * g, h, gate,
                                        use_reentrant=False)
    assert [t is h for t in packed if t.numel()] == [True, False] and packed[-1] is gate
    assert not unpacked
    y.sum().backward()
    assert [t for t in unpacked if t.numel()] == [t for t in packed if t.numel()]


def test_offloaded_call_moves_its_grad_inputs_including_keywords_and_gives_the_same_gradients() -> None:
    import smp.torch as smp
    from smp.torch.model import offload
    from smp.torch.model.recompute import checkpointed

    smp.init({"offload_activations": True})
    torch.manual_seed(0)
    block = Block(8, dropout=0.2)
    x = torch.randn(5, 8)
    mask = torch.ones(5, 1)

    def grads(loopback: bool) -> tuple[list[torch.Tensor], torch.Tensor, offload.LoopbackTarget]:
        w = torch.ones(5, 1, requires_grad=True)
        h = x.clone().requires_grad_()
        target = offload.LoopbackTarget()
        with offload.use_target(target) if loopback else contextlib.nullcontext():
            torch.manual_seed(1)  # the dropout mask of the forward (recomputation restores it)
            y = checkpointed(block, (h * 1.5,), {"mask": mask * w}, preserve_rng_state=True)
            y.square().sum().backward()
        assert h.grad is not None and w.grad is not None
        return [h.grad, w.grad] + [p.grad.clone() for p in block.parameters()], y.detach(), target

    plain, y0, _ = grads(False)
    block.zero_grad()
    moved, y1, target = grads(True)
    assert torch.equal(y0, y1) and all(torch.equal(a, b) for a, b in zip(plain, moved))
    # Both arguments need grad here (the keyword one too); the copies really round-tripped.
    assert (target.to_host_copies, target.to_device_copies) == (2, 2)


def test_an_input_changed_in_place_by_the_call_fails_backward_and_a_later_change_is_harmless() -> None:
    import smp.torch as smp
    from smp.torch.model import offload
    from smp.torch.model.recompute import checkpointed

    from smp.errors import SMPError

    smp.init({"offload_activations": True})
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4)

    def scaled_in_place(h: torch.Tensor) -> torch.Tensor:
        return lin(h.mul_(2.0))

    def grad_of(fn: Any, change_after: bool, loopback: bool) -> torch.Tensor:
        lin.zero_grad()
        with offload.use_target(offload.LoopbackTarget()) if loopback else contextlib.nullcontext():
            h = x.clone().requires_grad_() * 1.0
            y = checkpointed(fn, (h,), {}, preserve_rng_state=False)
            if change_after:
                with torch.no_grad():
                    h.add_(1.0)
            y.sum().backward()
        assert lin.weight.grad is not None
        return lin.weight.grad.clone()

    # The saved input changes under the call: recomputing from it would be wrong (torch fails too).
    with pytest.raises(SMPError, match=r"changed in place.*offload_activations"):
        grad_of(scaled_in_place, False, True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        grad_of(scaled_in_place, False, False)
    # A change once the copy is taken does not reach backward: it recomputes from what the call saw.
    assert torch.equal(grad_of(lin, True, True), grad_of(lin, False, False))


# --- one process -------------------------------------------------------------------------------

CFG1 = {"microbatches": 2, "offload_activations": True, "activation_loading_horizon": HORIZON}


def test_single_process_bit_identical_bounded_by_the_horizon_and_flat_over_50_steps() -> None:
    plain = _train({**CFG1, "offload_activations": False}, 50, loopback=False)
    got = _train(CFG1, 50, loopback=True)
    _assert_same(plain, got)
    stats = got["stats"]
    steps, per_step = 50, 2 * 6  # microbatches x checkpointed blocks
    assert stats.records == steps * per_step and got["copies"] == (stats.records, stats.records)
    # Each microbatch's backward loads its last block on demand; the horizon prefetches the rest.
    assert stats.on_demand == steps * 2 and stats.prefetched == steps * (per_step - 2)
    assert stats.peak_waiting == HORIZON
    assert got["peak_alive"] == HORIZON + 1
    # Nothing is left after any step, and the registry does not grow.
    assert got["live"] == [0] * steps and got["alive"] == [0] * steps
    assert max(got["tracked"]) <= per_step
    # No records under no_grad; a forward without backward leaves none behind.
    assert got["eval"] == (0, 0)
    assert got["forward_only"] == (per_step, 0)


def test_the_horizon_is_the_bound() -> None:
    got = _train({**CFG1, "activation_loading_horizon": 4}, 2, loopback=True)
    assert got["stats"].peak_waiting == 4 and got["peak_alive"] == 5
    got = _train({**CFG1, "activation_loading_horizon": 1}, 2, loopback=True)
    assert got["stats"].peak_waiting == 1 and got["peak_alive"] == 2


def test_prefetch_stays_in_the_microbatch_and_keeps_what_it_loaded() -> None:
    """Two microbatches with two segments each, as a pipeline rank sees them: forwards interleaved
    (A1 B1 A2 B2), then backward A2, B2, A1, B1. A2's backward prefetches A's own earlier calls,
    which wait through B2's backward (B loads on demand: the horizon is full) and are used by A1's
    without being loaded again."""
    import smp.torch as smp
    from smp.torch.engine.local import set_task
    from smp.torch.model import offload
    from smp.torch.model.recompute import checkpointed

    class Microbatch:  # what the engine's Task is to the offloader: a key that lives for the step
        pass

    smp.init({"offload_activations": True, "activation_loading_horizon": 2})
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4) for _ in range(4)]
    x = torch.randn(3, 4, requires_grad=True)
    a, b = Microbatch(), Microbatch()

    def segment(task: Microbatch, h: torch.Tensor, first: int) -> torch.Tensor:
        set_task(task)
        try:
            for layer in layers[first:first + 2]:
                h = checkpointed(lambda t, m=layer: torch.tanh(m(t)), (h,), {}, preserve_rng_state=False)
            return h
        finally:
            set_task(None)

    def run(loopback: bool) -> tuple[list[torch.Tensor], Any]:
        for layer in layers:
            layer.zero_grad()
        with offload.use_target(offload.LoopbackTarget()) if loopback else contextlib.nullcontext() as off:
            # Segment 2 starts from a leaf, as a received tensor does on a pipeline rank.
            a1, b1 = segment(a, x * 1.0, 0), segment(b, x * 2.0, 0)
            a_in, b_in = a1.detach().requires_grad_(), b1.detach().requires_grad_()
            a2, b2 = segment(a, a_in, 2), segment(b, b_in, 2)
            loads = []
            for out, grad in ((a2, None), (b2, None), (a1, "a"), (b1, "b")):
                g = {"a": a_in.grad, "b": b_in.grad}.get(grad) if grad else torch.ones_like(out)
                out.backward(g)
                loads.append(None if off is None else (off.stats.on_demand, off.stats.prefetched, off.waiting()))
        return [m.weight.grad.clone() for m in layers] + [x.grad], loads  # type: ignore[union-attr]

    plain, _ = run(False)
    x.grad = None
    moved, loads = run(True)
    assert all(torch.equal(p, q) for p, q in zip(plain, moved))
    # (on demand, prefetched, waiting) after each backward. Forward order: a0 a1 | b0 b1 | a2 a3 | b2 b3.
    # A2: a3 on demand, a2 and a1 prefetched (a1, not b1 which B made in between), then a0 once a2
    # is taken. B2: the horizon is full (a1, a0 wait), so b3 and b2 load on demand. A1: takes the
    # waiting a1 and a0, loading nothing. B1: b1 on demand, b0 prefetched.
    assert loads == [(1, 3, 2), (3, 3, 2), (3, 3, 0), (4, 4, 0)]


def test_a_cpu_rank_logs_once_that_there_is_nothing_to_offload_and_copies_nothing() -> None:
    from smp.torch.model import offload
    from smp.torch.runtime.process_state import torch_state

    assert not torch.cuda.is_available()
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    keep = Keep()
    logging.getLogger("smp").addHandler(keep)
    try:
        plain = _train({**CFG1, "offload_activations": False}, 2, loopback=False)
        assert offload.NOTHING_TO_DO not in messages
        model, net, opt, train_step, _ = _setup(CFG1)
        losses = []
        for step in range(2):
            opt.zero_grad()
            losses.append(train_step(model, *_data(step)).reduce_mean().item())
            opt.step()
        made = torch_state().offloader
    finally:
        logging.getLogger("smp").removeHandler(keep)
    assert losses == plain["losses"]
    assert messages.count(offload.NOTHING_TO_DO) == 1
    assert made.target is None and made.stats == offload.OffloadStats() and made.live() == 0


# --- two pipeline ranks ------------------------------------------------------------------------

CFG2 = {**CFG1, "pipeline_parallel_degree": 2, "microbatches": 4, "auto_partition": False, "default_partition": 0,
        "comm_timeout": 60.0}


def _pipelined(steps: int) -> dict[str, Any]:
    # No dropout: microbatch threads share the CPU generator, so masks would depend on thread timing.
    plain = _train({**CFG2, "offload_activations": False}, steps, loopback=False, layers=8, dropout=0.0)
    got = _train(CFG2, steps, loopback=True, layers=8, dropout=0.0)
    return {"plain": plain, "offloaded": got}


def test_two_pipeline_ranks_bit_identical_bounded_and_nothing_left() -> None:
    steps = 6
    for rank, r in enumerate(run_ranks(_pipelined, 2, args=(steps,), timeout=120)):
        got = r["offloaded"]
        _assert_same(r["plain"], got)
        stats = got["stats"]
        per_step = 4 * 4  # microbatches x the blocks this rank owns
        assert got["pp_rank"] == rank and stats.records == steps * per_step, (rank, stats)
        assert stats.on_demand + stats.prefetched >= stats.records and stats.prefetched > 0, (rank, stats)
        assert stats.peak_waiting <= HORIZON and got["peak_alive"] <= HORIZON + 1, (rank, stats, got["peak_alive"])
        assert got["live"] == [0] * steps and got["alive"] == [0] * steps, rank
        assert got["eval"] == (0, 0) and got["forward_only"] == (per_step, 0), rank
