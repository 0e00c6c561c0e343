"""One malloc heap for the microbatch threads (glibc).

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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

__all__ = ["share_heap"]

_M_ARENA_MAX = -8  # malloc.h
log = logging.getLogger(__name__)


def _user_chose() -> bool:
    return ("MALLOC_ARENA_MAX" in os.environ or "arena_max" in os.environ.get("GLIBC_TUNABLES", "")
            or os.environ.get("SMP_MALLOC_ARENAS", "").lower() == "keep")


def share_heap() -> None:
    """Cap glibc's malloc arenas at one (see the module docstring); calling it again is harmless."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or _user_chose():
        return
    try:
        ok = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt(_M_ARENA_MAX, 1) == 1
    except (OSError, AttributeError):
        ok = False
    if not ok:
        log.debug("mallopt(M_ARENA_MAX, 1) failed: microbatch threads keep their own malloc arenas")
