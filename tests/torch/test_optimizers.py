"""smp.torch.optimizers: FusedAdam against torch's Adam/AdamW and a plain Adam without bias
correction; FusedLAMB against a plain per-tensor LAMB written here (apex's update)."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from smp.torch.optimizers import FusedAdam, FusedLAMB, FusedLamb, OptimizerArgumentError
from torch import nn


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 3)
        nn.init.zeros_(self.fc2.bias)  # a zero-norm parameter: LAMB's trust ratio falls back to 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _model(dtype: torch.dtype = torch.float64) -> Tiny:
    torch.manual_seed(0)
    return Tiny().to(dtype)


def _batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 4, generator=g, dtype=dtype), torch.randn(8, 3, generator=g, dtype=dtype)


def _backward(model: nn.Module, step: int, dtype: torch.dtype) -> None:
    x, y = _batch(step, dtype)
    model.zero_grad(set_to_none=True)
    ((model(x) - y) ** 2).mean().backward()


def _groups(model: Tiny, **second: Any) -> list[dict[str, Any]]:
    """Weights with weight decay, biases in a second group (with ``second``'s settings)."""
    weights = [model.fc1.weight, model.fc2.weight]
    biases = [model.fc1.bias, model.fc2.bias]
    return [{"params": weights}, {"params": biases, **second}]


# --- FusedAdam ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_fused_adam_is_torchs_adam(adam_w_mode: bool, amsgrad: bool) -> None:
    dtype = torch.float32
    ours, ref = _model(dtype), _model(dtype)
    opt = FusedAdam(ours.parameters(), lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.1,
                    adam_w_mode=adam_w_mode, amsgrad=amsgrad)
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref_opt = cls(ref.parameters(), lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.1, amsgrad=amsgrad,
                  foreach=False)
    for step in range(5):
        for m, o in ((ours, opt), (ref, ref_opt)):
            _backward(m, step, dtype)
            o.step()
        for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"{name} after step {step}")
    # CPU has torch's fused Adam kernel: the group picked it at its first step.
    assert all(g["fused"] for g in opt.param_groups)


def _adam_uncorrected(params: list[torch.Tensor], grads: list[torch.Tensor], state: dict[int, Any], lr: float,
                      betas: tuple[float, float], eps: float, wd: float, adam_w: bool, amsgrad: bool) -> None:
    """apex's Adam with bias_correction=False, one tensor at a time."""
    b1, b2 = betas
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        s = state.setdefault(i, {"m": torch.zeros_like(p), "v": torch.zeros_like(p), "vmax": torch.zeros_like(p)})
        if not adam_w:
            g = g + wd * p
        s["m"] = b1 * s["m"] + (1 - b1) * g
        s["v"] = b2 * s["v"] + (1 - b2) * g * g
        s["vmax"] = torch.maximum(s["vmax"], s["v"])
        update = s["m"] / ((s["vmax"] if amsgrad else s["v"]).sqrt() + eps)
        if adam_w:
            update = update + wd * p
        p.sub_(lr * update)


@pytest.mark.parametrize("adam_w_mode,amsgrad", [(True, False), (False, False), (True, True)])
def test_fused_adam_without_bias_correction_matches_the_plain_update(adam_w_mode: bool, amsgrad: bool) -> None:
    dtype = torch.float64
    ours, ref = _model(dtype), _model(dtype)
    # First group corrected (torch's kernel), second not (smp's foreach update): one optimizer, both kinds.
    opt = FusedAdam(_groups(ours, bias_correction=False, weight_decay=0.05), lr=1e-2, weight_decay=0.1,
                    adam_w_mode=adam_w_mode, amsgrad=amsgrad)
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref_opt = cls([ref.fc1.weight, ref.fc2.weight], lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, foreach=False)
    state: dict[int, Any] = {}
    for step in range(5):
        _backward(ours, step, dtype)
        opt.step()
        _backward(ref, step, dtype)
        ref_opt.step()
        biases = [ref.fc1.bias, ref.fc2.bias]
        with torch.no_grad():
            _adam_uncorrected(biases, [b.grad for b in biases], state, 1e-2, (0.9, 0.999), 1e-8, 0.05,
                              adam_w_mode, amsgrad)
        for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12, msg=f"{name} after step {step}")
    assert set(opt.state[ours.fc2.bias]) == set(opt.state[ours.fc2.weight])  # one state layout for both kinds


