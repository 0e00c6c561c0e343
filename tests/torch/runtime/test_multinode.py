"""smp.torch across two nodes, launched as users do: two torchrun agents (c10d rendezvous), or mpiexec
with two host entries. One machine stands in for two: both agents run here, on loopback.

- pp2 x dp2, then tp2 x pp2 after ``smp.reset()``: an unmodified HF Llama (``labels=`` in, its own
  loss, SGD with momentum) trains 3 steps and every rank compares its losses and its weights with
  the same model trained in one process on the whole batch;
- two agents of one rank each (pp2): the ranks count each other per host name, so they bind to
  different cores although both are local rank 0 of their agent (rank 0 logs where), and when the
  second node's rank is SIGKILLed the first node's rank names it, its host and pid, within seconds.

This file is also the training script: ``torchrun ... test_multinode.py --layouts pp2dp2,tp2pp2``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from tests.torch.runtime.test_fault_matrix import _collect

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BIN = os.path.dirname(sys.executable)
LAYOUTS = {"pp2dp2": {"pipeline_parallel_degree": 2}, "tp2pp2": {"pipeline_parallel_degree": 2,
                                                                  "tensor_parallel_degree": 2},
           "pp2": {"pipeline_parallel_degree": 2}}
STEPS, BATCH = 3, 4
FAULT_AT = "SMP-FAULT-AT"

pytestmark = pytest.mark.slow  # 3 launches of 2-4 processes, about 1 min on a loaded 2-core box


# --- the training script ------------------------------------------------------------------------

def _model() -> Any:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (BATCH, 8), generator=torch.Generator().manual_seed(step))


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(input_ids=_ids(step), labels=_ids(step)).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(smp: Any, layout: str, kill: int | None) -> None:
    smp.init({"microbatches": 2, "ddp": True, "comm_timeout": 60.0, **LAYOUTS[layout]})
    agent = os.environ.get("SMP_TEST_AGENT", "-")
    print(f"rank {smp.rank()} agent {agent} local_rank {smp.local_rank()} local_size {smp.local_size()} "
          f"cpus {sorted(os.sched_getaffinity(0))}", flush=True)
    with smp.tensor_parallelism(enabled=smp.tp_size() > 1):
        net = _model()
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    dp, replicas = smp.rdp_rank(), smp.rdp_size()
    losses = []
    for step in range(STEPS):
        if kill is not None and step == 1 and smp.rank() == kill:
            print(f"{FAULT_AT} {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        ids = _ids(step).chunk(replicas)[dp]  # this replica's share of the batch
        losses.append(train_step(model, ids).reduce_mean().item())
        opt.step()
    mean = smp.allgather(losses, smp.RDP_GROUP)
    losses = [sum(per_replica[s] for per_replica in mean) / replicas for s in range(STEPS)]
    weights = model.state_dict(gather_to_rank0=False)
    ref_losses, ref_weights = _reference()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for name, value in weights.items():
        torch.testing.assert_close(value, ref_weights[name], rtol=1e-4, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")
    print(f"rank {smp.rank()} {layout}: losses and {len(weights)} weights match one process", flush=True)
    smp.reset()


def _main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layouts", default="pp2dp2")
    p.add_argument("--kill", type=int, default=None, help="this rank SIGKILLs itself at step 1")
    args = p.parse_args()
    import smp.torch as smp

    for layout in args.layouts.split(","):
        _train(smp, layout, args.kill)


# --- launching ----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                     "SMP_RENDEZVOUS", "TORCHELASTIC"))}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", SMP_LOG_LEVEL="INFO", PYTHONUNBUFFERED="1", **extra)
    return env


def two_torchrun_agents(nproc: int, args: list[str], timeout: float = 240.0) -> list[tuple[int | None, str, float]]:
    """Two ``torchrun --nnodes 2`` agents meeting at a c10d rendezvous on loopback: (exit, output, end time) each."""
    port = _free_port()
    procs = []
    for node in (0, 1):
        cmd = [os.path.join(BIN, "torchrun"), "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node",
               str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
               f"smp-test-{port}", "--max-restarts", "0", os.path.abspath(__file__), *args]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(SMP_TEST_AGENT=f"node{node}"), text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True))
        if node == 0:
            _listening(port, 60.0)
    return _finish(procs, timeout)


def _listening(port: int, limit: float) -> None:
    """Wait until the first agent hosts the rendezvous store, as node0 of the endpoint does on a cluster.

    Both agents run on this host, and either would take the endpoint's port otherwise: the one that
    did is the store of the rendezvous, and when it is the second node's agent, killing that node
    takes the first node's agent down with it before its ranks can say anything.
    """
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"the first torchrun agent did not open its rendezvous port {port} within {limit:.0f} s")


def _finish(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int | None, str, float]]:
    """(exit, output, end time) of each launcher; the ones still running after ``timeout`` are killed."""
    return [(r.code, r.out, r.ended) for r in _collect(procs, timeout)]


def _dump(results: list[tuple[int | None, str, float]]) -> str:
    return "".join(f"\n--- launcher {i} (exit {code}):\n{out[-4000:]}" for i, (code, out, _) in enumerate(results))


def _matched(out: str, layouts: list[str], ranks: list[int]) -> None:
    for layout in layouts:
        for r in ranks:
            assert f"rank {r} {layout}: losses and" in out, f"rank {r} did not finish {layout}:\n{out[-4000:]}"


# --- tests --------------------------------------------------------------------------------------

def test_two_torchrun_nodes_pp2_dp2_and_tp2_pp2_match_one_process() -> None:
    results = two_torchrun_agents(2, ["--layouts", "pp2dp2,tp2pp2"])
    assert all(code == 0 for code, _, _ in results), _dump(results)
    everything = "".join(out for _, out, _ in results)
    _matched(everything, ["pp2dp2", "tp2pp2"], [0, 1, 2, 3])
    for node, (_, out, _) in enumerate(results):  # local ranks are per agent: 0 and 1 on each node
        seen = re.findall(rf"rank (\d) agent node{node} local_rank (\d) local_size (\d)", out)
        assert sorted((lr, ls) for _, lr, ls in seen) == [("0", "2"), ("0", "2"), ("1", "2"), ("1", "2")], out


def test_a_rank_killed_on_one_node_is_named_on_the_other_within_seconds() -> None:
    # One rank per agent: both are local rank 0 of 1, yet they share this host's cores out.
    results = two_torchrun_agents(1, ["--layouts", "pp2", "--kill", "1"])
    everything = "".join(out for _, out, _ in results)
    m = re.search(rf"{FAULT_AT} ([0-9.]+)", everything)
    assert m, _dump(results)
    fault_at = float(m.group(1))
    cpus = dict(re.findall(r"rank (\d) agent node\d local_rank 0 local_size 1 cpus (\[[\d, ]+\])", everything))
    assert sorted(cpus) == ["0", "1"], _dump(results)
    if len(os.sched_getaffinity(0)) >= 2 and os.environ.get("SMP_CPU_AFFINITY") != "keep":
        assert set(eval(cpus["0"])).isdisjoint(eval(cpus["1"])), cpus  # noqa: S307 - our own printed lists
        assert re.search(r"CPU binding .*host \S+: rank 0 on CPUs [\d,-]+, rank 1 on CPUs", everything), everything
    survivor = next(i for i, (_, out, _) in enumerate(results) if re.search(r"rank 0 agent node\d", out))
    code, out, ended = results[survivor]
    assert code not in (0, None), _dump(results)
    assert re.search(r"PeerLostError: rank 1 \(pp_rank 1, tp_rank 0, rdp_rank 0; pid \d+ on host [^)]+\) is gone",
                     out), _dump(results)
    assert ended - fault_at < 20, f"the surviving node ended {ended - fault_at:.1f} s after the kill{_dump(results)}"
    print(f"SIGKILL on node {1 - survivor}: the other node's agent ended {ended - fault_at:.1f} s later")


def test_pp2_dp2_a_rank_killed_on_one_node_is_named_by_both_ranks_of_the_other() -> None:
    # Rank 3 (pp_rank 1 of the second replica) dies; its agent then stops rank 2 (SIGTERM), so the
    # whole second node is gone. Ranks 0 and 1 run on the other agent and must both stop naming one
    # rank of that node (the first the heartbeats find: rank 1 watches rank 3, rank 0 watches rank 2),
    # the same rank on both (the failure record), with its host and pid.
    results = two_torchrun_agents(2, ["--layouts", "pp2dp2", "--kill", "3"])
    everything = "".join(out for _, out, _ in results)
    m = re.search(rf"{FAULT_AT} ([0-9.]+)", everything)
    assert m, _dump(results)
    survivor = next(i for i, (_, out, _) in enumerate(results) if re.search(r"rank 0 agent node\d", out))
    code, out, ended = results[survivor]
    assert code not in (0, None), _dump(results)
    named = re.findall(r"\[rank([01])\]:.*PeerLostError: rank ([23]) \(pp_rank [01], tp_rank 0, rdp_rank 1; pid \d+ "
                       r"on host", out)
    assert sorted({survivor for survivor, _ in named}) == ["0", "1"], _dump(results)
    assert len({gone for _, gone in named}) == 1, named
    assert ended - float(m.group(1)) < 20, _dump(results)
    print(f"SIGKILL of rank 3: rank {named[0][1]} named; the other node's agent ended {ended - float(m.group(1)):.1f} s later")


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpiexec", path=BIN) is None, reason="mpiexec (mpich wheel) not installed")
def test_mpiexec_with_two_host_entries_pp2_dp2_matches_one_process() -> None:
    cmd = [os.path.join(BIN, "mpiexec"), "-launcher", "fork", "-hosts", "hosta:2,hostb:2", "-n", "4",
           sys.executable, os.path.abspath(__file__), "--layouts", "pp2dp2"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    ((code, out, _),) = _finish([proc], 240.0)
    assert code == 0, out[-4000:]
    _matched(out, ["pp2dp2"], [0, 1, 2, 3])
    # Hydra numbers the ranks per host entry: local ranks 0, 1 on hosta and on hostb.
    seen = sorted(re.findall(r"rank (\d) agent - local_rank (\d) local_size (\d)", out))
    assert seen == [("0", "0", "2"), ("1", "1", "2"), ("2", "0", "2"), ("3", "1", "2")], out


if __name__ == "__main__":
    _main()
