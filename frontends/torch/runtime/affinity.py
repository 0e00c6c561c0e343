"""Each local rank on CPU cores of its own (CPU training, Linux).

Several ranks on one host share its cores, and the kernel moves every thread of every rank to
whichever core is free: a rank's microbatch threads, gloo's I/O thread and the engine's waits land
on the core where the other rank was computing, and each move leaves the caches warm for the wrong
thread. Measured with ``benchmarks/bench_pipeline.py --model paired`` (2 ranks on 2 cores, 8
microbatches of 2, automatic partitioning's V, rows launched alternately; ``+unbound`` is this
binding left out): the `nn.Sequential` GPT 550 / 551 / 549 ms bound against 621 / 590 / 575, the
HF Llama 726 / 733 / 743 against 791 / 768 / 784; torch.distributed.pipelining's 1F1B, one thread
in one process per rank, gains less from the same binding (Llama 756 / 785 / 776 against 789 /
783 / 809). DeepSpeed's launcher has the same binding behind
``--bind_cores_to_rank``; `init` does it by default on CPU when it is safe:

- the launcher said how many ranks share this host and which one this is (``LOCAL_RANK`` and
  ``LOCAL_WORLD_SIZE``, or Open MPI's / MPICH's equivalents: `smp.runtime.launch.Launch.local_named`);
  without both, ranks of one host could pick the same cores;
- nothing restricted this process yet: its CPU mask is every online CPU (a launcher that binds
  ranks itself, ``numactl``, ``taskset`` or a container's cpuset is left as it is);
- there are at least as many CPUs as local ranks.

Local rank ``i`` then takes the ``i``-th of ``local_size`` equal blocks of the CPUs ordered by
(package, core, CPU), so SMT siblings stay together and a block is whole cores where the counts
allow; every thread the process already has moves there, and threads started later inherit it.
torch's intra-op thread count is left as it is: it decides how a reduction splits (a LayerNorm's
weight gradient summed by 2 threads differs in the last bits from 1 thread's sum), so changing it
would change the numbers of training; where it exceeds the block, rank 0 says so once
(torchrun already sets ``OMP_NUM_THREADS=1`` per rank). ``SMP_CPU_AFFINITY=keep`` leaves the mask
as it is. `restore` (called by ``smp.reset()``) gives the threads their mask back.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from smp.runtime.launch import Launch

__all__ = ["Binding", "bind_local_rank", "plan", "restore"]

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Binding:
    """What `bind_local_rank` changed: the CPUs it bound to, and the mask to give back."""

    cpus: tuple[int, ...]
    before: frozenset[int]


def plan(mask: set[int], online: set[int], local_rank: int, local_size: int,
         order: Callable[[int], tuple[int, ...]] = lambda cpu: (cpu,)) -> tuple[int, ...] | None:
    """The CPUs of ``local_rank``, or None where binding is not safe (see the module docstring).

    Example:
        >>> plan({0, 1, 2, 3}, {0, 1, 2, 3}, local_rank=1, local_size=2)
        (2, 3)
        >>> plan({0, 1}, {0, 1, 2, 3}, local_rank=1, local_size=2) is None  # restricted already
        True
        >>> plan({0, 1}, {0, 1}, local_rank=2, local_size=3) is None  # more ranks than CPUs
        True
    """
    if local_size <= 1 or not 0 <= local_rank < local_size or mask != online or len(mask) < local_size:
        return None
    share = len(mask) // local_size
    ordered = sorted(mask, key=order)
    return tuple(sorted(ordered[local_rank * share:(local_rank + 1) * share]))


def _online() -> set[int]:
    try:
        with open("/sys/devices/system/cpu/online") as f:
            text = f.read().strip()
    except OSError:
        return set(range(os.cpu_count() or 1))
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _topology(cpu: int) -> tuple[int, ...]:
    """(package, core, cpu): SMT siblings next to each other."""
    base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
    try:
        with open(base + "physical_package_id") as f, open(base + "core_id") as g:
            return int(f.read()), int(g.read()), cpu
    except (OSError, ValueError):
        return 0, cpu, cpu


def _set_all_threads(cpus: set[int]) -> None:
    """Every thread of this process on ``cpus`` (a thread that exits meanwhile is skipped)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            continue


def bind_local_rank(launch: Launch, env: Mapping[str, str] | None = None) -> Binding | None:
    """Bind this process to its local rank's CPUs where safe (module docstring); None if it did not."""
    env = os.environ if env is None else env
    if not launch.local_named or not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task") \
            or env.get("SMP_CPU_AFFINITY", "").lower() == "keep":
        return None
    local_rank, local_size = launch.local_rank, launch.local_size
    before = set(os.sched_getaffinity(0))
    cpus = plan(before, _online(), local_rank, local_size, _topology)
    if cpus is None:
        return None
    _set_all_threads(set(cpus))
    log.debug("local rank %d of %d bound to CPUs %s (SMP_CPU_AFFINITY=keep leaves the mask as it is)",
              local_rank, local_size, list(cpus))
    threads = torch.get_num_threads()
    if threads > len(cpus) and local_rank == 0:
        log.info("torch runs %d intra-op threads on this rank's %d CPU(s); torch.set_num_threads(%d) "
                 "(or OMP_NUM_THREADS) avoids them taking turns, at the price of other last bits in "
                 "reductions", threads, len(cpus), len(cpus))
    return Binding(cpus, frozenset(before))


def restore(binding: Binding | None) -> None:
    """Undo `bind_local_rank`: every thread's mask as it was."""
    if binding is not None:
        _set_all_threads(set(binding.before))
