"""Model parallelism divides memory: after partitioning and a step, each rank holds in parameters,
gradients and optimizer state exactly its owned share, counted from torch's own tensors (storage
bytes, so a freed parameter counts 0 and a TP shard its slice), at pp 2 and 3, with DP and with TP;
the parts of all ranks add up to the whole model."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.torch.launch_cases import naming, run_cases

WIDTH, DEPTH = 64, 6


def _storage_bytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and not t.is_meta:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _held(model: Any, opt: Any) -> dict[str, Any]:
    params = list(model.module.parameters())
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    local = list(model.local_parameters())
    return {
        "params": _storage_bytes(params),
        "grads": _storage_bytes(p.grad for p in params),
        "optimizer": _storage_bytes(state),
        "owned": sum(p.numel() * p.element_size() for p in local),
        "owned_names": sorted(n for n, p in model.local_named_parameters()),
        "check": model.memory_check(),
    }


def _mlp(layout: dict[str, Any], auto: bool) -> dict[str, Any]:
    import smp.torch as smp

    smp.init({"microbatches": 2, "ddp": True, "comm_timeout": 60.0, "auto_partition": auto,
              "default_partition": 0, **layout})
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    model = smp.DistributedModel(net)
    pp = layout.get("pipeline_parallel_degree", 1)
    if not auto:
        for i, layer in enumerate(net):
            smp.set_partition(layer, i * pp // DEPTH)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))

    @smp.step
    def train_step(model: Any, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        model.backward(loss)
        return loss

    opt.zero_grad()
    train_step(model, torch.randn(8, WIDTH))
    opt.step()
    return {**_held(model, opt), "pp_rank": smp.pp_rank(), "tp_rank": smp.tp_rank()}


def _llama_tp(layout: dict[str, Any]) -> dict[str, Any]:
    import smp.torch as smp

    from tests.torch.tp.test_tp_hf import _model

    smp.init({"microbatches": 2, "ddp": True, "comm_timeout": 60.0, **layout})
    with smp.tensor_parallelism():
        hf = _model("llama", num_hidden_layers=4)
    model = smp.DistributedModel(hf)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    opt.zero_grad()
    train_step(model, torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)))
    opt.step()
    return {**_held(model, opt), "pp_rank": smp.pp_rank(), "tp_rank": smp.tp_rank()}


def _check(ranks: list[dict[str, Any]], whole: int, tp: int = 1) -> None:
    for r, got in enumerate(ranks):
        assert got["params"] == got["owned"] > 0, f"rank {r}: holds {got['params']} B of parameters, owns {got['owned']}"
        held, estimate = got["check"]["held"], got["check"]["estimate"]
        # The partition report's estimate (fp32 Adam: weights + gradients + 2 moments) is what the rank holds.
        assert held == {k: estimate[k] for k in held}, f"rank {r}: held {held}, estimated {estimate}"
        assert got["grads"] == got["owned"], f"rank {r}: {got['grads']} B of gradients for {got['owned']} B owned"
        assert got["optimizer"] == 2 * got["owned"], f"rank {r}: Adam state {got['optimizer']} B, 2 x {got['owned']}"
    # The pipeline ranks of one replica (and one TP rank) own disjoint parts that make up the model.
    by_stage = {(g["pp_rank"], g["tp_rank"]): g for g in ranks}
    pps = sorted({p for p, _ in by_stage})
    for t in range(tp):
        names = [n for p in pps for n in by_stage[p, t]["owned_names"]]
        assert len(names) == len(set(names)), "no parameter on two pipeline ranks"
    assert sum(by_stage[p, t]["owned"] for p in pps for t in range(tp)) >= whole / tp


CASES = [
    ("pp2 x dp2 manual", _mlp, {"layout": {"pipeline_parallel_degree": 2}, "auto": False}),
    ("pp2 x dp2 auto", _mlp, {"layout": {"pipeline_parallel_degree": 2}, "auto": True}),
    ("tp2 x pp2 HF Llama", _llama_tp, {"layout": {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2}}),
]


def test_each_rank_holds_its_share_of_params_grads_and_optimizer_state() -> None:
    got = run_cases(4, CASES, timeout=300)
    whole = DEPTH * (WIDTH * WIDTH + WIDTH) * 4
    for name in ("pp2 x dp2 manual", "pp2 x dp2 auto"):
        with naming(name):
            _check(got[name], whole)
            assert all(g["owned"] < whole for g in got[name]), "every rank holds part of the model only"
    with naming("tp2 x pp2 HF Llama"):
        _check(got["tp2 x pp2 HF Llama"], 0, tp=2)


@pytest.mark.parametrize("auto", [False, True])
def test_three_pipeline_ranks_hold_a_third_each(auto: bool) -> None:
    got = run_cases(3, [("pp3", _mlp, {"layout": {"pipeline_parallel_degree": 3}, "auto": auto})], timeout=200)
    whole = DEPTH * (WIDTH * WIDTH + WIDTH) * 4
    _check(got["pp3"], whole)
    assert sum(g["owned"] for g in got["pp3"]) == whole


def _rss() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rss_after_partition() -> dict[str, int]:
    """Resident memory before the first step (the whole model built here) and in the post-partition
    hook (the other rank's half freed): the freed half must leave the process, smp's heap settings
    notwithstanding (they keep freed memory mapped for speed)."""
    import smp.torch as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0,
              "comm_timeout": 60.0})
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)])  # 16 MiB each
    model = smp.DistributedModel(net)
    for i, layer in enumerate(net):
        smp.set_partition(layer, i // 4)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    seen: dict[str, int] = {}
    model.register_post_partition_hook(lambda m, o: seen.update(partitioned=_rss()))

    @smp.step
    def train_step(model: Any, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        model.backward(loss)
        return loss

    seen["built"] = _rss()
    train_step(model, torch.randn(4, 2048))
    opt.step()
    return seen


def test_the_other_ranks_parameters_leave_the_process_after_partitioning() -> None:
    for rank, got in enumerate(run_cases(2, [("rss", _rss_after_partition, {})], timeout=120)["rss"]):
        dropped = got["built"] - got["partitioned"]
        assert dropped > 0.75 * (64 << 20), f"rank {rank}: resident memory fell by {dropped / 2**20:.0f} MiB " \
                                            f"when the other rank's 64 MiB of parameters were freed"


def _over_budget(auto: bool, budget: str) -> str:
    import smp.torch as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": auto, "default_partition": 0,
              "memory_per_rank": budget, "comm_timeout": 60.0})
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    model = smp.DistributedModel(net)
    if not auto:
        smp.set_partition(net[-1], 1)  # rank 0 keeps five of six layers
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    ran = []

    @smp.step
    def train_step(model: Any, x: torch.Tensor) -> torch.Tensor:
        ran.append(1)
        loss = model(x).pow(2).mean()
        model.backward(loss)
        return loss

    try:
        train_step(model, torch.randn(8, WIDTH))
        opt.step()
    except smp.exceptions.PartitionMemoryError as e:
        return f"raised after {len(ran)} traced microbatches: {e}"
    return f"fits: {model.partition_report.ranks}"


def test_a_rank_over_memory_per_rank_is_a_clear_error_on_every_rank() -> None:
    layer = (WIDTH * WIDTH + WIDTH) * 4 * 4  # fp32 weights, gradients and Adam's two moments
    budget = f"{int(3.5 * layer)}"
    got = run_cases(2, [("manual", _over_budget, {"auto": False, "budget": budget}),
                        ("auto", _over_budget, {"auto": True, "budget": budget}),
                        ("auto, too small", _over_budget, {"auto": True, "budget": str(layer)})], timeout=200)
    for message in got["manual"]:  # the hand placement puts 5 layers on rank 0: every rank says so, no work ran
        assert message.startswith("raised after 0 traced microbatches"), message
        assert "rank 0:" in message and "rank 1:" not in message.split("Fix")[0], message
        assert all(fix in message for fix in ("pipeline_parallel_degree", "optimize: 'memory'",
                                               "delayed_parameter_initialization", "set_activation_checkpointing"))
    assert all(m.startswith("fits") for m in got["auto"]), got["auto"]  # the automatic split keeps 3 + 3
    for message in got["auto, too small"]:  # no split fits one layer per rank
        assert "raised" in message and "memory_per_rank" in message, message
