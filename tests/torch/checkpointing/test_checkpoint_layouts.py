"""Checkpoints resume across layouts and replicas like one process trained without a break.

A Llama trained 2 steps at tp=2 x pp=2 writes a full checkpoint (``save_checkpoint(partial=False)``)
and a full state dict (``smp.save(model.state_dict(), f, partial=False)``); each is loaded at
tp=1 x pp=2 and at tp=2 x pp=1 (``resume_from_checkpoint(partial=False)`` / ``smp.load``) into a
model built from other weights, which trains 2 more steps. With tp=2 x rdp=2 a partial checkpoint
(one writer per (pp, tp), the v3 ``smp.save`` names per rdp) resumes model and optimizer at the same
layout. Losses per step and every rank's gathered parameters are compared with one process trained
4 steps on the same batches.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import pytest
import torch

from tests.helpers.spawn import run_ranks

transformers = pytest.importorskip("transformers")

from tests.torch.tp.test_tp_hf import _model  # noqa: E402 - needs transformers

SEQS = 8
BEFORE, AFTER = 2, 2  # steps before the checkpoint, steps after resuming
LR = 0.05


def _data() -> torch.Tensor:
    return torch.randint(0, 64, (SEQS, 10), generator=torch.Generator().manual_seed(11))


class Reference(NamedTuple):
    losses: list[list[float]]  # per step, the loss on each of _data().chunk(shards)
    saved: dict[str, torch.Tensor]  # parameters after BEFORE steps
    final: dict[str, torch.Tensor]  # parameters after BEFORE + AFTER steps


def _reference(momentum: float, shards: int) -> Reference:
    """One process, the global batch in one piece, BEFORE + AFTER steps without a break."""
    ref = _model("llama")
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=momentum)
    ids = _data()
    losses, saved = [], {}
    for step in range(BEFORE + AFTER):
        if step == BEFORE:
            saved = {k: v.detach().clone() for k, v in ref.named_parameters()}
        with torch.no_grad():
            losses.append([ref(input_ids=part, labels=part).loss.item() for part in ids.chunk(shards)])
        opt.zero_grad()
        ref(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    return Reference(losses, saved, {k: v.detach().clone() for k, v in ref.named_parameters()})


def _setup(tp: int, pp: int, seed: int, momentum: float) -> tuple[Any, Any, Any]:
    """smp.init, the model (weights from ``seed``), its manual partition, optimizer and step function."""
    import smp.torch as smp

    from tests.torch import zoo

    smp.init({"tensor_parallel_degree": tp, "pipeline_parallel_degree": pp, "ddp": True, "prescaled_batch": True,
              "microbatches": 2, "default_partition": 0, "comm_timeout": 60.0})
    hf = _model("llama", seed=seed)
    if tp > 1:
        smp.transform(hf)
    model = smp.DistributedModel(hf)
    if pp > 1:
        smp.set_partition(hf.base_model.layers[1], 1)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum))
    return model, opt, zoo.hf_train_step()


def _steps(model: Any, opt: Any, train_step: Any, count: int) -> list[float]:
    import smp.torch as smp

    ids = _data().chunk(smp.rdp_size())[smp.rdp_rank()]  # prescaled: TP peers share their replica's rows
    losses = []
    for _ in range(count):
        opt.zero_grad()
        losses.append(train_step(model, ids, ids.clone()).reduce_mean().item())
        opt.step()
    return losses


def _parameters(model: Any) -> dict[str, torch.Tensor]:
    """This replica's full parameters (gathered over PP and TP), on every rank."""
    names = set(dict(model.module.named_parameters()))
    return {k: v for k, v in model.state_dict(gather_to_rank0=False).items() if k in names}


def _save_full(path: str) -> list[float]:
    import smp.torch as smp

    model, opt, train_step = _setup(2, 2, 0, 0.0)
    losses = _steps(model, opt, train_step, BEFORE)
    smp.save_checkpoint(path, tag="step2", partial=False, model=model, user_content={"step": BEFORE})
    # SMP v1's full save: the gathered state dict ({} on ranks other than 0), written by rank 0.
    smp.save(model.state_dict(), os.path.join(path, "model.pt"), partial=False)
    smp.barrier()
    return losses


def _resume_full(path: str, tp: int, pp: int, source: str) -> dict[str, Any]:
    import smp.torch as smp

    model, opt, train_step = _setup(tp, pp, 1, 0.0)  # other weights: only the load can make them right
    content = None
    if source == "resume_from_checkpoint":
        content = smp.resume_from_checkpoint(path, tag="step2", partial=False)
    else:
        model.load_state_dict(smp.load(os.path.join(path, "model.pt"), partial=False))
    losses = _steps(model, opt, train_step, AFTER)
    return {"losses": losses, "content": content, "state": _parameters(model)}