def test_fused_adam_state_dict_resumes_the_same_run() -> None:
    dtype = torch.float64
    straight, resumed = _model(dtype), _model(dtype)
    opt = FusedAdam(_groups(straight, bias_correction=False), lr=1e-2)
    for step in range(3):
        _backward(straight, step, dtype)
        opt.step()
        if step == 1:
            saved = (copy.deepcopy(straight.state_dict()), copy.deepcopy(opt.state_dict()))
    resumed.load_state_dict(saved[0])
    opt2 = FusedAdam(_groups(resumed, bias_correction=False), lr=1e-2)
    opt2.load_state_dict(saved[1])
    _backward(resumed, 2, dtype)
    opt2.step()
    for p, q in zip(straight.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_fused_adam_runs_step_hooks_once_and_clears_grads_to_none() -> None:
    torch.optim.Adam([nn.Parameter(torch.zeros(1))])  # torch's own Adam.step is hook-wrapped from now on
    model = _model()
    opt = FusedAdam(model.parameters())
    calls: list[int] = []
    opt.register_step_pre_hook(lambda *_: calls.append(1))
    _backward(model, 0, torch.float64)
    opt.step()
    assert calls == [1]
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    keep = FusedAdam(model.parameters(), set_grad_none=False)
    _backward(model, 0, torch.float64)
    keep.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_fused_adam_refuses_what_it_cannot_honour() -> None:
    params = list(_model().parameters())
    with pytest.raises(OptimizerArgumentError, match="master_weights.*DistributedOptimizer"):
        FusedAdam(params, master_weights=True)
    with pytest.raises(OptimizerArgumentError, match=r"betas=\(0.9, 1.5\).*\[0, 1\).*weight_decay=-1"):
        FusedAdam(params, betas=(0.9, 1.5), weight_decay=-1)


# --- FusedLAMB ----------------------------------------------------------------------------------------


class ReferenceLAMB:
    """LAMB as apex computes it, one tensor at a time in plain torch (see FusedLAMB's docstring)."""

    def __init__(self, groups: list[dict[str, Any]], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, bias_correction: bool, adam_w_mode: bool, grad_averaging: bool,
                 max_grad_norm: float | None, use_nvlamb: bool) -> None:
        self.groups = [{"lr": lr, "weight_decay": weight_decay, **g} for g in groups]
        self.betas, self.eps, self.bias_correction = betas, eps, bias_correction
        self.adam_w_mode, self.grad_averaging = adam_w_mode, grad_averaging
        self.max_grad_norm, self.use_nvlamb = max_grad_norm, use_nvlamb
        self.m: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.t = 0

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        b1, b2 = self.betas
        everything = [p.grad for g in self.groups for p in g["params"]]
        norm = math.sqrt(sum(float((x * x).sum()) for x in everything))
        clip = max(1.0, norm / self.max_grad_norm) if self.max_grad_norm else 1.0
        c1, c2 = (1 - b1 ** self.t, 1 - b2 ** self.t) if self.bias_correction else (1.0, 1.0)
        for group in self.groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                g = p.grad / clip
                if not self.adam_w_mode:
                    g = g + wd * p
                m = self.m.get(id(p), torch.zeros_like(p))
                v = self.v.get(id(p), torch.zeros_like(p))
                m = b1 * m + ((1 - b1) if self.grad_averaging else 1.0) * g
                v = b2 * v + (1 - b2) * g * g
                self.m[id(p)], self.v[id(p)] = m, v
                update = (m / c1) / ((v / c2).sqrt() + self.eps)
                if self.adam_w_mode:
                    update = update + wd * p
                ratio = 1.0
                if wd != 0 or self.use_nvlamb:
                    pn, un = float(p.norm()), float(update.norm())
                    if pn > 0 and un > 0:
                        ratio = pn / un
                p.sub_(lr * ratio * update)


LAMB_CASES = {
    "apex defaults": {},
    "L2, no averaging, no correction, clipping, nvlamb": {"adam_w_mode": False, "grad_averaging": False,
                                                          "bias_correction": False, "max_grad_norm": 0.05,
                                                          "use_nvlamb": True},
    "no clipping": {"max_grad_norm": None, "betas": (0.8, 0.95), "eps": 1e-8},
}


@pytest.mark.parametrize("case", list(LAMB_CASES))
def test_fused_lamb_matches_the_plain_lamb_update(case: str) -> None:
    options = {"lr": 5e-2, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.01, "bias_correction": True,
               "adam_w_mode": True, "grad_averaging": True, "max_grad_norm": 1.0, "use_nvlamb": False,
               **LAMB_CASES[case]}
    dtype = torch.float64
    ours, ref = _model(dtype), _model(dtype)
    # The biases take no weight decay: without use_nvlamb their update skips the trust ratio.
    opt = FusedLAMB(_groups(ours, weight_decay=0.0, lr=2e-2), **options)
    ref_opt = ReferenceLAMB(_groups(ref, weight_decay=0.0, lr=2e-2), **options)
    for step in range(6):
        _backward(ours, step, dtype)
        opt.step()
        _backward(ref, step, dtype)
        ref_opt.step()
        for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=f"{case}: {name} after step {step}")
    assert [g["step"] for g in opt.param_groups] == [6, 6]  # apex's layout: the step count lives in the group
    assert set(opt.state[ours.fc1.weight]) == {"exp_avg", "exp_avg_sq"}


