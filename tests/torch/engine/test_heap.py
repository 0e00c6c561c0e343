"""The microbatch threads share one malloc heap, and freed memory stays mapped for the next step
(frontends/torch/runtime/heap.py)."""

from __future__ import annotations

import ctypes
import os
import platform
import tempfile
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.spawn import run_ranks

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc malloc arenas")


def _arenas() -> int:
    """How many malloc arenas this process has (glibc's ``malloc_info``)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.fopen.restype = ctypes.c_void_p
    with tempfile.NamedTemporaryFile("r", suffix=".xml") as f:
        fp = libc.fopen(f.name.encode(), b"w")
        libc.malloc_info(0, ctypes.c_void_p(fp))
        libc.fclose(ctypes.c_void_p(fp))
        return f.read().count("<heap nr=")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _train(keep: bool) -> tuple[int, int, int]:
    import threading

    import smp.torch as smp

    if keep:
        os.environ["SMP_MALLOC_ARENAS"] = "keep"
    before = _arenas()
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": "interleaved"})
    torch.manual_seed(0)
    model = smp.DistributedModel(_Net())

    @smp.step
    def step(model: Any, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        model.backward(loss)
        return loss

    for _ in range(3):
        step(model, torch.randn(8, 64))
    return before, _arenas(), threading.active_count()


def test_microbatch_threads_share_the_main_heap() -> None:
    for before, after, threads in run_ranks(_train, 2, args=(False,)):
        assert threads > 4  # the engine's microbatch threads and receiver ran
        assert (before, after) == (1, 1)


def test_keep_leaves_glibc_its_arena_per_thread() -> None:
    # The same run without the cap: the threads take arenas of their own (what the cap prevents).
    for before, after, _ in run_ranks(_train, 2, args=(True,)):
        assert before == 1 and after > 1


def _faults_per_round(keep: bool) -> float:
    """Minor page faults per round of five 16 MiB buffers made, touched and freed, after smp.init."""
    import resource

    import smp.torch as smp

    if keep:
        os.environ["SMP_MALLOC_THRESHOLDS"] = "keep"
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})

    def round_() -> None:
        buffers = [torch.ones(4 << 20) for _ in range(5)]
        del buffers

    for _ in range(3):
        round_()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        round_()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10


def test_freed_memory_stays_mapped_for_the_next_step() -> None:
    # 5 x 16 MiB = 20,480 pages a round: glibc's default gives most of them back to the kernel and
    # faults them in again (about 1,200 a round here); with the thresholds raised, none.
    assert all(f < 50 for f in run_ranks(_faults_per_round, 2, args=(False,))), "freed buffers were unmapped"
    assert all(f > 500 for f in run_ranks(_faults_per_round, 2, args=(True,)))
