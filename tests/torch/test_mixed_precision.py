"""``fp16: True`` / ``bf16: True``: 16-bit model, fp32 master weights, loss scaling, agreed overflow skipping.

Each parallel run is compared with a plain-torch run of the same precision in one process (the same
16-bit forward and backward, the same microbatch sums, fp32 masters), which must give the same losses
and weights, and with a float32 run, which must be close and not equal (the model really runs in 16 bits).

Tolerances against float32 (losses and fp32 master weights, relative and absolute): about two units of
roundoff of the 16-bit type, fp16 1e-3 (2 x 2**-11) and bf16 1e-2 (2.5 x 2**-8). Measured on these runs:
fp16 losses within 1.2e-4 and masters within 4.4e-4 of float32, bf16 within 5.2e-4 and 3.1e-3, so the
bounds hold with 2-8x room.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from smp.torch.amp import DynamicLossScaler, LossScaler, make_loss_scaler

from tests.helpers.spawn import run_ranks
from tests.torch.zoo import MLP

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
MICROBATCHES = 2
LR = 0.05
POISONED = "net.8.weight"  # the last Linear: on pp_rank 1 when pp = 2


# --- the loss scalers: exact tables --------------------------------------------------------------

def _scales(scaler: LossScaler, pattern: str) -> list[float]:
    out = []
    for mark in pattern:
        scaler.update_scale(mark == "O")
        out.append(scaler.loss_scale)
    return out


def test_dynamic_loss_scaler_follows_smp_v1_rules() -> None:
    # O = overflow, . = clean; the scale after each step.
    assert _scales(DynamicLossScaler(init_scale=8.0, scale_window=2), "O..O..") == [4, 4, 8, 4, 4, 8]
    # delayed_shift=2: the first overflow is tolerated; the tolerance comes back after a clean window.
    assert _scales(DynamicLossScaler(init_scale=8.0, scale_window=3, delayed_shift=2), "OO.O...O") == \
        [8, 4, 4, 2, 2, 2, 4, 4]
    # consecutive_hysteresis: every clean step restores the tolerance.
    assert _scales(DynamicLossScaler(init_scale=8.0, scale_window=3, delayed_shift=2, consecutive_hysteresis=True),
                   "OO.O...O") == [8, 4, 4, 4, 4, 4, 8, 8]
    assert _scales(DynamicLossScaler(init_scale=4.0, min_scale=2.0), "OOO") == [2, 2, 2]
    assert _scales(DynamicLossScaler(scale_window=1, scale_factor=4.0, init_scale=1.0), "..") == [4, 16]
    static = make_loss_scaler(256.0, False, None)
    assert type(static) is LossScaler and _scales(static, "O.O") == [256, 256, 256]
    d = DynamicLossScaler()
    assert (d.loss_scale, d.scale_factor, d.scale_window, d.min_scale, d.delayed_shift, d.consecutive_hysteresis) == \
        (2.0**32, 2.0, 1000, 1.0, 1, False)  # SMP v1's defaults
    _scales(d, "O.")
    fresh = DynamicLossScaler()
    fresh.load_state_dict(d.state_dict())
    assert _scales(fresh, "O") == _scales(d, "O")


def test_bad_loss_scaling_arguments_are_all_named_at_once() -> None:
    with pytest.raises(ValueError) as e:
        make_loss_scaler(None, True, {"scale_windw": 10, "scale_factor": 1, "delayed_shift": 0.5})
    text = str(e.value)
    assert "scale_windw" in text and "scale_window" in text, "an unknown key lists the valid ones"
    assert "must be a number > 1" in text and "must be an int >= 1" in text
    assert len(e.value.problems) == 3  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="need dynamic_loss_scale=True"):
        make_loss_scaler(1.0, False, {"scale_window": 10})
    with pytest.raises(ValueError, match="static loss scale must be a number > 0"):
        make_loss_scaler(None, False, None)
    # SMP v1 scripts pass argparse ints as truth values; a string is refused ("0" is true in Python)
    assert make_loss_scaler(None, 1, None).dynamic and not make_loss_scaler(2.0, 0, None).dynamic
    with pytest.raises(ValueError, match=r"dynamic_loss_scale=...\)='1': must be a bool or an int"):
        make_loss_scaler(None, "1", None)


# --- training: smp against plain torch ------------------------------------------------------------

def _data(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + replica)
    return torch.randn(8, 12, generator=g), torch.randn(8, 5, generator=g)


def _build() -> MLP:
    torch.manual_seed(0)
    return MLP()  # built in float32 and cast: the same starting weights in every precision


def _train(precision: str, pp: int, dp: int, steps: int, scaler: dict[str, Any], clip: float | None,
           poison: tuple[int, tuple[int, int]] | None, creation_dtype: bool) -> dict[str, Any]:
    import smp.torch as smp

    smp.init({"pipeline_parallel_degree": pp, "microbatches": MICROBATCHES, "ddp": dp > 1, "auto_partition": False,
              "default_partition": 0, "fp16": precision == "fp16", "bf16": precision == "bf16",
              "comm_timeout": 60.0})
    dtype = DTYPES[precision]
    if creation_dtype:  # SMP v1's way: build under model_creation(dtype=...)
        with smp.model_creation(dtype=dtype):
            net = _build()
        net.load_state_dict(_build().state_dict())  # the same weights as the reference
    else:
        net = _build()
    model = smp.DistributedModel(net)
    net.place(pp, smp.set_partition)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), **scaler)

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = model(x)
        assert out.dtype == torch.float32, "outputs come back in float32"
        loss = F.mse_loss(out, y)
        model.backward(loss)
        return loss

    losses, scales, overflows, norms = [], [], [], []
    for step in range(steps):
        opt.zero_grad()
        losses.append(float(train_step(model, *_data(step, smp.dp_rank())).reduce_mean()))
        params = dict(model.local_named_parameters())
        if poison is not None and step == poison[0] and (smp.pp_rank(), smp.dp_rank()) == poison[1]:
            params[POISONED].grad[0, 0] = float("inf")  # after the DP allreduce: this rank alone sees it
        if clip is not None:
            norms.append(opt.clip_master_grads(clip))
        opt.step()
        overflows.append(opt.overflow)
        scales.append(opt.loss_scaler.loss_scale)
    masters = opt.master_weights.masters if opt.master_weights is not None else {}
    return {"coord": (smp.pp_rank(), smp.dp_rank()), "losses": losses, "scales": scales, "overflows": overflows,
            "norms": norms,
            "params": {n: p.detach().clone() for n, p in model.local_named_parameters()},
            "masters": {n: masters[id(p)].detach().clone() for n, p in model.local_named_parameters() if id(p) in masters},
            "grad_dtypes": sorted({str(p.grad.dtype) for p in model.local_parameters() if p.grad is not None})}


def _reference(precision: str, dp: int, steps: int, scaler: LossScaler, clip: float | None,
               poison_step: int | None, skip: set[int] | None = None) -> dict[str, Any]:
    """One process, plain torch: a 16-bit model, fp32 masters, the scaled loss, smp's order of sums.

    Each replica halves each microbatch's 16-bit gradients and sums them (SMP v1's order: the mean
    never overflows where the microbatches do not), the replicas' results are summed and divided by
    their number (what the DP allreduce does), then master grads = that / scale.
    ``skip`` forces steps to be skipped (the float32 run that skips the steps a 16-bit run skipped).
    """
    dtype = DTYPES[precision]
    net = _build().to(dtype)
    names = [n for n, _ in net.named_parameters()]
    masters = [p.detach().float().clone().requires_grad_() for p in net.parameters()]
    opt = torch.optim.SGD(masters, lr=LR, momentum=0.9)
    losses: list[list[float]] = [[] for _ in range(dp)]
    scales, overflows, norms = [], [], []
    for step in range(steps):
        summed = None
        for r in range(dp):
            net.zero_grad(set_to_none=True)
            x, y = _data(step, r)
            mb = [F.mse_loss(net(xm.to(dtype)).float(), ym) for xm, ym in zip(x.chunk(MICROBATCHES),
                                                                             y.chunk(MICROBATCHES))]
            grads = None
            for loss in mb:
                parts = torch.autograd.grad(loss * scaler.loss_scale if precision == "fp16" else loss,
                                            list(net.parameters()))
                halves = [g / MICROBATCHES for g in parts] if precision != "fp32" else list(parts)
                grads = halves if grads is None else [a + b for a, b in zip(grads, halves)]
            assert grads is not None
            if precision == "fp32":  # float32 gradients: the step's sum, divided once
                grads = [g / MICROBATCHES for g in grads]
            losses[r].append(float(sum(mb).detach() / MICROBATCHES))
            summed = grads if summed is None else [a + b for a, b in zip(summed, grads)]
        assert summed is not None
        grads = [g / dp for g in summed] if dp > 1 else summed
        if step == poison_step:
            grads[names.index(POISONED)][0, 0] = float("inf")
        for m, g in zip(masters, grads):
            m.grad = g.float() / scaler.loss_scale
        overflow = not all(bool(torch.isfinite(m.grad).all()) for m in masters) or step in (skip or set())
        if clip is not None:
            norms.append(-1.0 if overflow else float(torch.nn.utils.clip_grad_norm_(masters, clip)))
        scaler.update_scale(overflow)
        if not overflow:
            opt.step()
            with torch.no_grad():
                for p, m in zip(net.parameters(), masters):
                    p.copy_(m)
        overflows.append(overflow)
        scales.append(scaler.loss_scale)
    return {"losses": losses, "scales": scales, "overflows": overflows, "norms": norms,
            "params": {n: p.detach().clone() for n, p in net.named_parameters()},
            "masters": dict(zip(names, (m.detach().clone() for m in masters)))}


def _check(ranks: list[dict[str, Any]], ref: dict[str, Any], precision: str, clip: bool) -> None:
    dtype = DTYPES[precision]
    for r in ranks:
        c = r["coord"]
        assert r["overflows"] == ref["overflows"], (c, r["overflows"], ref["overflows"])
        assert r["scales"] == ref["scales"], c
        assert r["grad_dtypes"] == [str(dtype)], "the model's gradients are 16-bit"
        torch.testing.assert_close(r["losses"], ref["losses"][c[1]], rtol=0, atol=0, msg=lambda m, c=c: f"{c} losses: {m}")
        if clip:
            torch.testing.assert_close(r["norms"], ref["norms"], rtol=1e-6, atol=0, msg=lambda m, c=c: f"{c} norms: {m}")
        assert r["params"], c
        for name, value in r["params"].items():
            assert value.dtype == dtype, (c, name)
            torch.testing.assert_close(value, ref["params"][name], rtol=0, atol=0, msg=lambda m, n=name, c=c: f"{c} {n}: {m}")
            master = r["masters"][name]
            assert master.dtype == torch.float32
            torch.testing.assert_close(master, ref["masters"][name], msg=lambda m, n=name, c=c: f"{c} master {n}: {m}")
            assert torch.equal(master.to(dtype), value), "the model holds its masters, rounded"
    kept_bits = [not torch.equal(m, m.to(dtype).float()) for r in ranks for m in r["masters"].values()]
    assert any(kept_bits), "the fp32 masters hold what 16-bit weights cannot"


def _check_close_to_fp32(ranks: list[dict[str, Any]], precision: str, dp: int, steps: int,
                         clip: float | None) -> None:
    skipped = {i for i, o in enumerate(ranks[0]["overflows"]) if o}
    fp32 = _reference("fp32", dp, steps, LossScaler(1.0), clip, None, skip=skipped)
    rtol = {"fp16": 1e-3, "bf16": 1e-2}[precision]
    for r in ranks:
        ours, exact = r["losses"], fp32["losses"][r["coord"][1]]
        torch.testing.assert_close(ours, exact, rtol=rtol, atol=0)
        assert ours != exact, "a 16-bit run that matches float32 exactly did not run in 16 bits"
        for name, master in r["masters"].items():
            torch.testing.assert_close(master, fp32["masters"][name], rtol=rtol, atol=rtol)


def test_fp16_pp2_overflows_back_off_and_skip_on_every_rank() -> None:
    """A loss scale of 2**24 overflows fp16 (max 65504) for the first steps: every rank skips them and
    halves the scale together; later an inf on pp_rank 1 alone skips a step everywhere."""
    steps, args = 12, {"static_loss_scale": None, "dynamic_loss_scale": True,
                       "dynamic_loss_args": {"init_scale": 2.0**24, "scale_window": 3}}
    ranks = run_ranks(_train, 2, args=("fp16", 2, 1, steps, args, 1.0, (10, (1, 0)), True), timeout=180)
    ref = _reference("fp16", 1, steps, DynamicLossScaler(init_scale=2.0**24, scale_window=3), 1.0, 10)
    first_clean = ref["overflows"].index(False)
    assert first_clean >= 3 and all(ref["overflows"][:first_clean]), ref["overflows"]
    assert ref["overflows"][10] and ref["scales"][:first_clean] == [2.0**(23 - i) for i in range(first_clean)]
    _check(ranks, ref, "fp16", clip=True)
    assert all(n == -1.0 for r in ranks for n, o in zip(r["norms"], r["overflows"]) if o)
    _check_close_to_fp32(ranks, "fp16", 1, steps, 1.0)


def test_bf16_pp1_dp2_matches_one_process_and_float32() -> None:
    steps = 5
    ranks = run_ranks(_train, 2, args=("bf16", 1, 2, steps, {}, 0.05, None, False), timeout=180)
    ref = _reference("bf16", 2, steps, LossScaler(1.0), 0.05, None)
    assert not any(ref["overflows"]) and ref["scales"] == [1.0] * steps
    _check(ranks, ref, "bf16", clip=True)
    assert all(n > 0.05 for n in ref["norms"]), "the clip is active"
    _check_close_to_fp32(ranks, "bf16", 2, steps, 0.05)


@pytest.mark.slow
def test_fp16_pp2_dp2_an_inf_on_one_replica_skips_everywhere() -> None:
    steps, args = 6, {"static_loss_scale": 1024.0}
    ranks = run_ranks(_train, 4, args=("fp16", 2, 2, steps, args, 2.0, (3, (1, 1)), False), timeout=240)
    ref = _reference("fp16", 2, steps, LossScaler(1024.0), 2.0, 3)
    assert ref["overflows"] == [i == 3 for i in range(steps)] and ref["scales"] == [1024.0] * steps
    _check(ranks, ref, "fp16", clip=True)
    _check_close_to_fp32(ranks, "fp16", 2, steps, 2.0)


@pytest.mark.slow
def test_bf16_pp2_matches_one_process() -> None:
    ranks = run_ranks(_train, 2, args=("bf16", 2, 1, 4, {"dynamic_loss_scale": True}, None, None, True),
                      timeout=180)
    ref = _reference("bf16", 1, 4, LossScaler(1.0), None, None)  # bf16: the loss is not scaled (SMP v1)
    _check(ranks, ref, "bf16", clip=False)


def _delayed() -> dict[str, Any]:
    import smp.torch as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES, "auto_partition": False,
              "default_partition": 0, "fp16": True, "delayed_parameter_initialization": True, "comm_timeout": 60.0})
    with smp.model_creation():  # parameters on the meta device until partitioning
        net = _build()
    model = smp.DistributedModel(net)
    net.place(2, smp.set_partition)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), static_loss_scale=128.0)

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    losses = []
    for _ in range(3):  # the same batch: the loss must go down
        opt.zero_grad()
        losses.append(float(train_step(model, *_data(0, 0)).reduce_mean()))
        opt.step()
    masters = opt.master_weights.masters
    return {"losses": losses, "dtypes": sorted({str(p.dtype) for p in model.local_parameters()}),
            "masters": sorted({str(masters[id(p)].dtype) for p in model.local_parameters()}),
            "all_paired": all(id(p) in masters for p in model.local_parameters())}


def test_delayed_parameters_materialise_in_16_bits_with_fp32_masters() -> None:
    for r in run_ranks(_delayed, 2, timeout=120):
        assert r["dtypes"] == ["torch.float16"] and r["masters"] == ["torch.float32"] and r["all_paired"]
        assert all(math.isfinite(v) for v in r["losses"]) and r["losses"][-1] < r["losses"][0], r["losses"]