def test_fused_lamb_moves_differently_from_adam() -> None:
    """The trust ratio acts: one LAMB step is not AdamW's step (else the test above proves little)."""
    lamb_model, adam_model = _model(), _model()
    lamb = FusedLAMB(lamb_model.parameters(), lr=1e-2, weight_decay=0.01, max_grad_norm=None)
    adam = FusedAdam(adam_model.parameters(), lr=1e-2, weight_decay=0.01, eps=1e-6)
    for m, o in ((lamb_model, lamb), (adam_model, adam)):
        _backward(m, 0, torch.float64)
        o.step()
    assert not torch.allclose(lamb_model.fc1.weight, adam_model.fc1.weight)


def test_fused_lamb_argument_errors_and_alias() -> None:
    params = list(_model().parameters())
    assert FusedLamb is FusedLAMB  # SMP v1's spelling
    with pytest.raises(OptimizerArgumentError, match="amsgrad"):
        FusedLAMB(params, amsgrad=True)
    with pytest.raises(OptimizerArgumentError, match="lr=-1"):
        FusedLAMB(params, lr=-1)
    opt = FusedLAMB(params)
    opt.step()  # no gradients yet: nothing moves, nothing raises
    assert "step" not in opt.param_groups[0]


def test_optimizers_are_on_smp_torch() -> None:
    import smp.torch as smp

    assert smp.optimizers.FusedAdam is FusedAdam and smp.optimizers.FusedLAMB is FusedLAMB


# --- FusedLAMB across model-parallel ranks ------------------------------------------------------------

LAMB_PARALLEL = {"lr": 5e-2, "weight_decay": 0.01, "max_grad_norm": 0.05}  # the gradient clip is active


def _lamb_pp2() -> dict[str, torch.Tensor]:
    import smp.torch as smp

    smp.init({"pipeline_parallel_degree": 2, "auto_partition": False, "default_partition": 0, "microbatches": 2,
              "comm_timeout": 60.0})
    net = _model(torch.float32)
    model = smp.DistributedModel(net)
    smp.set_partition(net.fc2, 1)
    opt = smp.DistributedOptimizer(FusedLAMB(_groups(net, weight_decay=0.0, lr=2e-2), **LAMB_PARALLEL))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = ((model(x) - y) ** 2).mean()
        model.backward(loss)
        return loss

    for step in range(4):
        opt.zero_grad()
        train_step(model, *_batch(step, torch.float32))
        opt.step()
    return {n: p.detach().clone() for n, p in model.local_named_parameters()}


def test_fused_lamb_on_two_pipeline_ranks_matches_one_process() -> None:
    from tests.helpers.spawn import run_ranks

    ranks = run_ranks(_lamb_pp2, 2, timeout=120)
    ref = _model(torch.float32)
    opt = FusedLAMB(_groups(ref, weight_decay=0.0, lr=2e-2), **LAMB_PARALLEL)
    for step in range(4):
        _backward(ref, step, torch.float32)  # the full batch's gradient = the average of its 2 microbatches'
        opt.step()
    expected = dict(ref.named_parameters())
    assert sorted(ranks[0]) == ["fc1.bias", "fc1.weight"] and sorted(ranks[1]) == ["fc2.bias", "fc2.weight"]
    for rank, params in enumerate(ranks):
        for name, value in params.items():  # the clip uses the whole model's gradient norm, not the stage's
            torch.testing.assert_close(value, expected[name].detach(), rtol=1e-5, atol=1e-6,
                                       msg=f"{name} on rank {rank}")


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (4, 10), generator=torch.Generator().manual_seed(7))


def _lamb_tp2() -> dict[str, torch.Tensor]:
    import smp.torch as smp

    from tests.torch.tp.test_tp_hf import _model as hf_model

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": True, "comm_timeout": 60.0})
    model = smp.DistributedModel(smp.transform(hf_model("llama")))
    opt = smp.DistributedOptimizer(FusedLAMB(model.parameters(), lr=1e-2, weight_decay=0.01, max_grad_norm=0.5))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    for _ in range(3):
        opt.zero_grad()
        train_step(model, _ids())
        opt.step()
    params = set(dict(model.module.named_parameters()))
    return {k: v for k, v in model.state_dict(gather_to_rank0=False).items() if k in params}


def test_fused_lamb_on_two_tensor_parallel_ranks_matches_one_process() -> None:
    pytest.importorskip("transformers")
    from tests.helpers.spawn import run_ranks
    from tests.torch.tp.test_tp_hf import _model as hf_model

    ranks = run_ranks(_lamb_tp2, 2, timeout=180)
    ref = hf_model("llama")
    opt = FusedLAMB(ref.parameters(), lr=1e-2, weight_decay=0.01, max_grad_norm=0.5)
    for _ in range(3):
        opt.zero_grad()
        ref(input_ids=_ids(), labels=_ids()).loss.backward()
        opt.step()
    # Sharded tensors' trust ratios use the full tensors' norms, the clip the whole model's gradient norm.
    for rank, state in enumerate(ranks):
        assert set(state) == {n for n, _ in ref.named_parameters()}, rank
        for name, value in ref.named_parameters():
            torch.testing.assert_close(state[name], value.detach(), rtol=1e-4, atol=1e-5, msg=f"{name} on rank {rank}")
