"""Tensor parallelism inside smp.DistributedModel trains like one process on the global batch.

TP-sharded gradients average over RDP, the rest over DP. With ``prescaled_batch: True`` every TP
rank gets the same batch (shard by rdp_rank); with the SMP v1 default ``False`` each rank gets its
own (shard by dp_rank) and the model runs on the TP group's combined batch (reference 2.5). Covered:
tp=2 alone, tp=2 x pp=2 (manual and automatic partition; every model family), tp=2 x rdp=2, every
placement strategy,
a loss computed in the step from the model's logits, and (slow) tp=2 x pp=2 x rdp=2 on 8 ranks in
both batch modes. Every rank's own loss is compared with the one-process loss on the rows it covers
(errors on single ranks cannot cancel in a mean), and every rank's gathered parameters with the
one-process model's after training (every replica, not only the first). The cases of one world
size run in one launch, ``smp.reset()`` between; a failure names its case.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F

from tests.torch.launch_cases import Case, naming, run_cases
from tests.torch.tp.test_tp_hf import _model

STEPS = 3
SEQS = 8
PLACEMENTS = ["cluster", "spread", "DTP", "PDT", "PTD", "TDP"]  # cluster = DPT, spread = TPD


def _data() -> torch.Tensor:
    return torch.randint(0, 64, (SEQS, 10), generator=torch.Generator().manual_seed(7))


class Reference(NamedTuple):
    """One process, the global batch of SEQS sequences in one piece."""

    losses: list[float]  # the global batch's loss per step
    shards: dict[int, list[list[float]]]  # n -> per step, the loss on each of _data().chunk(n)
    state: dict[str, torch.Tensor]  # the parameters after the last step


def _reference(kind: str = "llama") -> Reference:
    ref = _model(kind)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    ids = _data()
    losses: list[float] = []
    shards: dict[int, list[list[float]]] = {n: [] for n in (2, 4)}
    for _ in range(STEPS):
        with torch.no_grad():
            for n, per_step in shards.items():
                per_step.append([ref(input_ids=part, labels=part).loss.item() for part in ids.chunk(n)])
        opt.zero_grad()
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return Reference(losses, shards, {k: v.detach().clone() for k, v in ref.named_parameters()})


def _train(pp: int, rdp: int, prescaled: bool, placement: str = "cluster", auto: bool = False,
           loss_outside: bool = False, microbatches: int = 2, kind: str = "llama") -> dict[str, Any]:
    """This rank's losses, which shards of the global batch they cover, and its gathered parameters."""
    import smp.torch as smp

    smp.init({"tensor_parallel_degree": 2, "pipeline_parallel_degree": pp, "ddp": True,
              "prescaled_batch": prescaled, "microbatches": microbatches, "placement_strategy": placement,
              "auto_partition": auto, "default_partition": 0, "comm_timeout": 60.0})
    hf = smp.transform(_model(kind))
    model = smp.DistributedModel(hf)
    if pp > 1 and not auto:
        layers = hf.base_model.layers
        for layer in layers[len(layers) // 2:]:
            smp.set_partition(layer, 1)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
        if loss_outside:  # the step computes the loss from the rank's own samples' logits
            logits = model(input_ids=ids).logits
            assert logits.shape[:2] == ids.shape and logits.shape[-1] == 64
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, 64).float(), ids[:, 1:].reshape(-1))
        else:
            loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    # The SMP v1 sharding rule: per-rank batches by dp_rank, prescaled ones by rdp_rank.
    rank, size = (smp.rdp_rank(), smp.rdp_size()) if prescaled else (smp.dp_rank(), smp.dp_size())
    ids = _data().chunk(size)[rank]
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        losses.append(train_step(model, ids).reduce_mean().item())
        opt.step()
    # Which shards of _data().chunk(size) this rank's loss covers: its own, or with per-rank batches
    # and the loss computed by the model (on the TP group's combined batch), its TP group's.
    covers = [rank] if prescaled or loss_outside else sorted(smp.allgather(rank, smp.TP_GROUP))
    params = set(dict(model.module.named_parameters()))
    state = {k: v for k, v in model.state_dict(gather_to_rank0=False).items() if k in params}
    recorded = next(iter(model.plans.values()), None)
    plan = None if recorded is None else (list(recorded.chain), recorded.static)
    return {"losses": losses, "shards": size, "covers": covers, "state": state, "plan": plan}


def _check(results: list[dict[str, Any]], ref: Reference) -> None:
    """Each rank's loss equals the one-process loss on the rows it covers; each rank's gathered
    parameters equal the one-process model's."""
    for rank, res in enumerate(results):
        per_step = ref.losses if res["shards"] == 1 else [
            sum(step[k] for k in res["covers"]) / len(res["covers"]) for step in ref.shards[res["shards"]]]
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(per_step), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, r=rank, c=res["covers"]: f"rank {r} (shards {c}): losses\n{m}")
        assert set(res["state"]) == set(ref.state), (rank, sorted(set(ref.state) ^ set(res["state"]))[:6])
        for name, value in ref.state.items():
            torch.testing.assert_close(res["state"][name], value, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, r=rank, n=name: f"rank {r}: {n}\n{m}")


