"""``shard_optimizer_state: True`` (ZeRO-1): the same training as unsharded, with ~1/rdp of the state per rank.

Each launch trains the same model twice, unsharded and sharded (``smp.reset()`` between), and
compares: losses and every parameter bit-identical on every rank (the unsharded run is the one the
rest of the suite checks against one process), and the optimizer state each rank holds: every
parameter's state lives on exactly one rank of its RDP group (the shards add up to the unsharded
state) and no rank holds more than 1/rdp of it plus one parameter's share (whole parameters are
assigned, largest first). Checkpoints: SMP v1's v3 layout (one optimizer file per rdp rank), resumed
sharded, unsharded and through ``smp.save(..., v3=True)`` / ``smp.load`` with the same losses.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.spawn import run_ranks
from tests.torch.zoo import TinyGPT

STEPS = 4
VOCAB, SEQ = 32, 8


def _ids(step: int, replica: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1000 * step + replica))


def _optimizer(kind: str, model: Any) -> torch.optim.Optimizer:
    from smp.torch.optimizers import FusedLAMB

    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    rest = [p for n, p in model.named_parameters() if n.endswith("bias")]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=1e-2)
    if kind == "lamb":
        return FusedLAMB(groups, lr=1e-2)
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9)


def _setup(cfg: dict[str, Any], kind: str, opt_kind: str) -> tuple[Any, Any, Any]:
    import smp.torch as smp

    smp.init({"microbatches": 2, "ddp": True, "auto_partition": False, "default_partition": 0,
              "comm_timeout": 60.0, **{k: v for k, v in cfg.items() if not k.startswith("_")}})
    torch.manual_seed(0)
    if kind == "llama":
        from tests.torch.tp.test_tp_hf import _model

        net = smp.transform(_model("llama"))
    else:
        net = TinyGPT(vocab=VOCAB, layers=4, seq=SEQ)
    model = smp.DistributedModel(net)
    if kind != "llama" and smp.pp_size() > 1:
        net.place(smp.pp_size(), smp.set_partition)
    opt = smp.DistributedOptimizer(_optimizer(opt_kind, model), **(
        {"static_loss_scale": 128.0} if cfg.get("fp16") else {}))

    scaler = smp.amp.GradScaler(init_scale=1024.0) if cfg.get("_grad_scaler") else None

    @smp.step
    def train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
        out = model(ids) if kind != "llama" else model(input_ids=ids).logits
        loss = F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]).float(), ids[:, 1:].reshape(-1))
        model.backward(scaler.scale(loss) if scaler is not None else loss)
        return loss

    train_step.scaler = scaler

    return model, opt, train_step


def _steps(model: Any, opt: Any, train_step: Any, steps: range, clip: float | None = None,
           scaler: Any = None) -> list[float]:
    import smp.torch as smp

    losses = []
    for step in steps:
        opt.zero_grad()
        losses.append(train_step(model, _ids(step, smp.dp_rank())).reduce_mean().item())
        if scaler is not None:  # torch's AMP recipe: unscale, clip every parameter's gradient, step, update
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
            continue
        if clip is not None:
            opt.clip_master_grads(clip)
        opt.step()
    return losses


def _train(cfg: dict[str, Any], kind: str, opt_kind: str, clip: float | None) -> dict[str, Any]:
    import smp.torch as smp
    from smp.torch.optimizer_shard import optimizer_state_bytes

    out: dict[str, Any] = {}
    for sharded in (False, True):
        model, opt, train_step = _setup({**cfg, "shard_optimizer_state": sharded}, kind, opt_kind)
        losses = _steps(model, opt, train_step, range(STEPS), clip, train_step.scaler)
        shard = opt.state_shard()
        assert (shard is not None) == sharded
        per_param = [sum(v.numel() * v.element_size() for v in opt.state[p].values() if isinstance(v, torch.Tensor))
                     for g in opt.param_groups for p in g["params"] if p in opt.state]
        out[sharded] = {
            "coord": (smp.pp_rank(), smp.tp_rank(), smp.rdp_rank()), "losses": losses,
            "params": {n: p.detach().clone() for n, p in model.local_named_parameters()},
            "bytes": optimizer_state_bytes(opt), "largest": max(per_param, default=0),
            "stepped": sorted(n for n, p in model.local_named_parameters()
                              if shard is None or shard.owns(p)),
        }
        if sharded:
            try:
                opt.state_dict()
            except smp.exceptions.SMPCheckpointError as e:
                out["full_state_dict_error"] = str(e)
            try:
                with model.join():
                    pass
            except smp.exceptions.SMPError as e:
                out["join_error"] = str(e)
        smp.reset()
    return out


def _check(results: list[dict[str, Any]], rdp: int) -> None:
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in results:
        plain, sharded = r[False], r[True]
        c = sharded["coord"]
        assert sharded["losses"] == plain["losses"], (c, sharded["losses"], plain["losses"])
        for name, value in plain["params"].items():
            assert torch.equal(sharded["params"][name], value), (c, name)
        assert "gather_if_shard=False" in r["full_state_dict_error"] and "v3=True" in r["full_state_dict_error"]
        assert "shard_optimizer_state" in r["join_error"] and "same number of batches" in r["join_error"]
        groups.setdefault(c[:2], []).append(r)
    for (pp, tp), members in groups.items():
        assert len(members) == rdp
        stepped = [set(m[True]["stepped"]) for m in members]
        assert set().union(*stepped) == set(members[0][False]["stepped"]), "every parameter is stepped somewhere"
        assert sum(map(len, stepped)) == len(members[0][False]["stepped"]), "by exactly one rdp rank"
        for kind in ("state", "masters"):
            whole = members[0][False]["bytes"][kind]
            shares = [m[True]["bytes"][kind] for m in members]
            assert sum(shares) == whole, (pp, tp, kind, shares, whole)
            if whole:
                limit = whole / rdp + max(m[False]["largest"] for m in members)
                assert max(shares) <= limit, (pp, tp, kind, shares, whole)
                assert min(shares) > 0, "every rank holds part of the state"


def _one_process(clip: float) -> tuple[dict[int, list[float]], dict[str, torch.Tensor]]:
    """Plain torch: each replica's batch in 2 microbatches, the gradients averaged over all 4, clipped, AdamW."""
    torch.manual_seed(0)
    net = TinyGPT(vocab=VOCAB, layers=4, seq=SEQ)
    opt = _optimizer("adamw", net)
    losses: dict[int, list[float]] = {0: [], 1: []}
    for step in range(STEPS):
        opt.zero_grad()
        for replica in (0, 1):
            total = 0.0
            for ids in _ids(step, replica).chunk(2):
                out = net(ids)
                loss = F.cross_entropy(out[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
                (loss / 4).backward()
                total += loss.item() / 2
            losses[replica].append(total)
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
    return losses, {n: p.detach().clone() for n, p in net.named_parameters()}


def test_pp1_dp2_adamw_sharded_matches_unsharded_with_half_the_state() -> None:
    results = run_ranks(_train, 2, args=({}, "gpt", "adamw", 1.0), timeout=180)
    _check(results, rdp=2)
    shares = [r[True]["bytes"]["state"] / r[False]["bytes"]["state"] for r in results]
    assert all(0.35 < s < 0.65 for s in shares), shares
    losses, params = _one_process(1.0)
    for replica, r in enumerate(results):
        torch.testing.assert_close(r[True]["losses"], losses[replica], rtol=1e-5, atol=1e-6)
        for name, value in r[True]["params"].items():
            expected = params[name]
            if name.endswith("attn.in_proj_bias"):
                # The key bias has a gradient of exactly 0 in exact arithmetic (softmax ignores a
                # constant per query); AdamW turns its roundoff (~1e-10) into lr-sized steps either way.
                d = value.numel() // 3
                value, expected = torch.cat([value[:d], value[2 * d:]]), torch.cat([expected[:d], expected[2 * d:]])
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6, msg=name)


def test_pp1_dp2_fp16_masters_and_fused_lamb_are_sharded() -> None:
    results = run_ranks(_train, 2, args=({"fp16": True}, "gpt", "lamb", 0.5), timeout=180)
    _check(results, rdp=2)
    assert all(r[True]["bytes"]["masters"] < r[False]["bytes"]["masters"] for r in results)


def test_grad_scaler_unscales_every_gradient_before_a_user_clip() -> None:
    """torch's AMP recipe (``scaler.unscale_(opt)``, ``clip_grad_norm_(model.parameters())``, ``scaler.step``):
    the optimizer lists only the parameters this rank steps, and the others' gradients must be unscaled too,
    or the clip norm mixes scaled and unscaled gradients."""
    _check(run_ranks(_train, 2, args=({"_grad_scaler": True}, "gpt", "sgd", None), timeout=180), rdp=2)


@pytest.mark.slow
def test_pp2_dp2_and_tp2_dp2_sharded_match_unsharded() -> None:
    _check(run_ranks(_train, 4, args=({"pipeline_parallel_degree": 2}, "gpt", "adamw", None), timeout=300), rdp=2)
    _check(run_ranks(_train, 4, args=({"tensor_parallel_degree": 2}, "llama", "sgd", 1.0), timeout=300), rdp=2)


# --- checkpoints ---------------------------------------------------------------------------------

def _checkpoints(path: str, pp: int) -> dict[str, Any]:
    import smp.torch as smp

    cfg = {"pipeline_parallel_degree": pp}
    out: dict[str, Any] = {}
    model, opt, train_step = _setup({**cfg, "shard_optimizer_state": True}, "gpt", "adamw")
    out["first"] = _steps(model, opt, train_step, range(2))
    smp.save_checkpoint(path, "step2")
    shard = opt.local_state_dict(gather_if_shard=False)
    smp.save(shard, os.path.join(path, "v3", "optimizer.pt"), partial=True, v3=True)
    out["whole"] = sorted(opt.local_state_dict()["state"])  # gathered over the RDP group (every rank calls)
    out["shard"] = sorted(shard["state"])
    out["uninterrupted"] = _steps(model, opt, train_step, range(2, STEPS))
    out["files"] = sorted(os.listdir(os.path.join(path, "step2_partial")))
    smp.reset()
    for name, sharded in (("resumed_sharded", True), ("resumed_unsharded", False)):
        model, opt, train_step = _setup({**cfg, "shard_optimizer_state": sharded}, "gpt", "adamw")
        smp.resume_from_checkpoint(path, "step2")
        out[name] = _steps(model, opt, train_step, range(2, STEPS))
        smp.reset()
    # The transformers Trainer's SMP path: smp.save(..., v3=True) per rank, smp.load in a post-partition hook.
    model, opt, train_step = _setup({**cfg, "shard_optimizer_state": True}, "gpt", "adamw")
    smp.resume_from_checkpoint(path, "step2", load_optimizer=False)

    def load_optimizer(model: Any, optimizer: Any) -> None:
        optimizer.load_state_dict(smp.load(os.path.join(path, "v3", "optimizer.pt"), partial=True))

    model.register_post_step_hook(load_optimizer)  # as the Trainer does

    out["resumed_v3"] = _steps(model, opt, train_step, range(2, STEPS))
    smp.reset()
    # A shard loads only where it belongs, unless gathered.
    model, opt, train_step = _setup(cfg, "gpt", "adamw")
    _steps(model, opt, train_step, range(1))
    try:
        opt.load_state_dict(shard)
    except smp.exceptions.SMPCheckpointError as e:
        out["wrong_place"] = str(e)
    smp.reset()
    return out


def test_sharded_checkpoints_resume_with_the_same_losses(tmp_path: Any) -> None:
    # pp=1 x dp=2; the v3 files of two stages are checked by test_smp_v1_scripts (train_gpt_simple at pp2 x dp2).
    pp = 1
    results = run_ranks(_checkpoints, 2 * pp, args=(str(tmp_path), pp), timeout=300)
    for r in results:
        for name in ("resumed_sharded", "resumed_unsharded", "resumed_v3"):
            assert r[name] == r["uninterrupted"], (name, r[name], r["uninterrupted"])
        assert "gather_if_shard=True" in r["wrong_place"]
        assert set(r["shard"]) < set(r["whole"]), "a shard holds part of the state; gathered, all of it"
    files = results[0]["files"]
    for stage in range(pp):
        assert {f"optimizer_{stage}_0_0.pt", f"optimizer_{stage}_0_1.pt", f"model_{stage}_0.pt"} <= set(files), files
    assert not any(f.startswith("optimizer_") and f.count("_") == 2 for f in files), "no unsharded optimizer file"
    assert sorted(os.listdir(tmp_path / "v3")) == sorted(
        f"optimizer.pt_{stage}_0_{rdp}.pt" for stage in range(pp) for rdp in range(2))

