"""Soak: hundreds of pipelined steps that return the model's output leak neither memory nor threads.

Regression test for a leak on pp_rank 0: every step's microbatch tasks, and with them every
microbatch's output and autograd graph, stayed alive for good through a reference cycle that ran
through C++ autograd nodes, which Python's cyclic GC cannot see (Note [task lifetime] in
frontends/torch/engine/engine.py). The step below returns ``output, loss`` as the README example
does, with a 32k vocabulary: each step's outputs are 1 MiB, so the leak showed as ~1.2 MiB of RSS
per step on the leader. The cyclic GC is off while the steps run, so only memory that reference
counting frees at the end of a step counts as freed.
"""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.spawn import run_ranks

VOCAB = 32768
BATCH = 8
MICROBATCHES = 4
WARMUP_STEPS = 30  # the allocator and the plan settle (the first step records the chain)
STEPS = 150
# Leaked, each step's outputs alone (BATCH x VOCAB fp32 = 1 MiB) add up to 150 MiB over STEPS.
# Fixed, both ranks grew by under 14 MiB (allocator noise, not growing with steps): the bound sits between the two.
MAX_GROWTH_MIB = 48.0


class _Net(nn.Module):
    """An input layer on pp_rank 0, a 32k-vocabulary head on pp_rank 1, log-softmax back on 0."""

    def __init__(self) -> None:
        import smp.torch as smp

        super().__init__()
        with smp.partition(0):
            self.embed = nn.Linear(16, 32)
        with smp.partition(1):
            # A Sequential, so pp_rank 1 calls its children as modules (their hooks run there).
            self.head = nn.Sequential(nn.ReLU(), nn.Linear(32, VOCAB))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.head(torch.relu(self.embed(x))), dim=-1)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _soak() -> dict[str, Any]:
    import smp.torch as smp
    from smp.torch.engine.engine import current_task

    smp.init({"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES, "ddp": True, "auto_partition": False,
              "default_partition": 0, "comm_timeout": 60.0})
    torch.manual_seed(0)
    net = _Net()
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))

    @smp.step
    def train_step(model: Any, data: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        output = model(data)
        loss = F.nll_loss(output, target)
        model.backward(loss)
        return output, loss

    g = torch.Generator().manual_seed(0)
    data, target = torch.randn(BATCH, 16, generator=g), torch.randint(0, VOCAB, (BATCH,), generator=g)

    def run(steps: int) -> Any:
        out = None
        for _ in range(steps):
            opt.zero_grad()
            out, loss_mb = train_step(model, data, target)  # the last output stays referenced, as in a script
            loss_mb.reduce_mean().item()
            opt.step()
        return out

    run(WARMUP_STEPS)
    gc.collect()
    gc.disable()  # from here on, only reference counting frees a step's objects
    try:
        rss_before, threads_before = _rss_mib(), sorted(t.name for t in threading.enumerate())
        run(STEPS)
        rss_after, threads_after = _rss_mib(), sorted(t.name for t in threading.enumerate())

        # Every task of one more step, seen from inside the step by module hooks on whichever rank runs them.
        tasks: dict[int, weakref.ref[Any]] = {}

        def remember(*_: Any) -> None:
            task = current_task()
            if task is not None:
                tasks.setdefault(id(task), weakref.ref(task))

        handles = [m.register_forward_hook(remember) for m in net.modules()]
        run(1)
        for h in handles:
            h.remove()
        # A worker thread lets go of its task just after reporting the task's end, so allow a moment.
        deadline = time.monotonic() + 5.0
        while any(r() is not None for r in tasks.values()) and time.monotonic() < deadline:
            time.sleep(0.01)
        alive = sum(r() is not None for r in tasks.values())
        cyclic = gc.collect()
    finally:
        gc.enable()
    return {"pp_rank": smp.pp_rank(), "growth_mib": rss_after - rss_before, "threads_before": threads_before,
            "threads_after": threads_after, "tasks_seen": len(tasks), "tasks_alive": alive, "cyclic": cyclic}


@pytest.mark.slow
def test_steps_returning_outputs_leak_no_memory_tasks_or_threads() -> None:
    results = run_ranks(_soak, 2, timeout=300)
    for r in results:
        rank = f"pp_rank {r['pp_rank']}"
        assert r["growth_mib"] < MAX_GROWTH_MIB, (
            f"{rank}: RSS grew by {r['growth_mib']:.1f} MiB over {STEPS} steps (bound {MAX_GROWTH_MIB} MiB)")
        assert r["threads_after"] == r["threads_before"], f"{rank}: threads changed over {STEPS} steps"
        # One task per microbatch ran on each rank, and none outlives its step.
        assert r["tasks_seen"] == MICROBATCHES, r
        assert r["tasks_alive"] == 0, f"{rank}: {r['tasks_alive']} of a step's tasks are alive after the step"
        # Per-step cycles would leave at least one object per step for the cyclic GC.
        assert r["cyclic"] < STEPS, f"{rank}: {r['cyclic']} objects left for the cyclic GC after {STEPS} steps"
