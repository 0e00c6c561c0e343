"""SMP v1's optimizer surface on ``smp.DistributedOptimizer``: state dicts in pieces, checkpoints that resume
fp16 training exactly (fp32 masters and loss scale included), ``clip_master_grads`` in float32, bad input."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.spawn import run_ranks
from tests.torch.zoo import MLP

SCALING = {"static_loss_scale": None, "dynamic_loss_scale": True,
           "dynamic_loss_args": {"init_scale": 2.0**18, "scale_window": 2}}


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 12, generator=g), torch.randn(8, 5, generator=g)


def _setup(fp16: bool, clip: float | None = None, scaling: dict[str, Any] | None = None) -> tuple[Any, Any, Any]:
    import smp.torch as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0,
              "fp16": fp16, "comm_timeout": 60.0})
    torch.manual_seed(0)
    net = MLP()
    model = smp.DistributedModel(net)
    net.place(2, smp.set_partition)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), **(scaling or SCALING if fp16 else {}))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    def run(steps: range) -> list[float]:
        losses = []
        for i in steps:
            opt.zero_grad()
            losses.append(float(train_step(model, *_data(i)).reduce_mean()))
            if clip is not None:
                opt.clip_master_grads(clip)
            opt.step()
        return losses

    return model, opt, run


def _first_run(path: str) -> dict[str, Any]:
    import smp.torch as smp

    model, opt, run = _setup(fp16=True, clip=1.0)
    run(range(4))
    smp.save_checkpoint(path, "after4", model=model, optimizer=opt)
    scale_at_save = opt.loss_scaler.loss_scale
    overflows_at_save = opt.overflow
    local = opt.local_state_dict()
    assert local["_smp_is_partial"] and "fp32_from_fp16" in local and "loss_scaler" in local
    assert sorted(opt.local_state_dict(gather_if_shard=False)) == sorted(local)
    only_opt = opt.local_optimizer_state_dict()
    assert only_opt["_smp_is_partial"] and "fp32_from_fp16" not in only_opt and only_opt["state"]
    local_names = {n for n, _ in model.local_named_parameters()}
    assert set(only_opt["state"]) == local_names, "this rank's parameters' state, by name"
    fp16 = opt.local_fp16_state_dict()
    assert set(fp16["fp32_from_fp16"]) == local_names
    assert all(t.dtype == torch.float32 for t in fp16["fp32_from_fp16"].values())
    assert opt.local_state_dict(fp32_states_only=True).keys() == fp16.keys()
    with pytest.raises(smp.exceptions.SMPCheckpointError, match="partial"):
        opt.load_local_optimizer_state_dict({"state": {}, "param_groups": []})
    with pytest.raises(ValueError, match="must be a bool or an int"):
        opt.local_state_dict(cast_to_cpu="yes")
    # SMP v1 scripts pass argparse ints (gather_if_shard=args.gather_if_shard): truth values, as in SMP v1
    assert sorted(opt.local_state_dict(gather_if_shard=0, cast_to_cpu=1)) == sorted(local)
    with pytest.raises(ValueError, match=r"bf16: True|fp16: True"):
        with smp.model_creation(dtype=torch.bfloat16):
            pass
    with pytest.raises(ValueError, match="DistributedOptimizer scales the loss itself"):
        smp.amp.GradScaler().unscale_(opt)
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
    full = opt.state_dict()  # every rank has dp_rank 0 here: gathered over the pipeline
    names = {n for n, _ in model.module.named_parameters()}
    assert set(full["fp32_from_fp16"]) == names and set(full["state"]) == names and "_smp_is_partial" not in full
    # SMP v1: optimizer.load_state_dict(state_dict, gather_if_shard); a round trip changes nothing.
    before = {k: v.clone() for k, v in fp16["fp32_from_fp16"].items()}
    opt.load_state_dict(local, False)
    opt.load_state_dict(full)
    assert all(torch.equal(before[k], v) for k, v in opt.local_fp16_state_dict()["fp32_from_fp16"].items())
    later = run(range(4, 8))
    return {"later": later, "scale": scale_at_save, "overflow": overflows_at_save,
            "final_scale": opt.loss_scaler.loss_scale, "files": sorted(os.listdir(os.path.join(path, "after4_partial")))}


def _resumed(path: str) -> dict[str, Any]:
    import smp.torch as smp

    out: dict[str, Any] = {}
    # 1. SMP v1's resume: resume_from_checkpoint after building the model and optimizer.
    model, opt, run = _setup(fp16=True, clip=1.0)
    smp.resume_from_checkpoint(path)
    out["resume"] = run(range(4, 8))
    out["resume_scale"] = opt.loss_scaler.loss_scale
    smp.reset()
    # 2. The model from resume_from_checkpoint, the optimizer from load_optimizer_checkpoint.
    model, opt, run = _setup(fp16=True, clip=1.0)
    smp.resume_from_checkpoint(path, load_optimizer=False)
    opt.load_optimizer_checkpoint(path, "after4")
    out["load_optimizer_checkpoint"] = run(range(4, 8))
    smp.reset()
    # 3. Without the optimizer: training goes on, from another optimizer state (a check that the
    # comparisons above can fail).
    model, opt, run = _setup(fp16=True, clip=1.0)
    smp.resume_from_checkpoint(path, load_optimizer=False)
    out["fresh_optimizer"] = run(range(4, 8))
    return out


@pytest.mark.slow
def test_fp16_checkpoint_resumes_exactly_with_masters_and_loss_scale(tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt")
    first = run_ranks(_first_run, 2, args=(path,), timeout=180)
    assert "optimizer_0_0.pt" in first[0]["files"] and "optimizer_1_0.pt" in first[0]["files"]
    resumed = run_ranks(_resumed, 2, args=(path,), timeout=240)
    for a, b in zip(first, resumed):
        assert b["resume"] == a["later"], "resume_from_checkpoint continues exactly"
        assert b["resume_scale"] == a["final_scale"]
        assert b["load_optimizer_checkpoint"] == a["later"], "load_optimizer_checkpoint continues exactly"
        assert b["fresh_optimizer"] != a["later"]


def _fp32(max_norm: float) -> dict[str, Any]:
    model, opt, _ = _setup(fp16=False)
    import smp.torch as smp

    assert opt.optimizer is opt and opt.master_weights is None and not opt.overflow
    assert opt.loss_scaler.loss_scale == 1.0
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5)  # SMP v1 idiom

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    norms, grads = [], []
    for i in range(2):
        opt.zero_grad()
        train_step(model, *_data(i))
        norms.append(opt.clip_master_grads(max_norm))
        grads.append({n: p.grad.clone() for n, p in model.local_named_parameters()})
        opt.step()
        sched.step()
    return {"norms": norms, "grads": grads, "lr": opt.param_groups[0]["lr"]}


def _fp32_reference(max_norm: float) -> dict[str, Any]:
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    norms, grads = [], []
    for i in range(2):
        opt.zero_grad()
        x, y = _data(i)
        for xm, ym in zip(x.chunk(2), y.chunk(2)):
            (F.mse_loss(net(xm), ym) / 2).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)))
        grads.append({n: p.grad.clone() for n, p in net.named_parameters()})
        opt.step()
        sched.step()
    return {"norms": norms, "grads": grads}


def test_clip_master_grads_in_float32_uses_the_norm_over_both_pipeline_ranks() -> None:
    ranks = run_ranks(_fp32, 2, args=(0.05,), timeout=120)
    ref = _fp32_reference(0.05)
    assert ref["norms"][0] > 0.05, "the clip is active"
    for r in ranks:
        torch.testing.assert_close(r["norms"], ref["norms"], rtol=1e-6, atol=0)
        assert r["lr"] == 1e-2 * 0.25
        for got, want in zip(r["grads"], ref["grads"]):
            assert got, "this rank holds parameters"
            for name, g in got.items():
                torch.testing.assert_close(g, want[name])
    assert set(ranks[0]["grads"][0]).isdisjoint(ranks[1]["grads"][0])


def _accumulated() -> dict[str, Any]:
    """Two @smp.step calls accumulate before one step; a clip_master_grads between them (to log the norm)
    must not leave stale master grads behind."""
    import smp.torch as smp

    out = {}
    for early_clip in (False, True):
        model, opt, _ = _setup(fp16=True, scaling={"static_loss_scale": 256.0})

        @smp.step
        def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.mse_loss(model(x), y)
            model.backward(loss)
            return loss

        opt.zero_grad()
        train_step(model, *_data(0))
        first = opt.clip_master_grads(1e-3) if early_clip else None
        train_step(model, *_data(1))
        norm = opt.clip_master_grads(1e-3)
        opt.step()
        out[early_clip] = {"first": first, "norm": norm, "overflow": opt.overflow,
                           "masters": {n: t.clone() for n, t in opt.local_fp16_state_dict()["fp32_from_fp16"].items()}}
        smp.reset()
    return out


def test_master_grads_follow_gradients_accumulated_after_a_clip() -> None:
    for r in run_ranks(_accumulated, 2, timeout=120):
        plain, clipped_early = r[False], r[True]
        assert not plain["overflow"] and plain["norm"] > 1e-3, "the clip is active"
        assert clipped_early["first"] != plain["norm"], "the first clip saw one step's gradients"
        assert clipped_early["norm"] == plain["norm"]
        for name, value in plain["masters"].items():
            assert torch.equal(clipped_early["masters"][name], value), name


def _zero_grad_defaults() -> dict[str, Any]:
    import smp.torch as smp
    from smp.torch.optimizers import FusedAdam

    smp.init({"fp16": True})
    model = smp.DistributedModel(torch.nn.Linear(4, 4))
    out = {}
    for name, opt in (("fused_keep", FusedAdam(model.parameters(), set_grad_none=False)),
                      ("torch", torch.optim.SGD(model.parameters(), lr=0.1))):
        opt = smp.DistributedOptimizer(opt)

        @smp.step
        def step(model: Any, x: torch.Tensor) -> torch.Tensor:
            loss = model(x).float().pow(2).mean()
            model.backward(loss)
            return loss

        step(model, torch.ones(2, 4))
        opt.step()
        opt.zero_grad()
        out[name] = [None if p.grad is None else float(p.grad.abs().sum()) for p in model.parameters()]
    return out


def test_zero_grad_keeps_the_optimizers_own_default_under_fp16() -> None:
    """apex's ``set_grad_none=False`` (FusedAdam) zeroes the gradients; a torch optimizer sets them to None."""
    (out,) = run_ranks(_zero_grad_defaults, 1, timeout=60)
    assert out["fused_keep"] == [0.0, 0.0]
    assert out["torch"] == [None, None]
