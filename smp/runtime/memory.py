"""Process memory, framework-free: what this process holds, and giving freed memory back.

Model parallelism exists to divide memory, so after a rank frees what other ranks own (PyTorch
parameters, TensorFlow variables) the pages must leave the process: glibc keeps freed blocks in
its heap (smp.torch raises its thresholds on purpose, `frontends/torch/runtime/heap.py`), and a
rank that built the whole model would keep its footprint for good. `give_back_freed` asks glibc to
return every free page (``malloc_trim(0)``), once, right after such a release.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

__all__ = ["give_back_freed", "resident_bytes"]


def resident_bytes() -> int:
    """This process's resident set size in bytes (0 where ``/proc`` is not available)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def give_back_freed() -> int:
    """Return the heap's free pages to the kernel now (``malloc_trim(0)``); the resident bytes that left.

    Where glibc is not the C library, nothing happens (0).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return 0
    before = resident_bytes()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return 0
    return max(0, before - resident_bytes())
