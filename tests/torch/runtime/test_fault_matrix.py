"""Fault matrix: every way a rank can fail ends every rank fast, naming the rank that failed.

Each case launches a small pipelined training job as separate processes, either with no supervisor
(a bare launch: RANK/WORLD_SIZE/MASTER_ADDR set by hand, so the survivors must notice the fault
themselves; the TCPStore then lives in rank 0) or under ``torchrun``. One rank fails at a chosen
step, in a chosen way, and each case asserts per surviving rank: a non-zero exit, an error naming
the failing rank, and the time from the fault to that exit. The ``comm_timeout`` is 120 s and the
asserted time-to-fail 20 s, so a case fails if detection falls back to the timeout; the stall case
(a rank alive but not answering) is the one named *at* the timeout, which is short there.

This file is also the training script: ``python test_fault_matrix.py --fault kill --rank 1 ...``.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BIN = os.path.dirname(sys.executable)
FAULT_AT = "SMP-FAULT-AT"
COMM_TIMEOUT = 120.0
TIME_TO_FAIL = 20.0
STALL_TIMEOUT = 6.0

pytestmark = pytest.mark.slow  # 16 launches of 2-4 processes: about 3.5 min on a loaded 2-core box


# --- the training script ------------------------------------------------------------------------

def _script(args: argparse.Namespace) -> None:
    import smp.torch as smp
    import torch

    # Manual placement: stage a on pp_rank 0, stage b on pp_rank 1, whatever the timings.
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True, "auto_partition": False,
              "default_partition": 0, "comm_timeout": args.comm_timeout})
    me = smp.rank()
    faulty = me == args.rank

    def fault(where: str) -> None:
        if not faulty or where != args.where or step != args.step:
            return
        print(f"{FAULT_AT} {time.time():.3f}", flush=True)
        if args.fault == "raise":
            raise ValueError(f"injected failure in {where} on rank {me}")
        if args.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if args.fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen: the process exists, its heartbeat thread too
        if args.fault == "exit":
            sys.exit(0)
        if args.fault == "stall":
            time.sleep(1e6)

    class Stage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            fault("forward")
            y = torch.relu(self.lin(x))
            if y.requires_grad:
                y.register_hook(lambda g: (fault("backward"), g)[1])
            return y

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            with smp.partition(0):
                self.a = Stage()
            with smp.partition(1):
                self.b = Stage()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    torch.manual_seed(0)
    model = smp.DistributedModel(Net())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))

    @smp.step
    def train_step(model: smp.DistributedModel, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        model.backward(loss)
        return loss

    steps = args.steps
    if args.fault == "uneven" and smp.rdp_rank() == 1:
        steps -= 1  # this DP replica ran out of data one step early and ends normally
    for step in range(steps):
        fault("step")
        opt.zero_grad()
        train_step(model, torch.randn(4, 8))
        opt.step()
        if step == args.step - 1:
            time.sleep(0.5)  # every rank is well into training when the fault comes
    if args.fault == "uneven" and faulty:
        # The fault is the moment this replica stops, after its last step.
        print(f"{FAULT_AT} {time.time():.3f}", flush=True)
    print(f"rank {me} finished", flush=True)


def _main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fault", required=True, choices=["raise", "kill", "stop", "exit", "stall", "uneven", "none"])
    p.add_argument("--where", default="forward", choices=["forward", "backward", "step"])
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--step", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--comm-timeout", type=float, default=COMM_TIMEOUT)
    _script(p.parse_args())


# --- launching and judging ----------------------------------------------------------------------

@dataclass
class Rank:
    rank: int
    code: int | None
    out: str
    ended: float  # wall-clock time of exit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fault_args(fault: str, rank: int, where: str, comm_timeout: float, step: int = 2) -> list[str]:
    return [os.path.abspath(__file__), "--fault", fault, "--rank", str(rank), "--where", where, "--step", str(step),
            "--comm-timeout", str(comm_timeout)]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                     "SMP_RENDEZVOUS", "TORCHELASTIC"))}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", SMP_LOG_LEVEL="WARNING", PYTHONUNBUFFERED="1")
    return env


def _collect(procs: list[subprocess.Popen[str]], limit: float, needed: set[int] | None = None) -> list[Rank]:
    """Wait for the ``needed`` processes (default all), then kill what is left; exit times by polling."""
    outs: list[list[str]] = [[] for _ in procs]
    readers = [threading.Thread(target=lambda p=p, o=o: o.extend(p.stdout or []), daemon=True)
               for p, o in zip(procs, outs)]
    for t in readers:
        t.start()
    ended: dict[int, float] = {}
    deadline = time.monotonic() + limit
    needed = set(range(len(procs))) if needed is None else needed
    while not needed <= set(ended) and time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = time.time()
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    for t in readers:
        t.join(timeout=5)
    return [Rank(i, p.returncode if i in ended else None, "".join(o), ended.get(i, float("nan")))
            for i, (p, o) in enumerate(zip(procs, outs))]


def bare_launch(world: int, args: list[str], limit: float = 120.0, file_store: bool = False,
                needed: set[int] | None = None) -> list[Rank]:
    """Start ``world`` ranks with no supervisor: nobody cleans up after a rank that dies.

    Waits for the ``needed`` ranks (default all) and kills the rest (a frozen rank stays frozen).
    """
    port = _free_port()
    tmp = tempfile.mkdtemp(prefix="smp-fault-")
    procs = []
    for r in range(world):
        env = _env()
        env.update(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if file_store:
            env["SMP_RENDEZVOUS_FILE"] = os.path.join(tmp, "rendezvous")
        procs.append(subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return _collect(procs, limit, needed)


def _fault_time(ranks: list[Rank]) -> float:
    for r in ranks:
        m = re.search(rf"{FAULT_AT} ([0-9.]+)", r.out)
        if m:
            return float(m.group(1))
    raise AssertionError("no rank reached the fault:\n" + _dump(ranks))


def _dump(ranks: list[Rank]) -> str:
    return "".join(f"\n--- rank {r.rank} (exit {r.code}):\n{r.out[-3000:]}" for r in ranks)


def _judge(ranks: list[Rank], culprit: int, error: str, named: str, within: float = TIME_TO_FAIL) -> dict[int, float]:
    """Every rank but ``culprit`` exits non-zero within ``within`` s of the fault, with ``error`` naming ``named``."""
    t0 = _fault_time(ranks)
    took = {}
    for r in ranks:
        if r.rank == culprit:
            continue
        assert r.code is not None, f"rank {r.rank} hung{_dump(ranks)}"
        assert r.code != 0, f"rank {r.rank} exited 0 after rank {culprit}'s fault{_dump(ranks)}"
        assert error in r.out and named in r.out, f"rank {r.rank} did not name {named!r} ({error}){_dump(ranks)}"
        took[r.rank] = r.ended - t0
        assert took[r.rank] < within, f"rank {r.rank} took {took[r.rank]:.1f} s to fail{_dump(ranks)}"
    print(f"time to fail by rank: { {k: round(v, 1) for k, v in took.items()} }")
    return took


# --- pp=2, bare launch --------------------------------------------------------------------------

@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_an_exception_ends_every_rank_with_that_error(rank: int, where: str) -> None:
    ranks = bare_launch(2, _fault_args("raise", rank, where, COMM_TIMEOUT))
    _judge(ranks, rank, "injected failure", f"rank {rank}")
    assert ranks[rank].code not in (0, None) and "ValueError: injected failure" in ranks[rank].out


@pytest.mark.parametrize("rank", [0, 1])
def test_a_killed_rank_is_named_within_seconds(rank: int) -> None:
    # Killing rank 0 also kills the TCPStore it hosts: rank 1 must say so instead of waiting.
    ranks = bare_launch(2, _fault_args("kill", rank, "forward", COMM_TIMEOUT))
    assert ranks[rank].code == -signal.SIGKILL
    _judge(ranks, rank, "PeerLostError", f"rank {rank}")


def test_a_killed_rank_is_named_with_a_file_store() -> None:
    # On one host the survivor sees the dead pid at once, not after the heartbeat's 5 s of silence.
    ranks = bare_launch(2, _fault_args("kill", 1, "backward", COMM_TIMEOUT), file_store=True)
    _judge(ranks, 1, "PeerLostError", "rank 1 (pp_rank 1, tp_rank 0, rdp_rank 0")
    assert "its process no longer exists" in ranks[0].out


def test_a_frozen_rank_is_named_when_its_heartbeat_stops() -> None:
    # SIGSTOP: the process exists but its heartbeat thread is frozen too; 5 s of silence decide.
    ranks = bare_launch(2, _fault_args("stop", 1, "forward", COMM_TIMEOUT), needed={0})
    _judge(ranks, 1, "PeerLostError", "rank 1 (pp_rank 1, tp_rank 0, rdp_rank 0")
    assert "its heartbeat stopped" in ranks[0].out and "frozen (SIGSTOP)" in ranks[0].out


def test_a_rank_that_exits_cleanly_mid_training_is_named() -> None:
    ranks = bare_launch(2, _fault_args("exit", 1, "step", COMM_TIMEOUT))
    assert ranks[1].code == 0
    _judge(ranks, 1, "PeerLostError", "rank 1 (pp_rank 1, tp_rank 0, rdp_rank 0")
    assert "left the job" in ranks[0].out


def test_a_stalled_rank_is_named_at_the_comm_timeout() -> None:
    # Alive but not answering: nobody can tell "slow" from "stuck" before comm_timeout, and then
    # both the waiting rank and the stalled one stop, naming the stalled rank and the key.
    ranks = bare_launch(2, _fault_args("stall", 1, "forward", STALL_TIMEOUT))
    took = _judge(ranks, -1, "PeerStalledError", "rank 1 (pp_rank 1", within=STALL_TIMEOUT + 15)
    assert all(t >= STALL_TIMEOUT - 0.5 for t in took.values()), took
    assert "comm_timeout" in ranks[0].out and "did not answer rank 0" in ranks[0].out
    assert "reported this rank (1) as not answering" in ranks[1].out


def test_a_run_without_faults_ends_cleanly_on_every_rank() -> None:
    ranks = bare_launch(2, _fault_args("none", 0, "forward", COMM_TIMEOUT))
    assert [r.code for r in ranks] == [0, 0], _dump(ranks)
    assert "Error" not in "".join(r.out for r in ranks), _dump(ranks)


# --- pp=2 x dp=2, bare launch: the culprit is named on ranks that never talk to it ------------

@pytest.mark.parametrize("where", ["forward", "backward"])
def test_pp2_dp2_a_killed_rank_is_named_on_every_survivor(where: str) -> None:
    # Killed in backward, rank 3 dies right before the gradient allreduce with its DP peer rank 1,
    # which sees the dropped connection first and must still name rank 3, not itself.
    ranks = bare_launch(4, _fault_args("kill", 3, where, COMM_TIMEOUT))
    _judge(ranks, 3, "PeerLostError", "rank 3 (pp_rank 1, tp_rank 0, rdp_rank 1")
    for r in ranks[:3]:
        assert "rank 1 failed" not in r.out and "Connection reset" not in r.out.split("Traceback")[-1]


def test_pp2_dp2_an_exception_is_named_on_every_survivor() -> None:
    ranks = bare_launch(4, _fault_args("raise", 2, "forward", COMM_TIMEOUT))
    _judge(ranks, 2, "injected failure", "rank 2")


def test_pp2_dp2_uneven_data_across_dp_replicas_is_named() -> None:
    # DP replica 1 (ranks 2, 3) runs one step fewer and ends normally; replica 0 must not wait
    # comm_timeout in its extra step's gradient allreduce.
    ranks = bare_launch(4, _fault_args("uneven", 2, "step", COMM_TIMEOUT))
    assert ranks[2].code == 0 and ranks[3].code == 0, _dump(ranks)
    t0 = _fault_time(ranks)
    for r in ranks[:2]:
        assert r.code not in (0, None) and "PeerLostError" in r.out and "left the job" in r.out, _dump(ranks)
        assert re.search(r"rank [23] \(pp_rank [01], tp_rank 0, rdp_rank 1", r.out), _dump(ranks)
        assert "uneven data across DP replicas" in r.out
        assert r.ended - t0 < TIME_TO_FAIL, _dump(ranks)
    print(f"time to fail by rank: { {r.rank: round(r.ended - t0, 1) for r in ranks[:2]} }")


# --- under torchrun: the agent ends the job; the output must still name the rank -------------------

def _torchrun(args: list[str], nproc: int = 2) -> tuple[int | None, str, float]:
    env = _env()
    port = _free_port()
    proc = subprocess.Popen([os.path.join(BIN, "torchrun"), "--nproc-per-node", str(nproc), "--master-port", str(port),
                             *args], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    (r,) = _collect([proc], 120.0)
    return r.code, r.out, r.ended


def test_torchrun_a_killed_rank_ends_the_job_fast_and_is_named() -> None:
    code, out, ended = _torchrun(_fault_args("kill", 1, "forward", COMM_TIMEOUT))
    assert code not in (0, None), out
    took = ended - _fault_time([Rank(0, code, out, ended)])
    assert took < TIME_TO_FAIL, out
    print(f"time to fail (job): {took:.1f}")
    # The agent names the dead local rank (and its signal) in its failure report.
    assert re.search(r"local_rank\s*:\s*1", out) and "SIGKILL" in out, out


def test_torchrun_a_rank_that_exits_cleanly_is_named_by_the_others() -> None:
    # A worker that exits 0 is a success to torchrun, which keeps waiting for the rest: the survivor
    # has to notice and fail, naming it.
    code, out, ended = _torchrun(_fault_args("exit", 1, "step", COMM_TIMEOUT))
    assert code not in (0, None), out
    took = ended - _fault_time([Rank(0, code, out, ended)])
    assert took < TIME_TO_FAIL, out
    print(f"time to fail (job): {took:.1f}")
    assert "PeerLostError" in out and "rank 1 (pp_rank 1, tp_rank 0, rdp_rank 0" in out and "left the job" in out


if __name__ == "__main__":
    _main()
