"""``optimizer.state_dict()`` under tensor parallelism (SMP v1's test_final_loss_equal saves it at tp2 x pp2):
TP-sharded states come back as full tensors equal to one process's optimizer state, and the dict loads
in another layout and continues training exactly as one process does."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.torch.launch_cases import naming, run_cases

transformers = pytest.importorskip("transformers")

STEPS = 2  # trained before the save; one more after the load


def _model() -> Any:
    from tests.torch.tp.test_tp_hf import _model as hf_model

    return hf_model("llama", num_hidden_layers=4)


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))


def _reference(opt_name: str) -> tuple[list[float], dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """One process: losses of STEPS + 1 steps, the optimizer state after STEPS by name, the weights after all."""
    model = _model()
    opt = _optimizer(opt_name, model.parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    losses, state = [], {}
    for step in range(STEPS + 1):
        if step == STEPS:
            state = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
        opt.zero_grad()
        loss = model(input_ids=_ids(step), labels=_ids(step)).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, state, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adafactor":  # factored second moments: not elementwise, kept per TP rank
        return torch.optim.Adafactor(params, lr=1e-2)
    # eps well above float noise: an element whose gradient is float noise (~1e-9) would otherwise step
    # by +-lr on a sign flip between the TP sum and the one-process sum, in any correct implementation.
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-5)


def _train(layout: dict[str, Any], steps: range, opt_name: str = "adamw", load: str | None = None,
           save: str | None = None) -> dict[str, Any]:
    """One layout on every rank: optionally load a full checkpoint, train ``steps``, optionally save
    the full model and optimizer state (SMP v1's test: state_dict() on every rdp_rank 0 rank, smp.save
    partial=False). Under bf16, ``loaded_masters`` are this rank's fp32 masters right after the load."""
    import smp.torch as smp

    smp.init({"microbatches": 2, "ddp": True, "comm_timeout": 60.0, **layout})
    with smp.tensor_parallelism(enabled=layout.get("tensor_parallel_degree", 1) > 1):
        net = _model()
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(_optimizer(opt_name, model.parameters()))
    out: dict[str, Any] = {}
    if load is not None:
        saved = smp.load(load, partial=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        if layout.get("bf16"):  # runs after the optimizer's own hook, which applies the load
            model.register_post_partition_hook(lambda m, o: out.update(loaded_masters={
                k: v.clone() for k, v in o.local_state_dict()["fp32_from_fp16"].items()}))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids)["loss"]
        model.backward(loss)
        return loss

    losses = []
    for step in steps:
        opt.zero_grad()
        losses.append(train_step(model, _ids(step)).reduce_mean().item())
        opt.step()
    out["losses"] = losses
    if save is not None:
        state = model.state_dict() if smp.rdp_rank() == 0 else {}
        opt_state = opt.state_dict() if smp.rdp_rank() == 0 else {}
        if smp.rank() == 0:
            smp.save({"model": state, "optimizer": opt_state}, save, partial=False)
        out["optimizer"] = opt_state
        smp.barrier()
    out["weights"] = model.state_dict(gather_to_rank0=False)
    return out


def _refused_at_load(path: str, layout: dict[str, Any]) -> str:
    import smp.torch as smp

    smp.init({"microbatches": 2, "ddp": True, "comm_timeout": 60.0, **layout})
    model = smp.DistributedModel(_model())
    opt = smp.DistributedOptimizer(_optimizer("adafactor", model.parameters()))
    try:
        opt.load_state_dict(smp.load(path, partial=False)["optimizer"])
    except smp.exceptions.SMPCheckpointError as e:
        return str(e)
    return "loaded"


