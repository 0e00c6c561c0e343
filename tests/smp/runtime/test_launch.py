"""Launcher detection from the environment (torchrun, Open MPI, MPICH, alone): no processes."""

from __future__ import annotations

from smp.runtime.launch import detect


def test_detect_openmpi_and_mpich_environments() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "node0"}
    launch = detect(env)
    assert (launch.kind, launch.rank, launch.world_size, launch.local_rank, launch.local_size) == ("mpi", 3, 8, 1, 2)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_PORT"]) == ("3", "8", "1", "29500")
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
           "SMP_RENDEZVOUS_FILE": "/tmp/x"}
    launch = detect(env)
    assert (launch.kind, launch.rank, launch.init_method) == ("mpi", 1, "file:///tmp/x")
    assert launch.local_named
    # MPICH without its local variables: detection guesses local rank 0 of a world-sized host (and
    # writes the guess into the environment); the guess is not the launcher's word.
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "SMP_RENDEZVOUS_FILE": "/tmp/x"}
    launch = detect(env)
    assert (launch.local_rank, launch.local_size, launch.local_named) == (0, 2, False)
    assert not detect(env).local_named  # again, now that LOCAL_RANK and LOCAL_WORLD_SIZE hold the guess
    assert detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}).local_named
    assert not detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}).local_named
    assert detect({}).kind == "single"
    assert detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}).kind == "torchrun"