@pytest.fixture(scope="module")
def reference() -> Reference:
    return _reference()


def _tp2(pp: int, rdp: int, prescaled: bool, placement: str = "cluster", **kwargs: Any) -> dict[str, Any]:
    return {"pp": pp, "rdp": rdp, "prescaled": prescaled, "placement": placement, **kwargs}


def _unequal() -> str:
    import smp.torch as smp

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "comm_timeout": 60.0})
    model = smp.DistributedModel(smp.transform(_model("llama")))

    @smp.step
    def fwd(model: Any, ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids).logits

    try:
        fwd(model, _data()[: 2 + 2 * smp.tp_rank()])
    except Exception as e:  # noqa: BLE001
        return str(e)
    return "no error"


TWO_RANKS: list[Case] = [
    ("tp2-prescaled", _train, _tp2(1, 1, True)),
    ("tp2-per-rank-batches", _train, _tp2(1, 1, False)),
    # Each TP rank gets its own samples' full-vocabulary logits back (they are vocabulary-sharded
    # inside the model) and computes its loss in the step, as an SMP v1 script does.
    ("tp2-loss-from-logits", _train, _tp2(1, 1, False, loss_outside=True)),
    ("tp2-unequal-batches", _unequal, {}),
]


def test_tp2_on_two_ranks_matches_one_process(reference: Reference) -> None:
    """tp=2 alone in both batch modes and with the loss computed in the step; per-rank batches of
    different sizes are refused clearly (one launch, reset between)."""
    got = run_cases(2, TWO_RANKS, timeout=600)
    for name in ("tp2-prescaled", "tp2-per-rank-batches", "tp2-loss-from-logits"):
        with naming(name):
            _check(got[name], reference)
    logits = got["tp2-loss-from-logits"]
    assert logits[0]["losses"] != logits[1]["losses"], "each rank's loss is over its own samples"
    for msg in got["tp2-unequal-batches"]:
        assert "different batches" in msg and "tp_rank 0: batch 2" in msg and "tp_rank 1: batch 4" in msg, msg


FAMILIES = ["mistral", "gpt_neox", "mixtral"]  # Llama runs in every other case
# tp=2 x pp=2 with per-rank batches under "cluster" is the first placement case.
FOUR_RANKS: list[Case] = [
    ("tp2-pp2-prescaled", _train, _tp2(2, 1, True)),
    ("tp2-rdp2-prescaled", _train, _tp2(1, 2, True)),
    ("tp2-rdp2-per-rank-batches", _train, _tp2(1, 2, False)),
    ("tp2-pp2-auto-partition", _train, _tp2(2, 1, False, auto=True)),
    ("tp2-pp2-auto-loss-from-logits", _train, _tp2(2, 1, False, auto=True, loss_outside=True)),
    *[(f"tp2-pp2-{kind}", _train, _tp2(2, 1, False, kind=kind)) for kind in FAMILIES],
    *[(f"tp2-pp2-placement-{placement}", _train, _tp2(2, 1, False, placement)) for placement in PLACEMENTS],
]


def test_tp2_on_four_ranks_matches_one_process(reference: Reference) -> None:
    """tp=2 x pp=2 (prescaled, automatic partition, every model family, every placement with
    per-rank batches) and tp=2 x rdp=2 in both batch modes (one launch, reset between)."""
    got = run_cases(4, FOUR_RANKS, timeout=1500)
    for name, _, kwargs in FOUR_RANKS:
        kind = kwargs.get("kind", "llama")
        with naming(name):
            _check(got[name], reference if kind == "llama" else _reference(kind))
            if kwargs["pp"] > 1:  # the static plan (the manual cut leaves the head on rank 0: 0 -> 1 -> 0)
                chain = [0, 1] if kwargs.get("auto") else [0, 1, 0]
                assert all(r["plan"] == (chain, True) for r in got[name]), [r["plan"] for r in got[name]]
    # With per-rank batches the head's outputs are cut to each rank's samples on the rank that
    # keeps them: fetched to rank 0 to be cut there, they made the chain 0 -> 1 -> 0, off the plan.


EIGHT_RANKS: list[Case] = [
    *[(f"placement {placement!r}, per-rank batches", _train, _tp2(2, 2, False, placement)) for placement in PLACEMENTS],
    *[(f"placement {placement!r}, prescaled", _train, _tp2(2, 2, True, placement)) for placement in ("cluster", "spread")],
]


@pytest.mark.slow
def test_every_placement_strategy_tp_pp_dp_on_8_ranks(reference: Reference) -> None:
    """tp=2 x pp=2 x rdp=2 with 2 microbatches: per-rank batches of 2 sequences under every
    placement, and prescaled batches (4 sequences per replica, pp > 1 and rdp > 1 together)."""
    got = run_cases(8, EIGHT_RANKS, timeout=900)
    for name, _, _ in EIGHT_RANKS:
        with naming(name):
            _check(got[name], reference)
