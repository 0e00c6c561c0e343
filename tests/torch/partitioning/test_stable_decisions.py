"""The same model and configuration give the same partition and plan in every launch (issue 39).

Three launches of 2 ranks each train an HF Llama and the ``ModuleList`` GPT of
``examples/gpt_model.py`` with automatic partitioning and smp's default pipeline, the records of
traced costs and step durations on (a directory of the test's own: partitioning/record.py), and
compare what each launch decided: the partition, the microbatch chain and every rank's plan. The
first launch traces and records; the others read the records, so they skip the trace. Identical
layers also share one traced time (twins.py), checked here in one process.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.helpers.spawn import run_ranks

transformers = pytest.importorskip("transformers")


def _llama() -> Any:
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=88, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _gpt() -> Any:
    from examples.gpt_model import GPT

    torch.manual_seed(0)
    return GPT(vocab=128, width=32, heads=4, layers=6, seq=16)


def _decisions(kind: str) -> dict[str, Any]:
    import smp.torch as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4})
    model = smp.DistributedModel(_llama() if kind == "llama" else _gpt())
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
        if kind == "llama":
            loss = model(input_ids=ids, labels=ids).loss
        else:
            logits = model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(0)
    for _ in range(3):  # the recording step, the re-measured step, one more on the final plan
        opt.zero_grad()
        train_step(model, torch.randint(0, 128, (8, 17), generator=g))
        opt.step()
    recorded = next(iter(model.plans.values()))
    plan = recorded.plan if isinstance(recorded.plan, tuple) else None
    out = {"assignment": dict(model.partition_assignment), "chain": list(recorded.chain),
           "plan": repr(plan[0]) if plan is not None else repr(recorded.plan)}
    smp.reset()
    return out


def _launch() -> dict[str, Any]:
    import smp.torch.partitioning.decide as decide

    real, traced = decide.trace, []
    decide.trace = lambda *a, **k: (traced.append(1), real(*a, **k))[1]  # count the traces rank 0 runs
    try:
        out: dict[str, Any] = {kind: _decisions(kind) for kind in ("llama", "gpt")}
    finally:
        decide.trace = real
    out["traced"] = len(traced)
    return out


@pytest.mark.slow
def test_three_launches_decide_the_same_partition_and_plan(tmp_path: Any) -> None:
    env = {"SMP_PARTITION_CACHE": str(tmp_path)}
    launches = [run_ranks(_launch, 2, env=env, timeout=300) for _ in range(3)]
    assert [launch[0]["traced"] for launch in launches] == [2, 0, 0]  # rank 0 traced both models once
    records = sorted(os.listdir(tmp_path))
    assert len([r for r in records if r.endswith("-plan.json")]) == 2 and len(records) == 4, records
    for kind in ("llama", "gpt"):
        first = launches[0]
        assert len(set(first[0][kind]["chain"])) == 2, "the model was not split over both ranks"
        for later in launches[1:]:
            for rank in (0, 1):
                assert later[rank][kind]["assignment"] == first[rank][kind]["assignment"], kind
                assert later[rank][kind]["chain"] == first[rank][kind]["chain"], kind
                assert later[rank][kind]["plan"] == first[rank][kind]["plan"], (kind, rank)


def test_identical_layers_share_one_traced_time() -> None:
    from smp.torch.partitioning.trace import trace

    model = _llama()
    ids = torch.randint(0, 128, (2, 16))
    pending: list[Any] = []

    def run() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        if torch.is_grad_enabled():
            pending.append(([loss], None))

    def backward() -> list[Any]:
        taken = list(pending)
        pending.clear()
        return taken

    tr = trace(model, run, backward=backward)
    layers = [f"model.layers.{i}" for i in range(6)]
    for suffix in ("", ".self_attn", ".mlp", ".mlp.down_proj"):
        assert len({tr.time[p + suffix] for p in layers}) == 1, suffix
        assert len({tr.backward_time[p + suffix] for p in layers}) == 1, suffix
    assert tr.time["lm_head"] > 0 and tr.time["model.embed_tokens"] > 0  # the others keep their own times
