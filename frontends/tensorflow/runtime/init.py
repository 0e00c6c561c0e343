"""`smp.init` for TensorFlow: validate the config, find the MPI ranks, one communicator per group kind.

Order of work: detect the launch (no communication), resolve and validate the configuration
(`smp.config.resolve`, the same errors as ``smp.torch``; raises before any communicator exists),
then a timed barrier over the world (every rank reached init; at least `INIT_TIMEOUT_S`), the job's store (store.py,
kept by every rank over MPI: no shared file system needed) with the failure channel, heartbeat and
exit guard (failure.py), one MPI sub-communicator per group
kind (``COMM_WORLD.Split``; identical rank lists share one), ``engine_comm`` and the `Transport`.

Launches: ``mpiexec``/``mpirun`` (MPICH's ``PMI_*``, Open MPI's ``OMPI_COMM_WORLD_*``), or one
process without a launcher (world 1). torchrun-style ``RANK``/``WORLD_SIZE`` without an MPI
launch and a world over 1 is refused with the command to use: the ranks of smp.tensorflow are MPI
processes (mpi4py is the transport), and joining separately started processes into one MPI job
would need MPI's dynamic-process calls and a port exchange that Hydra does not offer.

Calling `init` again is a no-op (with a warning if the configuration differs); `reset` frees
what init built so that init can run again in the same process.

Importers inside smp.tensorflow write ``from smp.tensorflow.runtime.init import runtime``: the
package re-exports the function ``init`` under the module's name.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mpi4py import MPI

import smp.state as smp_state
from smp.config import Config, resolve
from smp.errors import LaunchError, NotInitializedError
from smp.runtime.flags import env_flag
from smp.runtime.launch import Launch, detect
from smp.topology import GroupKind, RankMap

from . import failure
from .mpi import all_true, set_backoff, wait_request
from .store import MPIStore
from .transport import Transport

__all__ = ["INTER_OP_POOL", "OVERLAP_ENV", "TFRuntime", "config", "init", "is_initialized", "overlap_requested", "reset",
           "runtime"]

logger = logging.getLogger("smp")

_MPI_ENV = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_KINDS = (GroupKind.PP, GroupKind.TP, GroupKind.RDP, GroupKind.DP, GroupKind.MP)
INIT_TIMEOUT_S = 300.0  # the least time init waits for the last rank to arrive
_exit_hook_registered = False  # atexit registers per process, so this outlives reset()


@dataclass
class TFRuntime:
    """What `init` built in this process.

    Attributes:
        launch: the launch facts (`smp.runtime.launch.Launch`, kind "mpi" or "single").
        comm: ``MPI.COMM_WORLD``.
        engine_comm: a duplicate of the world for the engine's tensor messages (global ranks as peers).
        object_comm: a duplicate of the world for ``send`` / ``recv_from`` / ``broadcast``.
        groups: this rank's communicator per group kind (``WORLD`` included: smp's own duplicate),
            ranks in group-rank order.
        group_ranks: each of those groups as global ranks, in group-rank order.
        store: the job's `MPIStore` (None for one process).
        transport: the tensor transport over ``engine_comm``.
        exit_guard: ends the job on an uncaught exception (None for one process).
        overlap: steps overlap microbatches in the scheduler's order (`overlap_requested` on every
            rank; agreed at `init`, since a lockstep rank and a plan-ordered one can deadlock).
    """

    launch: Launch
    comm: Any
    engine_comm: Any
    object_comm: Any
    groups: dict[GroupKind, Any] = field(default_factory=dict)
    group_ranks: dict[GroupKind, list[int]] = field(default_factory=dict)
    store: MPIStore | None = None
    overlap: bool = False
    transport: Transport | None = None
    exit_guard: failure.ExitGuard | None = None
    owned_comms: list[Any] = field(default_factory=list)  # what reset frees
    env_added: dict[str, str] = field(default_factory=dict)  # what init added to os.environ; reset removes it


def _setup_logging(rank: int) -> None:
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[smp rank {rank}] %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("SMP_LOG_LEVEL", "INFO"))
    logger.propagate = False


def _detect_launch() -> Launch:
    """The launch, from the environment: MPI first (its variables are the truth under mpiexec)."""
    world = MPI.COMM_WORLD
    if any(os.environ.get(name, "") != "" for name in _MPI_ENV):
        # Launch.detect reads RANK/WORLD_SIZE first (torchrun); under mpiexec the MPI variables are the
        # truth. MPI already connected the ranks, so detect's TCP rendezvous address is not needed
        # (a MASTER_ADDR in its private copy of the environment tells it so).
        env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_ENV}
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        launch = detect(env)
    else:
        launch = detect(dict(os.environ))
        if launch.kind == "torchrun" and launch.world_size > 1:
            raise LaunchError(
                f"RANK={os.environ.get('RANK')} WORLD_SIZE={os.environ.get('WORLD_SIZE')} are set but this is not an "
                "MPI launch: smp.tensorflow's ranks are MPI processes (mpi4py is its transport), so torchrun-style "
                f"launches are not supported. Launch with: mpiexec -n {launch.world_size} python <your script> "
                "(unset RANK and WORLD_SIZE, or drop them for a one-process run)")
        if launch.kind != "single":
            launch = Launch("single", 0, 1, 0, 1, None)
    if (launch.rank, launch.world_size) != (world.Get_rank(), world.Get_size()):
        raise LaunchError(
            f"the launch environment says rank {launch.rank} of {launch.world_size}, but MPI.COMM_WORLD is rank "
            f"{world.Get_rank()} of {world.Get_size()}: mpi4py uses a different MPI than the mpiexec that started "
            "this process. Launch with the mpiexec of the MPI mpi4py was built for (the venv's bin/mpiexec)")
    return launch


def init(config: Mapping[str, Any] | str | None = None) -> None:
    """Initialise smp for TensorFlow. Works under mpiexec/mpirun or as one process.

    Args:
        config: a dict of configuration keys, or the path of a JSON file. The environment variable
            ``SM_HP_MP_PARAMETERS`` (JSON) overrides it key by key, as in SMP v1.

    Raises:
        SMPConfigError: listing every configuration problem, before any communicator is created.
        LaunchError: not an MPI launch with several ranks, or not the MPI that mpi4py was built for.

    Example:
        >>> import smp.tensorflow as smp
        >>> smp.init({"pipeline_parallel_degree": 1, "microbatches": 2})
        >>> smp.num_microbatches()
        2
    """
    global _exit_hook_registered
    state = smp_state.current()
    if state.initialized:
        again = resolve(config, world_size=state.cfg.world_size if state.cfg else None, framework="tensorflow")
        if state.cfg is not None and again.as_dict() != state.cfg.as_dict():
            logger.warning("smp.init was already called; the new configuration is ignored (call smp.reset() first)")
        return
    launch = _detect_launch()
    cfg = resolve(config, world_size=launch.world_size, framework="tensorflow")
    rank_map = RankMap.from_world(launch.world_size, cfg.pipeline_parallel_degree, cfg.tensor_parallel_degree,
                                  cfg.placement_strategy)
    _setup_logging(launch.rank)
    timeout = float(cfg.comm_timeout)
    world = MPI.COMM_WORLD
    if launch.world_size > 1:
        # Every rank reached init: after this the collective communicator calls below complete promptly.
        # Ranks reach init at different times (TF's import alone differs by seconds on a loaded host,
        # rank 0 may download data first), so this wait is not held to a short comm_timeout.
        wait_request(world.Ibarrier(), "smp.init (every rank must call smp.init)", list(range(launch.world_size)),
                     timeout_s=max(timeout, INIT_TIMEOUT_S))
    # The store's own communicator: Dup is collective, and every rank reached init.
    store = MPIStore(world.Dup(), _neighbours(rank_map, launch.rank), timeout_s=min(timeout, 30.0)) \
        if launch.world_size > 1 else None
    channel = failure.open_channel(store, launch.rank, timeout, describe=lambda r: _describe(rank_map, r))
    channel.install_excepthook()
    rt = TFRuntime(launch, world, None, None, store=store)
    try:
        if store is not None:
            channel.start_heartbeat(_neighbours(rank_map, launch.rank))
            rt.exit_guard = failure.ExitGuard(channel, store, launch.world_size, world.Abort)
            rt.exit_guard.install()
        _create_comms(rt, rank_map, launch.rank)
        rt.transport = Transport(rt.engine_comm, rt.groups, rt.group_ranks)
    except BaseException:
        _teardown(rt)
        failure.set_channel(None)
        raise
    if not _exit_hook_registered:
        atexit.register(_shutdown_at_exit)  # a no-op after reset()
        _exit_hook_registered = True
    rt.env_added = _export_rank_env(launch)
    smp_state.update(cfg=cfg, rank_map=rank_map, rank=launch.rank, local_rank=launch.local_rank,
                     local_size=launch.local_size, framework="tensorflow", runtime=rt)
    if "keras" in sys.modules and "tensorflow" in sys.modules:
        # optimizer.get_gradients for SMP v1 scripts (cheap: Keras is loaded). Otherwise the first
        # DistributedModel installs it, so a runtime-only script never imports TensorFlow here.
        from ..optimizers import install_for_session

        install_for_session()
    rt.overlap = all_true(rt.comm, overlap_requested(), f"agreeing on {OVERLAP_ENV} (overlap mode)")
    set_backoff(rt.overlap)
    _size_inter_op_pool(rt.overlap)
    if launch.rank == 0:
        for note in cfg.notes:
            logger.info(note)
        logger.info("initialised: %d rank(s) via %s, pp=%d rdp=%d, placement %s, transport mpi4py (MPI %s)",
                    launch.world_size, launch.kind, rank_map.pp_size, rank_map.rdp_size, rank_map.placement,
                    ".".join(map(str, MPI.Get_version())))


def _create_comms(rt: TFRuntime, rank_map: RankMap, rank: int) -> None:
    """One communicator per group kind (identical partitions of the world share one), engine and object comms.

    Every rank runs the same sequence of collective Split/Dup calls (MPI requires it): the decisions
    below depend only on the rank map, which every rank has.
    """
    world = rt.comm
    made: dict[tuple[tuple[int, ...], ...], Any] = {}

    def split(members_of: list[list[int]]) -> Any:
        """The communicator of this rank's group; ``members_of[r]`` is rank r's group in group-rank order."""
        key = tuple(tuple(m) for m in members_of)
        if key not in made:
            distinct = list(dict.fromkeys(key))  # every rank computes the same colours from the same map
            mine = key[rank]
            # key = position in the group: the communicator's ranks are the group ranks.
            made[key] = world.Split(distinct.index(mine), mine.index(rank))
            rt.owned_comms.append(made[key])
        return made[key]

    everyone = list(range(rank_map.world_size))
    rt.groups[GroupKind.WORLD] = split([everyone] * rank_map.world_size)
    rt.group_ranks[GroupKind.WORLD] = everyone
    for kind in _KINDS:
        rt.groups[kind] = split([rank_map.group(kind, r) for r in everyone])
        rt.group_ranks[kind] = rank_map.group(kind, rank)
    rt.engine_comm = world.Dup()
    rt.object_comm = world.Dup()
    rt.owned_comms += [rt.engine_comm, rt.object_comm]


def _export_rank_env(launch: Launch) -> dict[str, str]:
    """Set RANK, WORLD_SIZE and LOCAL_RANK where unset (scripts read them, as under SMP v1); `reset` removes them."""
    added = {}
    for name, value in (("RANK", launch.rank), ("WORLD_SIZE", launch.world_size), ("LOCAL_RANK", launch.local_rank)):
        if name not in os.environ:
            added[name] = os.environ[name] = str(value)
    return added


def _describe(rank_map: RankMap, rank: int) -> str:
    c = rank_map.coord(rank)
    return f"rank {rank} (pp_rank {c.pp_rank}, rdp_rank {c.rdp_rank})"


def _neighbours(rank_map: RankMap, rank: int) -> set[int]:
    """The ranks this one talks to: the members of its own groups (the ones its heartbeat watches)."""
    return {r for kind in _KINDS for r in rank_map.group(kind, rank)} - {rank}


OVERLAP_ENV = "SMP_TF_OVERLAP"
INTER_OP_POOL = 32  # threads; what overlap needs is `engine.schedule.min_inter_op_threads` (8-16 for most models)


def overlap_requested() -> bool:
    """Whether steps run this rank's work in the shared scheduler's order, overlapping microbatches.

    ``SMP_TF_OVERLAP=1`` (``true``, ``yes``, ``on``) turns it on, ``0`` (``false``, ``no``, ``off``)
    gives lockstep. Unset, it is on when this process is bound to part of the machine's CPUs
    (``mpiexec -bind-to core``; Open MPI binds 1-2 ranks per node to cores by default) and off
    otherwise: ranks that share every core compete for them, and on the dev box overlap was then
    slower than lockstep (``benchmarks/tf_pipeline.py``).

    Raises:
        LaunchError: any other value.
    """
    forced = env_flag(OVERLAP_ENV, "1: microbatches overlap in the scheduler's order, 0: lockstep (unset: overlap "
                              "when each rank is bound to its own cores)")
    if forced is not None:
        return forced
    if not hasattr(os, "sched_getaffinity"):
        return False
    return len(os.sched_getaffinity(0)) < (os.cpu_count() or 1)


def _size_inter_op_pool(overlap: bool) -> None:
    """With overlap (`overlap_requested`), give TF's inter-op pool `INTER_OP_POOL` threads.

    Waiting receives and start markers hold inter-op threads (`engine.schedule.min_inter_op_threads`
    says how many may wait at once); the size can be set only before TensorFlow's first op. If TF
    has started already, a step whose need the pool does not meet runs lockstep with a warning naming
    the fix. Measured: a pool of 88 threads on a rank bound to one core made the step 10-30 %
    slower than 12-32 (idle pool threads still take the core).
    """
    if not overlap:
        return
    import tensorflow as tf

    want = INTER_OP_POOL
    try:
        if tf.config.threading.get_inter_op_parallelism_threads() < want:
            tf.config.threading.set_inter_op_parallelism_threads(want)
    except RuntimeError as e:  # the context exists: too late
        logger.warning("%s: cannot size TensorFlow's inter-op pool (%s); call "
                       "tf.config.threading.set_inter_op_parallelism_threads(%d) before the first TF op",
                       OVERLAP_ENV, e, want)


def runtime() -> TFRuntime:
    """The TensorFlow runtime of this process; raises NotInitializedError before `init`."""
    rt = smp_state.current().runtime
    if not isinstance(rt, TFRuntime):
        raise NotInitializedError("smp is not initialised: call smp.init(config) first")
    return rt


def is_initialized() -> bool:
    """Whether ``smp.init`` has run in this process (and ``smp.reset`` has not undone it)."""
    return isinstance(smp_state.current().runtime, TFRuntime)


def _teardown(rt: TFRuntime) -> None:
    if rt.exit_guard is not None:
        rt.exit_guard.uninstall()
    if rt.transport is not None:
        rt.transport.close()
    for comm in rt.owned_comms:
        try:
            comm.Free()
        except Exception:  # noqa: BLE001 - already freed, or MPI is finalising
            pass
    rt.owned_comms = []


def reset() -> None:
    """Tear down what `init` built (communicators, store, the state), so `init` can run again.

    Drops all process state of smp (`smp.state.reset`, which also closes the frontend's `TFState`
    and the failure channel: the heartbeat marks this rank exited), then closes the job's store
    (which waits, at most the store's timeout, until every rank has closed it).
    """
    rt = smp_state.current().runtime
    if isinstance(rt, TFRuntime):
        _teardown(rt)
        for name, value in rt.env_added.items():
            if os.environ.get(name) == value:
                del os.environ[name]
    smp_state.reset()
    if isinstance(rt, TFRuntime) and rt.store is not None:
        rt.store.close()


def _shutdown_at_exit() -> None:
    # SMP v1 scripts never call a shutdown: mark this rank exited (peers finishing their last step
    # do not report it lost) and close the job's store with the others.
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
