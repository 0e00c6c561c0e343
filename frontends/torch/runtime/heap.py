"""One malloc heap for the microbatch threads, and freed memory kept for the next step (glibc).

glibc gives each new thread that allocates its own arena. The engine runs every microbatch in its
own long-lived thread (engine.py), so on CPU each microbatch's activations and gradients come from
a different arena: memory that the previous microbatch had just freed, still in cache and mapped,
goes unused, and the next microbatch touches pages last used several microbatches ago. Measured on
the Llama benchmark (2 CPU ranks, 8 microbatches of 2, benchmarks/bench_pipeline.py, hand cut,
1F1B): the very same kernels on the last stage (its decoder layers' forward, its whole backward)
took 6-17 % more CPU than in torch.distributed.pipelining's one thread, and about as much as there
with one arena; in three paired launches the step took 5-7 % less with the cap than without.
So `init` caps the arenas at one on CPU before gloo's and the engine's threads exist: threads
share the main heap, as a single-threaded loop does. (Arenas that threads started before
``smp.init`` already took stay in use: round robin with the main one.)

Only on glibc. A cap the user chose (``MALLOC_ARENA_MAX`` or a
``glibc.malloc.arena_max`` tunable in ``GLIBC_TUNABLES``) is left as it is; ``SMP_MALLOC_ARENAS=keep``
leaves glibc's default (one arena per thread, up to 8 per core).

Freed memory stays mapped (`keep_freed_memory`). By default glibc serves a block above its mmap
threshold (128 KiB, raised up to the largest block freed so far) with fresh pages from the kernel,
and gives the top of the heap back once more than twice that threshold is free there. A step
allocates the same activation and gradient buffers again and again, and those that glibc gives
back are page-faulted in anew: a 40 MiB buffer made and freed in a loop costs 5,120 minor faults
a round by default (above the 32 MiB glibc's threshold rises to) and none with the thresholds
raised (tests/torch/engine/test_heap.py). The automatic partitioner felt it most:
the traced microbatch runs alone, so the buffers of the LM head and loss (4 MiB of logits each,
in the benchmark's GPT) came back from the kernel on every traced run (about 6,000 faults per
trace), and the head + loss measured 1.47-1.57 blocks against 1.25 with the thresholds raised
(no faults) and 1.1-1.3 in the pipelined step, where many microbatches keep the heap large; the
V placed a block too many on rank 1. So `init` raises the mmap threshold to `MMAP_THRESHOLD`
and keeps up to `TRIM_THRESHOLD` free at the heap's top: a CPU training process holds on to its
peak memory, as a caching allocator does. Thresholds the user chose (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_`` or the ``glibc.malloc`` tunables of those names)
are left as they are; ``SMP_MALLOC_THRESHOLDS=keep`` leaves glibc's.

With ``optimize: "memory"`` the heap keeps no large block (`give_back_large_blocks`): a block of
`MEMORY_MMAP_THRESHOLD` or more comes from the kernel and goes back to it when freed. The reason is
glibc's ``posix_memalign`` before 2.38, which torch uses for every CPU tensor: it asks for the size
plus the alignment and splits the spare bytes off; the small allocations that take those bytes
pin the block's neighbours, so a freed tensor leaves a hole of exactly its own size, which no
later tensor of that size fits. Gradients accumulated over microbatches (one temporary per
parameter per microbatch) and the optimizer's temporaries then grow the heap step after step: on
a deep MLP of 16 MiB weights at pp 2 (4 microbatches, Adam) a rank's heap held 0.1-0.35 GiB of
free holes beside its 0.5 GiB of tensors in every heap setting (glibc's own thresholds included),
and its peak was 0.16-0.38 GiB above the same run with the large blocks from the kernel (which
leaves under 4 MiB free in the heap). The price is speed: a block from the
kernel is page-faulted in again each time, 15-20 % of the step on a Llama of hidden 1024 on one
core (docs/memory.md). glibc 2.38 and later reuse such holes; the default (``"speed"``) keeps them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

__all__ = ["MEMORY_MMAP_THRESHOLD", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "give_back_large_blocks",
           "keep_freed_memory", "share_heap"]

# malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 64 << 20  # bytes: larger blocks still come from (and go back to) the kernel
TRIM_THRESHOLD = 128 << 20  # bytes free at the heap's top before it is given back
MEMORY_MMAP_THRESHOLD = 1 << 20  # optimize: memory: larger blocks come from (and go back to) the kernel
_MEMORY_TRIM_THRESHOLD = 4 << 20
log = logging.getLogger(__name__)


def _glibc() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _mallopt(param: int, value: int) -> bool:
    try:
        return bool(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt(param, value) == 1)
    except (OSError, AttributeError):
        return False


def _user_chose(variables: tuple[str, ...], tunables: tuple[str, ...], keep: str) -> bool:
    """Whether the user set any of glibc's ``variables`` or ``glibc.malloc`` ``tunables``, or ``keep=keep``."""
    given = os.environ.get("GLIBC_TUNABLES", "")
    return (any(v in os.environ for v in variables) or any(t in given for t in tunables)
            or os.environ.get(keep, "").lower() == "keep")


def share_heap() -> None:
    """Cap glibc's malloc arenas at one (see the module docstring); calling it again is harmless."""
    if not _glibc() or _user_chose(("MALLOC_ARENA_MAX",), ("arena_max",), "SMP_MALLOC_ARENAS"):
        return
    if not _mallopt(_M_ARENA_MAX, 1):
        log.debug("mallopt(M_ARENA_MAX, 1) failed: microbatch threads keep their own malloc arenas")


def _set_thresholds(trim: int, mmap: int) -> bool:
    if not _glibc() or _user_chose(("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"),
                                   ("mmap_threshold", "trim_threshold", "top_pad"), "SMP_MALLOC_THRESHOLDS"):
        return False
    # The trim threshold first: setting either one turns off glibc's own raising of the mmap threshold.
    if not (_mallopt(_M_TRIM_THRESHOLD, trim) and _mallopt(_M_MMAP_THRESHOLD, mmap)):
        log.debug("mallopt(M_TRIM_THRESHOLD / M_MMAP_THRESHOLD) failed: glibc's thresholds stay")
        return False
    return True


def keep_freed_memory() -> None:
    """Raise glibc's mmap and trim thresholds (see the module docstring); calling it again is harmless."""
    _set_thresholds(TRIM_THRESHOLD, MMAP_THRESHOLD)


def give_back_large_blocks() -> bool:
    """``optimize: "memory"``: blocks of `MEMORY_MMAP_THRESHOLD` or more from and back to the kernel.

    Returns whether the thresholds were set (not where the user chose glibc's, or off glibc).
    """
    return _set_thresholds(_MEMORY_TRIM_THRESHOLD, MEMORY_MMAP_THRESHOLD)

