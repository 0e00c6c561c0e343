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
    smp.init, once the heap has settled."""
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
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(10):
        round_()
    return (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before) / 10


def test_freed_memory_stays_mapped_for_the_next_step() -> None:
    # glibc's default serves a block above 32 MiB (the most its own mmap threshold rises to) with
    # fresh pages every time (5,120 faults a round here for the 10,240 pages of 40 MiB); with smp's
    # thresholds the heap keeps it, and a settled heap faults nothing.
    assert all(f < 50 for f in run_ranks(_faults_per_round, 2, args=(False,))), "freed buffers were unmapped"
    assert all(f >= 2_000 for f in run_ranks(_faults_per_round, 2, args=(True,)))
