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

- there are several ranks on this host, counted from every rank's host name (`host_slot`, after
  the process group is up), not from the launcher's ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``: two
  torchrun agents on one host (or two Hydra host entries naming it) each number their ranks from
  0, and local rank 0 of both would take the same cores;
- nothing restricted this process yet: its CPU mask is every online CPU (a launcher that binds
  ranks itself, ``numactl``, ``taskset`` or a container's cpuset is left as it is);
- there are at least as many CPUs as local ranks.

The ``i``-th rank of the host then takes the ``i``-th of ``count`` equal blocks of the CPUs ordered by
(package, core, CPU), so SMT siblings stay together and a block is whole cores where the counts
allow; every thread the process already has moves there, and threads started later inherit it.
torch's intra-op threads then number at most the block's CPUs where the launch did not choose their
count: torch starts one per CPU of the whole host, and more threads than CPUs take turns at every
parallel region (a spinning barrier each time). The HF Llama of ``benchmarks/bench_sweep.py`` (h512,
2 ranks on 2 cores, smp's defaults) stepped in 1.60-1.73 s with 2 threads per 1-CPU rank against
1.34-1.43 s with 1 (three paired launches), and the automatic partition's trace, timed on the same
oversubscribed rank, stretched a decoder layer 20 times and the LM head only 4 times, so it cut
elsewhere (whole layers 0-3 | 4-7 against the cut inside layer 4 that one thread gives). The count
decides how a reduction splits (2 threads sum a LayerNorm's weight gradient in another order than
1), so ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS`` in the environment (torchrun sets
``OMP_NUM_THREADS=1`` per rank) keeps the count as it is; rank 0 says so where it exceeds the block.
``SMP_CPU_AFFINITY=keep`` leaves the mask and the count as they are. `restore` (called by
``smp.reset()``) gives the threads their mask and torch its count back. Rank 0 logs what was bound
where (`describe`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from smp.runtime.launch import Launch

__all__ = ["Binding", "bind", "bind_local_rank", "describe", "host_slot", "plan", "restore"]

log = logging.getLogger(__name__)

_THREAD_COUNT_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # a count the launch chose: `bind` keeps it


@dataclass(frozen=True)
class Binding:
    """What `bind_local_rank` changed: the CPUs it bound to, and the mask to give back."""

    cpus: tuple[int, ...]
    before: frozenset[int]
    threads_before: int | None = None  # torch's intra-op thread count before `bind` lowered it


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


def host_slot(hosts: Sequence[str], rank: int) -> tuple[int, int]:
    """``rank``'s place among the ranks on its host, from every rank's host name: (index, count).

    Example:
        >>> host_slot(["a", "a", "b", "a"], 3)   # two agents on host a: ranks 0, 1 and 3
        (2, 3)
    """
    same = [r for r, host in enumerate(hosts) if host == hosts[rank]]
    return same.index(rank), len(same)


def bind(index: int, count: int, env: Mapping[str, str] | None = None) -> Binding | None:
    """Bind this process to block ``index`` of ``count`` of its host's CPUs where safe (module docstring).

    Returns None where it did not bind.
    """
    env = os.environ if env is None else env
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task") \
            or env.get("SMP_CPU_AFFINITY", "").lower() == "keep":
        return None
    before = set(os.sched_getaffinity(0))
    cpus = plan(before, _online(), index, count, _topology)
    if cpus is None:
        return None
    _set_all_threads(set(cpus))
    threads = torch.get_num_threads()
    if threads <= len(cpus):
        return Binding(cpus, frozenset(before))
    chosen = [k for k in _THREAD_COUNT_ENV if env.get(k)]
    if chosen:
        if index == 0:
            log.info("torch runs %d intra-op threads on this rank's %d CPU(s) (%s set); they take turns "
                     "on them", threads, len(cpus), chosen[0])
        return Binding(cpus, frozenset(before))
    torch.set_num_threads(len(cpus))
    if index == 0:
        log.info("torch's intra-op threads: %d -> %d, one per CPU of this rank (OMP_NUM_THREADS keeps a count "
                 "of your own)", threads, len(cpus))
    return Binding(cpus, frozenset(before), threads)


def bind_local_rank(launch: Launch, env: Mapping[str, str] | None = None) -> Binding | None:
    """`bind` by the launcher's local rank and size (a launch of one agent per host); None if it did not bind."""
    if not launch.local_named:
        return None
    return bind(launch.local_rank, launch.local_size, env)


def _cpu_ranges(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2,5"``."""
    parts: list[str] = []
    for cpu in sorted(cpus):
        if parts and cpu == int(parts[-1].rpartition("-")[2]) + 1:
            parts[-1] = f"{parts[-1].partition('-')[0]}-{cpu}"
        else:
            parts.append(str(cpu))
    return ",".join(parts)


def describe(hosts: Sequence[str], bound: Sequence[tuple[int, ...] | None], max_hosts: int = 4) -> str:
    """Where each rank was bound, host by host (``bound[r]``: rank r's CPUs, None where it was not bound).

    The first ``max_hosts`` hosts are listed; the others are counted.

    Example:
        >>> describe(["a", "a", "b"], [(0, 1), (2, 3), None])
        'host a: rank 0 on CPUs 0-1, rank 1 on CPUs 2-3; host b: rank 2 not bound'
    """
    by_host: dict[str, list[str]] = {}
    for rank, (host, cpus) in enumerate(zip(hosts, bound)):
        what = f"rank {rank} on CPUs {_cpu_ranges(cpus)}" if cpus else f"rank {rank} not bound"
        by_host.setdefault(host, []).append(what)
    shown = [f"host {host}: {', '.join(ranks)}" for host, ranks in list(by_host.items())[:max_hosts]]
    more = len(by_host) - len(shown)
    return "; ".join(shown) + (f"; {more} more host(s)" if more else "")


def restore(binding: Binding | None) -> None:
    """Undo `bind_local_rank`: every thread's mask, and torch's thread count, as they were."""
    if binding is not None:
        _set_all_threads(set(binding.before))
        if binding.threads_before is not None:
            torch.set_num_threads(binding.threads_before)