def test_full_optimizer_state_under_tp_is_one_process_state_and_loads_in_other_layouts(tmp_path: Any) -> None:
    ckpt, factored, half = (str(tmp_path / name) for name in ("full.pt", "adafactor.pt", "bf16.pt"))
    tp2pp2 = {"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2}
    cases = [
        ("save tp2 x pp2", _train, {"layout": tp2pp2, "steps": range(STEPS), "save": ckpt}),
        ("load tp1 x pp2 x dp2", _train, {"layout": {"pipeline_parallel_degree": 2}, "steps": range(STEPS, STEPS + 1),
                                          "load": ckpt}),
        ("load tp2 x dp2", _train, {"layout": {"tensor_parallel_degree": 2}, "steps": range(STEPS, STEPS + 1),
                                    "load": ckpt}),
        ("load tp2 x pp2", _train, {"layout": tp2pp2, "steps": range(STEPS, STEPS + 1), "load": ckpt}),
        ("adafactor save tp2 x pp2", _train, {"layout": tp2pp2, "steps": range(STEPS), "opt_name": "adafactor",
                                              "save": factored}),
        ("adafactor straight tp2 x pp2", _train, {"layout": tp2pp2, "steps": range(STEPS + 1),
                                                  "opt_name": "adafactor"}),
        ("adafactor load tp2 x pp2", _train, {"layout": tp2pp2, "steps": range(STEPS, STEPS + 1),
                                              "opt_name": "adafactor", "load": factored}),
        ("bf16 save tp2 x pp2", _train, {"layout": {**tp2pp2, "bf16": True}, "steps": range(STEPS), "save": half}),
        ("bf16 load tp1 x pp2 x dp2", _train, {"layout": {"pipeline_parallel_degree": 2, "bf16": True},
                                               "steps": range(STEPS, STEPS + 1), "load": half}),
        ("bf16 load tp2 x dp2", _train, {"layout": {"tensor_parallel_degree": 2, "bf16": True},
                                         "steps": range(STEPS, STEPS + 1), "load": half}),
        ("adafactor load tp1", _refused_at_load, {"path": factored, "layout": {"pipeline_parallel_degree": 2}}),
    ]
    got = run_cases(4, cases, timeout=400)
    losses, state, weights = _reference("adamw")
    with naming("save tp2 x pp2"):
        for rank, out in enumerate(got["save tp2 x pp2"]):
            torch.testing.assert_close(out["losses"], losses[:STEPS], rtol=1e-5, atol=1e-6)
            full = out["optimizer"]["state"]
            assert sorted(full) == sorted(state), f"rank {rank}: every parameter's state, by name"
            for name, values in state.items():
                for key, value in values.items():
                    torch.testing.assert_close(full[name][key], value, rtol=1e-4, atol=1e-6,
                                               msg=lambda m, n=name, k=key, r=rank: f"rank {r}: {n}.{k}: {m}")
    assert os.path.getsize(ckpt) > 0
    for case in ("load tp1 x pp2 x dp2", "load tp2 x dp2", "load tp2 x pp2"):
        with naming(case):
            for out in got[case]:
                torch.testing.assert_close(out["losses"], losses[STEPS:], rtol=1e-5, atol=1e-6)
                for name, value in weights.items():
                    torch.testing.assert_close(out["weights"][name], value, rtol=1e-4, atol=1e-5,
                                               msg=lambda m, n=name: f"{n}: {m}")
    # Adafactor's factored moments of a shard are not the full weight's: the loaded run repeats the
    # uninterrupted run in the same layout (to float rounding: each launch partitions afresh).
    with naming("adafactor load tp2 x pp2"):
        for straight, loaded in zip(got["adafactor straight tp2 x pp2"], got["adafactor load tp2 x pp2"]):
            torch.testing.assert_close(loaded["losses"], straight["losses"][STEPS:], rtol=1e-6, atol=1e-7)
            for name, value in straight["weights"].items():
                torch.testing.assert_close(loaded["weights"][name], value, rtol=1e-5, atol=1e-7)
    # bf16: the fp32 masters are TP-sharded like their weights; the full ones load exactly in another layout.
    with naming("bf16 save tp2 x pp2"):
        saved = got["bf16 save tp2 x pp2"][0]
        masters = saved["optimizer"]["fp32_from_fp16"]
        assert masters and all(v.dtype == torch.float32 for v in masters.values())
        for name, master in masters.items():
            assert torch.equal(master.bfloat16(), saved["weights"][name]), name
    for case in ("bf16 load tp1 x pp2 x dp2", "bf16 load tp2 x dp2"):
        with naming(case):
            for out in got[case]:
                assert out["loaded_masters"], "each rank steps some masters"
                for name, master in out["loaded_masters"].items():
                    full = masters[name]
                    if master.shape != full.shape:  # this rank's TP shard
                        dim = next(d for d in range(full.dim()) if master.shape[d] != full.shape[d])
                        parts = full.chunk(full.shape[dim] // master.shape[dim], dim=dim)
                        assert any(torch.equal(master, part) for part in parts), name
                    else:
                        assert torch.equal(master, full), name
    for message in got["adafactor load tp1"]:
        assert "saved per TP rank at tensor_parallel_degree 2" in message and "this run has 1" in message, message
