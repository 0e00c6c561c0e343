"""`smp.init` for PyTorch: validate the config, rendezvous, build one process group per group kind.

Order of work: detect the launch (no communication), resolve and validate the configuration
(raises before any process group exists), initialise torch.distributed (gloo on CPU, NCCL
alongside gloo when CUDA is available), then create the PP, TP, RDP, DP and MP groups from the
rank map. Calling `init` again is a no-op (with a warning if the configuration differs).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import smp.state as smp_state
from smp.config import Config, resolve
from smp.errors import NotInitializedError
from smp.runtime.launch import Launch, detect
from smp.topology import GroupKind, RankMap

from ..engine.workers import close_all
from . import affinity, failure
from .heap import give_back_large_blocks, keep_freed_memory, share_heap
from .process_state import KEPT

logger = logging.getLogger("smp")


@dataclass
class TorchRuntime:
    """The torch-specific part of the process state: launch facts, process groups, the store."""

    launch: Launch
    backend: str
    device: torch.device
    owns_default_group: bool
    store: Any
    groups: dict[GroupKind, Any] = field(default_factory=dict)
    group_ranks: dict[GroupKind, list[int]] = field(default_factory=dict)
    engine_group: Any = None  # a PP group of its own for pipeline messages
    env_added: dict[str, str] = field(default_factory=dict)  # what `init` added to os.environ; `reset` removes it
    binding: affinity.Binding | None = None  # the CPUs `init` bound this rank to; `reset` gives them back


def _setup_logging(rank: int) -> None:
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[smp rank {rank}] %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("SMP_LOG_LEVEL", "INFO"))
    logger.propagate = False


def _backend() -> tuple[str, torch.device, int | None]:
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        # Object messages travel as CPU tensors, hence gloo next to NCCL.
        return "cpu:gloo,cuda:nccl", torch.device("cuda", torch.cuda.current_device()), None
    return "gloo", torch.device("cpu"), None


def _default_store() -> Any:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 - an existing group created without a store (rare)
        return None


def init(config: Mapping[str, Any] | str | None = None) -> None:
    """Initialise smp for PyTorch. Works under torchrun, mpirun/mpiexec, or as one process.

    Args:
        config: a dict of configuration keys, or the path of a JSON file. The environment variable
            ``SM_HP_MP_PARAMETERS`` (JSON) overrides it key by key, as in SMP v1.

    Raises:
        SMPConfigError: listing every configuration problem, before any process group is created.

    Example:
        >>> import smp.torch as smp
        >>> smp.init({"pipeline_parallel_degree": 1, "microbatches": 2})
        >>> smp.num_microbatches()
        2
    """
    state = smp_state.current()
    if state.initialized:
        again = resolve(config, world_size=state.cfg.world_size if state.cfg else None)
        if state.cfg is not None and again.as_dict() != state.cfg.as_dict():
            logger.warning("smp.init was already called; the new configuration is ignored (call smp.reset() first)")
        return
    launch = detect(dist_initialized=dist.is_available() and dist.is_initialized(),
                    dist_rank=dist.get_rank() if dist.is_initialized() else 0,
                    dist_world=dist.get_world_size() if dist.is_initialized() else 1)
    cfg = resolve(config, world_size=launch.world_size, framework="torch")
    rank_map = RankMap.from_world(launch.world_size, cfg.pipeline_parallel_degree, cfg.tensor_parallel_degree,
                                  cfg.placement_strategy)
    _setup_logging(launch.rank)
    # torch's own limit sits above ours, so smp's clearer timeout error (naming op and peers) fires first.
    timeout = timedelta(seconds=float(cfg.comm_timeout) * 1.5 + 10)
    backend, device, _ = _backend()
    if device.type == "cpu":
        share_heap()  # before gloo's and the engine's threads exist (heap.py)
        if cfg.optimize == "memory":
            give_back_large_blocks()  # no tensor-sized holes in the heap (heap.py)
        else:
            keep_freed_memory()  # before the trace: its buffers would come back from the kernel each run
    owns = launch.kind != "existing"
    if launch.kind == "single":
        dist.init_process_group("gloo" if backend == "gloo" else backend, store=dist.HashStore(), rank=0,
                                world_size=1, timeout=timeout)
    elif owns:
        _init_default_group(backend, launch, timeout)
    # After the rendezvous: the ranks sharing this host are counted from every rank's host name.
    binding = _bind_cpus(launch.rank, launch.world_size) if device.type == "cpu" and launch.world_size > 1 else None
    store = _default_store()
    rt = TorchRuntime(launch, backend, device, owns, store, binding=binding)
    channel = failure.open_channel(store, launch.rank, float(cfg.comm_timeout),
                                   describe=lambda r: _describe(rank_map, r))
    channel.install_excepthook()
    if store is not None and launch.world_size > 1:
        channel.start_heartbeat(_neighbours(rank_map, launch.rank), _heartbeat_store(store))
    if not KEPT.exit_hook:  # kept across resets (process_state.Kept): atexit registers per process
        atexit.register(_shutdown_at_exit)  # a no-op after shutdown() or reset()
        KEPT.exit_hook = True
    _create_groups(rt, rank_map, launch.rank)
    rt.env_added = _export_rank_env(launch)
    smp_state.update(cfg=cfg, rank_map=rank_map, rank=launch.rank, local_rank=launch.local_rank,
                     local_size=launch.local_size, framework="torch", runtime=rt)
    if launch.rank == 0:
        for note in cfg.notes:
            logger.info(note)
        logger.info("initialised: %d rank(s) via %s, pp=%d tp=%d rdp=%d, placement %s, backend %s",
                    launch.world_size, launch.kind, rank_map.pp_size, rank_map.tp_size, rank_map.rdp_size,
                    rank_map.placement, backend)


# Note [re-init]: the rendezvous store of this process's first `init` is kept for later ones, with
# the count of inits (`KEPT.first_store`, `KEPT.inits` in process_state.py: they outlive
# smp.reset() on purpose). torch names the default group and the groups of `new_group` by counters
# that `destroy_process_group` resets, and a second rendezvous under torchrun reaches the agent's
# store again under the same prefix: a second `init` after `reset()` found the first one's gloo
# keys and hung (or one rank connected to the old addresses). Every later init therefore
# rendezvouses through the first store under a prefix of its own (`smp/init<N>`); all ranks run
# the same sequence of init/reset calls, so N agrees. Holding the store also keeps rank 0's
# TCPStore server alive for the peers between a reset and the next init.
def _init_default_group(backend: str, launch: Launch, timeout: timedelta) -> None:
    """Create the default process group; see Note [re-init]."""
    KEPT.inits += 1
    if KEPT.first_store is None:
        dist.init_process_group(backend, init_method=launch.init_method, rank=launch.rank,
                                world_size=launch.world_size, timeout=timeout)
        KEPT.first_store = _default_store()
        return
    dist.init_process_group(backend, store=dist.PrefixStore(f"smp/init{KEPT.inits}", KEPT.first_store),
                            rank=launch.rank, world_size=launch.world_size, timeout=timeout)


def _bind_cpus(rank: int, world: int) -> affinity.Binding | None:
    """Bind this rank to its share of its host's CPUs (affinity.py); rank 0 logs where every rank went.

    Every thread the process has moves (gloo's included); threads started later inherit the mask.
    """
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    binding = affinity.bind(*affinity.host_slot(hosts, rank))
    bound: list[Any] = [None] * world
    dist.all_gather_object(bound, binding.cpus if binding is not None else None)
    if rank == 0 and any(bound):
        logger.info("CPU binding (SMP_CPU_AFFINITY=keep leaves each mask as it is): %s",
                    affinity.describe(hosts, bound))
    return binding


def _export_rank_env(launch: Launch) -> dict[str, str]:
    """Set RANK, WORLD_SIZE and LOCAL_RANK where unset (scripts read them, as under SMP v1).

    Returns what it added, for `reset` to remove: left in place, they made the next single-process
    init after a reset take itself for a torchrun launch and wait for a MASTER_ADDR.
    """
    added = {}
    for name, value in (("RANK", launch.rank), ("WORLD_SIZE", launch.world_size), ("LOCAL_RANK", launch.local_rank)):
        if name not in os.environ:
            added[name] = os.environ[name] = str(value)
    return added


def _describe(rank_map: RankMap, rank: int) -> str:
    c = rank_map.coord(rank)
    return f"rank {rank} (pp_rank {c.pp_rank}, tp_rank {c.tp_rank}, rdp_rank {c.rdp_rank})"


def _neighbours(rank_map: RankMap, rank: int) -> set[int]:
    """The ranks this one talks to: the members of its own groups (the ones its heartbeat watches)."""
    return {r for kind in (GroupKind.PP, GroupKind.TP, GroupKind.RDP, GroupKind.DP, GroupKind.MP)
            for r in rank_map.group(kind, rank)} - {rank}


def _heartbeat_store(store: Any) -> Any:
    """A client of its own for the heartbeat thread, with a short timeout.

    A separate connection keeps the beat from queueing behind the training thread's store calls, and
    the short timeout keeps a store that stopped answering from holding the thread (or the exit) for
    the full communication timeout.
    """
    try:
        own = store.clone()
        own.set_timeout(timedelta(seconds=10))
    except Exception:  # noqa: BLE001 - a store without clone(): share the job's client
        own = store
    return dist.PrefixStore("smp", own)


def _create_groups(rt: TorchRuntime, rank_map: RankMap, rank: int) -> None:
    """One process group per (kind, rank list); identical lists share one group."""
    world = dist.group.WORLD
    made: dict[tuple[int, ...], Any] = {tuple(range(rank_map.world_size)): world}
    for kind in (GroupKind.PP, GroupKind.TP, GroupKind.RDP, GroupKind.DP, GroupKind.MP):
        for ranks in rank_map.groups(kind):
            key = tuple(sorted(ranks))
            if key not in made:
                # Every rank creates every group, in the same order (torch.distributed requires it).
                made[key] = dist.new_group(list(key), backend=rt.backend if "nccl" in rt.backend else None)
        mine = rank_map.group(kind, rank)
        rt.groups[kind] = made[tuple(sorted(mine))]
        rt.group_ranks[kind] = mine
    rt.groups[GroupKind.WORLD] = world
    rt.group_ranks[GroupKind.WORLD] = list(range(rank_map.world_size))
    # The pipeline engine gets its own PP groups so its messages never mix with user collectives.
    for ranks in rank_map.groups(GroupKind.PP):
        pg = dist.new_group(sorted(ranks)) if rank_map.world_size > 1 else world
        if rank in ranks:
            rt.engine_group = pg


def runtime() -> TorchRuntime:
    """The torch runtime of this process; raises NotInitializedError before `init`."""
    rt = smp_state.current().runtime
    if not isinstance(rt, TorchRuntime):
        raise NotInitializedError("smp is not initialised: call smp.init(config) first")
    return rt


def is_initialized() -> bool:
    """Whether ``smp.init`` has run in this process (and ``smp.reset`` has not undone it)."""
    return isinstance(smp_state.current().runtime, TorchRuntime)


def reset() -> None:
    """Tear down what `init` built (process groups it created, the state), so `init` can run again.

    Drops all process state of smp (`smp.state.reset`, which also drops and closes the frontend's
    `TorchState`); what a reset keeps on purpose is `process_state.KEPT`.
    """
    rt = smp_state.current().runtime
    close_all()  # the microbatch threads of every model's engine: a model does not outlive a reset
    failure.set_channel(None)  # before the groups go: the heartbeat's exit mark still reaches the store
    if isinstance(rt, TorchRuntime) and dist.is_initialized():
        if rt.owns_default_group:
            dist.destroy_process_group()
        else:
            for kind, pg in rt.groups.items():
                if kind != GroupKind.WORLD and pg is not dist.group.WORLD:
                    try:
                        dist.destroy_process_group(pg)
                    except Exception:  # noqa: BLE001 - already gone
                        pass
    if isinstance(rt, TorchRuntime):
        for name, value in rt.env_added.items():
            if os.environ.get(name) == value:
                del os.environ[name]
        affinity.restore(rt.binding)
    smp_state.reset()


def shutdown() -> None:
    """Release communication resources at exit (SMP v1 name)."""
    reset()


def _shutdown_at_exit() -> None:
    # SMP v1 scripts never call shutdown. A gloo process group still alive at interpreter exit can
    # abort the process ("terminate called without an active exception") while a peer is still
    # working, and torchrun then kills the whole job: tear it down first.
    if smp_state.current().runtime is not None:
        try:
            reset()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


def config() -> Config:
    cfg = smp_state.current().cfg
    if cfg is None:
        raise NotInitializedError("smp is not initialised: call smp.init(config) first")
    return cfg