@pytest.fixture(scope="module")
def full_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Reference]:
    ref = _reference(0.0, 1)
    path = str(tmp_path_factory.mktemp("full"))
    for losses in run_ranks(_save_full, 4, args=(path,), timeout=300):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor([s[0] for s in ref.losses[:BEFORE]]),
                                   rtol=1e-4, atol=1e-5)
    return path, ref


def _check_state(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert set(state) == set(expected), (what, sorted(set(state) ^ set(expected))[:6])
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{what}: {n}\n{m}")


def test_full_save_holds_the_unsharded_trained_model(full_checkpoint: tuple[str, Reference]) -> None:
    """``smp.save(partial=False)`` wrote every parameter, full size, as trained (loadable without smp)."""
    path, ref = full_checkpoint
    saved = torch.load(os.path.join(path, "model.pt"), weights_only=False)
    _check_state({k: v for k, v in saved.items() if k in ref.saved}, ref.saved, "model.pt")


LAYOUTS = [(tp, pp, source) for tp, pp in ((1, 2), (2, 1)) for source in ("resume_from_checkpoint", "smp.load")]


@pytest.mark.parametrize("tp,pp,source", LAYOUTS, ids=[f"tp{t}-pp{p}-{s}" for t, p, s in LAYOUTS])
def test_full_checkpoint_from_tp2_pp2_resumes_in_another_layout(full_checkpoint: tuple[str, Reference], tp: int,
                                                                pp: int, source: str) -> None:
    path, ref = full_checkpoint
    for rank, res in enumerate(run_ranks(_resume_full, tp * pp, args=(path, tp, pp, source), timeout=300)):
        what = f"tp{tp} x pp{pp} rank {rank} ({source})"
        if source == "resume_from_checkpoint":
            assert res["content"] == {"step": BEFORE}, what
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor([s[0] for s in ref.losses[BEFORE:]]),
                                   rtol=1e-4, atol=1e-5, msg=lambda m, w=what: f"{w}: losses\n{m}")
        _check_state(res["state"], ref.final, what)


def _partial_rdp(path: str, phase: str) -> dict[str, Any]:
    import smp.torch as smp

    # Momentum: the optimizer state must resume too (a partial checkpoint carries it).
    model, opt, train_step = _setup(2, 1, 0 if phase == "save" else 1, 0.9)
    v3 = os.path.join(path, "v3", "model")
    if phase == "save":
        losses = _steps(model, opt, train_step, BEFORE)
        smp.save_checkpoint(path, tag="step2", partial=True, model=model, optimizer=opt)
        os.makedirs(os.path.dirname(v3), exist_ok=True)  # as torch.save, smp.save creates no folders
        smp.save(model.local_state_dict(), v3, partial=True, v3=True)  # every rank: f"{v3}_{pp}_{tp}_{rdp}.pt"
        return {"losses": losses, "rdp_rank": smp.rdp_rank()}
    smp.resume_from_checkpoint(path, tag="step2")
    losses = _steps(model, opt, train_step, AFTER)
    mine = smp.load(v3)  # this rank's v3 file: the parameters it saved before training on
    return {"losses": losses, "state": _parameters(model), "v3_keys": sorted(k for k in mine if k != "_smp_is_partial"),
            "local_keys": sorted(n for n, _ in model.local_named_parameters()), "rdp_rank": smp.rdp_rank()}


@pytest.mark.slow  # two 4-rank launches
def test_partial_checkpoint_with_two_replicas_resumes_model_and_optimizer(tmp_path: Any) -> None:
    """tp=2 x rdp=2: rdp_rank 0 writes each (pp, tp) part; every replica resumes from it, with the
    optimizer's momentum, and trains on like one uninterrupted process."""
    ref = _reference(0.9, 2)
    for rank, res in enumerate(run_ranks(_partial_rdp, 4, args=(str(tmp_path), "save"), timeout=300)):
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor([s[res["rdp_rank"]] for s in ref.losses[:BEFORE]]),
                                   rtol=1e-4, atol=1e-5, msg=lambda m, r=rank: f"rank {r} before saving: losses\n{m}")
    names = sorted(os.listdir(tmp_path / "v3"))
    assert names == [f"model_0_{tp}_{rdp}.pt" for tp in range(2) for rdp in range(2)], names
    for rank, res in enumerate(run_ranks(_partial_rdp, 4, args=(str(tmp_path), "resume"), timeout=300)):
        what = f"tp2 x rdp2 rank {rank}"
        expected = [s[res["rdp_rank"]] for s in ref.losses[BEFORE:]]
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(expected), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, w=what: f"{w}: losses\n{m}")
        _check_state(res["state"], ref.final, what)
        assert set(res["v3_keys"]) >= set(res["local_keys"]), what
