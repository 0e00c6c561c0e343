"""The microbatch threads share one malloc heap, and freed memory stays mapped for the next step
(frontends/torch/runtime/heap.py)."""

from __future__ import annotations

import ctypes
import os
import platform
import tempfile

import pytest
import torch

from tests.helpers.spawn import run_ranks
from tests.torch.zoo import train_relu_loop

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



def _train(keep: bool) -> tuple[int, int, int]:
    import threading

    import smp.torch as smp

    if keep:
        os.environ["SMP_MALLOC_ARENAS"] = "keep"
    before = _arenas()
    train_relu_loop(smp, 64, 3, pipeline="interleaved")
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
    """Minor page faults of this thread per round of a 40 MiB buffer made, touched and freed after
    smp.init, once the heap has settled: the quietest of five windows of four rounds (the kernel's
    own reclaim, e.g. DAMON paging out cold library pages under a loaded machine, adds faults to a
    window now and then; the heap's own faults come back in every window)."""
    import resource

    import smp.torch as smp

    if keep:
        os.environ["SMP_MALLOC_THRESHOLDS"] = "keep"
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})

    def round_() -> None:
        buffer = torch.ones(10 << 20)
        del buffer

    for _ in range(10):  # the heap settles: its first rounds may still grow it (fresh pages)
        round_()
    windows = []
    for _ in range(5):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(4):
            round_()
        windows.append((resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before) / 4)
    return min(windows)


def test_freed_memory_stays_mapped_for_the_next_step() -> None:
    # glibc's default serves a block above 32 MiB (the most its own mmap threshold rises to) with
    # fresh pages every time (5,120 faults a round here for the 10,240 pages of 40 MiB); with smp's
    # thresholds the heap keeps it, and a settled heap faults nothing.
    faults = run_ranks(_faults_per_round, 2, args=(False,))
    assert all(f < 50 for f in faults), f"freed buffers were unmapped: {faults} faults a round per rank"
    faults = run_ranks(_faults_per_round, 2, args=(True,))
    assert all(f >= 2_000 for f in faults), f"glibc's default kept the buffer mapped: {faults} faults a round"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]


def _heap_free_mib() -> float:
    """Free bytes inside the malloc heap (holes glibc keeps), in MiB (glibc's ``mallinfo2``)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2().fordblks / 2**20


def _heap_holes(optimize: str) -> tuple[float, float]:
    """A pp-2 rank of a deep MLP (4 MiB weights, 4 microbatches, Adam), after 4 steps: the free MiB
    inside its heap and the MiB its parameters, gradients and optimizer state hold."""
    import smp.torch as smp
    from torch import nn

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4, "optimize": optimize, "auto_partition": False,
              "default_partition": 0})

    class Deep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            stages = []
            for s in range(2):
                with smp.partition(s):
                    stages.append(nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]))
            self.stages = nn.ModuleList(stages)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.stages[1](self.stages[0](x))

    with smp.delay_param_initialization():
        model = smp.DistributedModel(Deep())
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4))

    @smp.step
    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        model.backward(loss)
        return loss

    x = torch.randn(8, 1024)
    for _ in range(4):
        opt.zero_grad()
        step(model, x)
        opt.step()
    return _heap_free_mib(), sum(model.memory_check()["held"].values()) / 2**20


def _has_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not _has_mallinfo2(), reason="mallinfo2: glibc 2.33 or later")
def test_optimize_memory_leaves_no_tensor_sized_holes() -> None:
    # glibc before 2.38 cannot reuse the hole a freed tensor leaves for a tensor of the same size
    # (heap.py), and gradient accumulation over microbatches frees and allocates one per parameter per
    # microbatch: with optimize: memory large blocks go back to the kernel and leave no hole.
    for free, held in run_ranks(_heap_holes, 2, args=("memory",)):
        assert held == pytest.approx(8 * 4 * (4 << 20) / 2**20, rel=0.01)  # weights, grads, Adam's 2 slots
        assert free < 4, f"{free:.0f} MiB free inside the heap beside the {held:.0f} MiB the tensors hold"
