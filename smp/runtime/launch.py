"""How this process was launched: torchrun, mpirun/mpiexec, an existing process group, or alone.

The result says which rank this is, how many there are, and how to rendezvous. Nothing here
creates a process group; the frontend's ``init`` does, after the configuration is validated.
Framework-free: an existing process group comes in as ``dist_initialized`` / ``dist_rank`` /
``dist_world``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from smp.errors import LaunchError

RENDEZVOUS_FILE_ENV = "SMP_RENDEZVOUS_FILE"
DEFAULT_PORT = 29500


@dataclass(frozen=True)
class Launch:
    """The launcher facts for this process.

    Attributes:
        kind: "existing" (torch.distributed already initialised), "torchrun" (RANK/WORLD_SIZE env),
            "mpi" (OMPI_COMM_WORLD_* or PMI_*), or "single".
        init_method: "env://" or "file://..." (None for "existing" and "single").
        local_named: whether the launcher named both this process's local rank and the local size
            (otherwise they are guesses: rank 0 of a host as big as the world), so that ranks of
            one host can share its cores out (frontends/torch/runtime/affinity.py).
    """

    kind: str
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    init_method: str | None
    local_named: bool = False


_GUESSED = "SMP_LOCAL_GUESSED"  # set where LOCAL_RANK / LOCAL_WORLD_SIZE hold detect's guesses


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        if name in env and env[name] != "":
            try:
                return int(env[name])
            except ValueError:
                raise LaunchError(f"environment variable {name}={env[name]!r} is not an integer") from None
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _rendezvous(env: Mapping[str, str]) -> str:
    if env.get(RENDEZVOUS_FILE_ENV):
        return "file://" + env[RENDEZVOUS_FILE_ENV]
    return "env://"


def _mpi_rendezvous(env: MutableMapping[str, str], rank: int, size: int, local_size: int) -> str:
    """MASTER_ADDR/MASTER_PORT for an MPI launch: from the env, from mpi4py, or localhost on one host."""
    if env.get(RENDEZVOUS_FILE_ENV) or env.get("MASTER_ADDR"):
        env.setdefault("MASTER_PORT", str(DEFAULT_PORT))
        return _rendezvous(env)
    try:
        from mpi4py import MPI

        world: Any = MPI.COMM_WORLD
    except ImportError:
        world = None
    if world is not None:
        comm = world
        addr = (socket.gethostname(), _free_port()) if rank == 0 else None
        host, port = comm.bcast(addr, root=0)
        env["MASTER_ADDR"], env["MASTER_PORT"] = host, str(port)
        return "env://"
    if local_size == size:
        env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", env.get("MASTER_PORT", str(DEFAULT_PORT))
        return "env://"
    raise LaunchError(
        "MPI launch across hosts without a rendezvous address: set MASTER_ADDR and MASTER_PORT "
        "(e.g. mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=29500), or install mpi4py")


def detect(env: MutableMapping[str, str] | None = None, *, dist_initialized: bool = False,
           dist_rank: int = 0, dist_world: int = 1) -> Launch:
    """Work out the launch; for MPI launches also sets RANK, WORLD_SIZE, LOCAL_RANK as SMP v1 did.

    Args:
        env: the environment (default ``os.environ``; MPI detection writes into it).
        dist_initialized, dist_rank, dist_world: the state of an existing default process group.
    """
    env = os.environ if env is None else env
    given_rank = _int(env, "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
    local_size = _int(env, "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
    # The MPI branch below writes its guesses into LOCAL_RANK / LOCAL_WORLD_SIZE (as SMP v1 did)
    # and marks them, so a later detect (an init after reset) does not take them for the launcher's.
    named = given_rank is not None and local_size is not None and env.get(_GUESSED) != "1"
    local_rank = given_rank or 0
    if dist_initialized:
        return Launch("existing", dist_rank, dist_world, local_rank, local_size or dist_world, None, named)
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank is not None and world is not None:
        return Launch("torchrun", rank, world, local_rank, local_size or world, _rendezvous(env), named)
    rank = _int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
    world = _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    if rank is not None and world is not None:
        local_size = local_size or world
        init_method = _mpi_rendezvous(env, rank, world, local_size)
        env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"] = str(rank), str(world), str(local_rank)
        env["LOCAL_WORLD_SIZE"] = str(local_size)
        if not named:
            env[_GUESSED] = "1"
        return Launch("mpi", rank, world, local_rank, local_size, init_method, named)
    return Launch("single", 0, 1, 0, 1, None)
