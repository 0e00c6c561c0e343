"""apex's optimizers under SMP v1's names: ``smp.torch.optimizers.FusedAdam`` and ``FusedLAMB``.

Same constructor arguments as ``apex.optimizers``. `FusedAdam` is torch's Adam (AdamW with
``adam_w_mode``) on torch's fused kernel where every parameter of a group allows it (floating
point, a device with fused kernels) and on its foreach path otherwise; apex's
``bias_correction=False`` (torch's Adam has no switch for it) runs smp's own foreach update.
`FusedLAMB` is LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning") as apex
computes it, written with torch's foreach ops. See each class for the update.

Both are plain ``torch.optim.Optimizer`` objects: wrap them in ``smp.DistributedOptimizer`` like
any other.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.optim.optimizer import ParamsT
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

import smp.state as smp_state
from smp.topology import GroupKind

from .errors import OptimizerArgumentError
from .nn.params import is_tp_sharded

__all__ = ["FusedAdam", "FusedLAMB", "FusedLamb", "OptimizerArgumentError"]


def _check_common(name: str, lr: Any, betas: Any, eps: float, weight_decay: float) -> None:
    problems = []
    if not isinstance(lr, torch.Tensor) and not lr >= 0.0:
        problems.append(f"lr={lr!r} must be >= 0")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
        problems.append(f"betas={betas!r} must be two numbers in [0, 1), e.g. (0.9, 0.999)")
    if not eps >= 0.0:
        problems.append(f"eps={eps!r} must be >= 0")
    if not weight_decay >= 0.0:
        problems.append(f"weight_decay={weight_decay!r} must be >= 0")
    if problems:
        raise OptimizerArgumentError(f"{name}: " + "; ".join(problems))


def _buckets(*lists: list[torch.Tensor]) -> Iterable[tuple[list[torch.Tensor], ...]]:
    """The aligned ``lists`` split by (device, dtype) of the first: one foreach call per bucket."""
    index: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, t in enumerate(lists[0]):
        index[(t.device, t.dtype)].append(i)
    for members in index.values():
        yield tuple([lst[i] for i in members] for lst in lists)


def _grads(group: dict[str, Any], name: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    params, grads = [], []
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise OptimizerArgumentError(f"{name} does not support sparse gradients (use torch.optim.SparseAdam "
                                         f"for sparse embeddings)")
        params.append(p)
        grads.append(p.grad)
    return params, grads


def _unhooked(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` without torch's hook wrapper: the subclass's own wrapper already ran the step hooks."""
    return getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step


def _fused_allowed(params: Iterable[torch.Tensor]) -> bool:
    devices = set(_get_fused_kernels_supported_devices())
    return all(p.is_floating_point() and p.device.type in devices for p in params)


class _GradNone(torch.optim.Optimizer):
    """apex's ``set_grad_none``: what ``zero_grad()`` does unless told otherwise."""

    set_grad_none: bool

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear the gradients: to None unless ``set_grad_none=False`` (or ``set_to_none=False``)."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)


def _closure_loss(closure: Callable[[], float] | None) -> float | None:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class FusedAdam(_GradNone, torch.optim.Adam):
    """apex's ``FusedAdam`` on torch's Adam: Adam, or AdamW with ``adam_w_mode`` (the default).

    Args:
        params: parameters or parameter groups.
        lr, betas, eps, weight_decay: as in apex (defaults 1e-3, (0.9, 0.999), 1e-8, 0).
        bias_correction: divide the moments by ``1 - beta**step`` (apex's default True). False runs
            smp's foreach update (torch's Adam always corrects).
        adam_w_mode: decoupled weight decay (AdamW, apex's default True); False adds
            ``weight_decay * param`` to the gradient (L2, ``torch.optim.Adam``).
        amsgrad: the AMSGrad variant (apex refuses it; torch has it, so it runs).
        set_grad_none: ``zero_grad()`` sets the gradients to None (apex's default True).
        capturable: torch's CUDA-graph-capturable step.
        master_weights: apex's fp32 copies inside the optimizer; smp keeps fp32 master weights in
            ``smp.DistributedOptimizer`` under ``fp16``/``bf16`` instead, so True is refused.
        fused, foreach: torch's kernel choice; None (default) picks the fused kernel for a group
            whose parameters all allow it at its first step, else torch's default.

    Example:
        >>> from smp.torch.optimizers import FusedAdam
        >>> opt = smp.DistributedOptimizer(FusedAdam(model.parameters(), lr=1e-4, weight_decay=0.01))
    """

    def __init__(self, params: ParamsT, lr: float | torch.Tensor = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True,
                 capturable: bool = False, master_weights: bool = False, *, fused: bool | None = None,
                 foreach: bool | None = None) -> None:
        _check_common("FusedAdam", lr, betas, eps, weight_decay)
        if master_weights:
            raise OptimizerArgumentError(
                "FusedAdam(master_weights=True): smp keeps fp32 master weights in smp.DistributedOptimizer "
                "(config fp16: True or bf16: True), not inside the optimizer. Fix: drop master_weights")
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,  # type: ignore[arg-type]
                         amsgrad=amsgrad, foreach=foreach, capturable=capturable, fused=fused,
                         decoupled_weight_decay=adam_w_mode)
        # Whether smp picks the kernel at a group's first step (the user chose none); in the
        # defaults, so groups added later get both keys too.
        self.defaults.update(bias_correction=bias_correction, _smp_pick_kernel=fused is None and foreach is None)
        for group in self.param_groups:
            for key in ("bias_correction", "_smp_pick_kernel"):
                group.setdefault(key, self.defaults[key])
        self.set_grad_none = set_grad_none

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = _closure_loss(closure)
        corrected, uncorrected = [], []
        for group in self.param_groups:
            (corrected if group["bias_correction"] else uncorrected).append(group)
            if group.get("_smp_pick_kernel"):
                params = [p for p in group["params"] if p.grad is not None]
                if params and not any(self.state.get(p) for p in group["params"]):
                    group["fused"] = _fused_allowed(group["params"]) and not group["differentiable"]
                    group["_smp_pick_kernel"] = False
        for group in uncorrected:
            self._step_uncorrected(group)
        if corrected:
            everything = self.param_groups
            self.param_groups = corrected  # torch's Adam steps the groups it sees
            try:
                _unhooked(torch.optim.Adam.step)(self)
            finally:
                self.param_groups = everything
        return loss

    def _step_uncorrected(self, group: dict[str, Any]) -> None:
        """apex's Adam with ``bias_correction=False``: the raw moments, ``m / (sqrt(v) + eps)``."""
        params, grads = _grads(group, "FusedAdam")
        if not params:
            return
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        amsgrad, decoupled = group["amsgrad"], group["decoupled_weight_decay"]
        ms, vs, vmaxes = [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if amsgrad:
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            ms.append(state["exp_avg"])
            vs.append(state["exp_avg_sq"])
            vmaxes.append(state["max_exp_avg_sq"] if amsgrad else state["exp_avg_sq"])
        for ps, gs, m, v, vmax in _buckets(params, grads, ms, vs, vmaxes):
            if wd and not decoupled:
                gs = torch._foreach_add(gs, ps, alpha=wd)
            torch._foreach_lerp_(m, gs, 1 - beta1)
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, gs, gs, value=1 - beta2)
            if amsgrad:
                torch._foreach_maximum_(vmax, v)
            denom = torch._foreach_sqrt(vmax if amsgrad else v)
            torch._foreach_add_(denom, eps)
            if wd and decoupled:
                torch._foreach_mul_(ps, 1 - lr * wd)
            torch._foreach_addcdiv_(ps, m, denom, value=-lr)


class FusedLAMB(_GradNone):
    """apex's ``FusedLAMB``: Adam's direction, scaled per tensor by the trust ratio ``|p| / |u|``.

    One step, for the gradients ``g`` of every group together and then per tensor ``p``::

        clip  = max(1, |all g|_2 / max_grad_norm)          (max_grad_norm None or <= 0: clip = 1)
        g     = g / clip  (+ weight_decay * p when not adam_w_mode: L2)
        m     = beta1 * m + (1 - beta1 if grad_averaging else 1) * g
        v     = beta2 * v + (1 - beta2) * g * g
        u     = (m / c1) / (sqrt(v / c2) + eps)  (+ weight_decay * p in adam_w_mode)
                c1, c2 = 1 - beta1**step, 1 - beta2**step   (1, 1 without bias_correction)
        trust = |p| / |u| where both are > 0, else 1;  only where weight_decay != 0 or use_nvlamb
        p     = p - lr * trust * u

    With pipeline or tensor parallelism the norms are the whole model's, completed over the
    ranks that hold its other parts (see the note at the end of this module), so the run matches
    one process whatever the layout; every rank of a replica must call ``step()``, as SMP v1
    scripts do. ``step`` counts per group (``group["step"]``)
    and the moments live in ``state[p]["exp_avg"]``/``["exp_avg_sq"]``, in apex's layout, so apex
    checkpoints load.

    Example:
        >>> from smp.torch.optimizers import FusedLAMB
        >>> opt = smp.DistributedOptimizer(FusedLAMB(model.parameters(), lr=6e-3, weight_decay=0.01))
    """

    def __init__(self, params: ParamsT, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 amsgrad: bool = False, adam_w_mode: bool = True, grad_averaging: bool = True,
                 set_grad_none: bool = True, max_grad_norm: float | None = 1.0, use_nvlamb: bool = False) -> None:
        _check_common("FusedLAMB", lr, betas, eps, weight_decay)
        if amsgrad:
            raise OptimizerArgumentError("FusedLAMB(amsgrad=True): LAMB has no AMSGrad variant (apex refuses it "
                                         "too). Fix: drop amsgrad, or use FusedAdam(amsgrad=True)")
        defaults = {"lr": lr, "bias_correction": bias_correction, "betas": tuple(betas), "eps": eps,
                    "weight_decay": weight_decay, "grad_averaging": grad_averaging, "max_grad_norm": max_grad_norm}
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none
        self.use_nvlamb = use_nvlamb

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = _closure_loss(closure)
        par = _model_parallel()
        work = [(group, *_grads(group, "FusedLAMB")) for group in self.param_groups]
        pairs = [(p, g) for _, params, grads in work for p, g in zip(params, grads, strict=True)]
        if not pairs and par is None:
            return loss
        # Every rank of a model-parallel group reaches the norm's allreduce, with gradients or not.
        grad_norm = _grad_norm(pairs, par)
        for group, params, grads in work:
            if params:
                self._step_group(group, params, grads, grad_norm, par)
        return loss

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
                    grad_norm: torch.Tensor, par: _Parallel | None) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        trust = wd != 0 or self.use_nvlamb
        group["step"] = step = group.get("step", 0) + 1
        c1, c2 = (1 - beta1 ** step, 1 - beta2 ** step) if group["bias_correction"] else (1.0, 1.0)
        beta3 = 1 - beta1 if group["grad_averaging"] else 1.0
        max_norm = group["max_grad_norm"]
        ms, vs = [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            ms.append(state["exp_avg"])
            vs.append(state["exp_avg_sq"])
        order: list[torch.Tensor] = []  # params and their updates, bucket by bucket
        updates: list[torch.Tensor] = []
        for ps, gs, m, v in _buckets(params, grads, ms, vs):
            if max_norm is not None and max_norm > 0:
                clip = torch.clamp(grad_norm / max_norm, min=1.0).to(device=ps[0].device, dtype=ps[0].dtype)
                gs = torch._foreach_div(gs, clip)
            if wd and not self.adam_w_mode:
                gs = torch._foreach_add(gs, ps, alpha=wd)
            torch._foreach_mul_(m, beta1)
            torch._foreach_add_(m, gs, alpha=beta3)
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, gs, gs, value=1 - beta2)
            denom = torch._foreach_div(v, c2)
            torch._foreach_sqrt_(denom)
            torch._foreach_add_(denom, eps)
            update = torch._foreach_div(m, c1)
            torch._foreach_div_(update, denom)
            if wd and self.adam_w_mode:
                torch._foreach_add_(update, ps, alpha=wd)
            order.extend(ps)
            updates.extend(update)
        if trust:  # ``order`` is bucket by bucket already: the norms come in its order
            p_norms = [n for ps, _ in _buckets(order, updates) for n in torch._foreach_norm(ps)]
            u_norms = [n for _, us in _buckets(order, updates) for n in torch._foreach_norm(us)]
            if par is not None:
                p_norms, u_norms = _tp_norms(order, p_norms, u_norms, par)
            for u, pn, un in zip(updates, p_norms, u_norms, strict=True):
                u.mul_(torch.where((pn > 0) & (un > 0), pn / un, torch.ones_like(pn)))
        for ps, us in _buckets(order, updates):
            torch._foreach_add_(ps, us, alpha=-lr)


FusedLamb = FusedLAMB  # SMP v1's reference spells it so (smp.optimizers.FusedLamb)


def _norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all ``tensors`` together: float64 if any is float64, else float32 (no fp16 overflow)."""
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    device = tensors[0].device
    parts = [n.to(device=device, dtype=dtype).reshape(1)
             for (ts,) in _buckets(tensors) for n in torch._foreach_norm(ts, 2, dtype)]
    return torch.linalg.vector_norm(torch.cat(parts))


# --- norms across model-parallel ranks --------------------------------------------------------------
# With pipeline or tensor parallelism one rank holds part of the model, so LAMB's norms are
# completed over the ranks that hold the rest: the gradient norm over the MP group (pipeline
# stages hold disjoint parameters; a TP shard counts on every TP rank, a replicated parameter once,
# on tp_rank 0), a TP shard's parameter and update norms over its TP group. The result is the
# one-process optimizer's, whatever the layout (apex's LAMB under SMP v1 used each rank's own).


class _Parallel(NamedTuple):
    mp_group: Any
    mp_ranks: list[int]
    tp_group: Any
    tp_ranks: list[int]
    tp_rank: int


def _model_parallel() -> _Parallel | None:
    """This rank's MP and TP groups when smp runs the model on more than one rank per replica."""
    st = smp_state.current()
    rank_map = st.rank_map
    if st.cfg is None or st.framework != "torch" or rank_map is None:
        return None
    sharded = bool(st.cfg.shard_optimizer_state) and rank_map.rdp_size > 1
    if rank_map.pp_size * rank_map.tp_size == 1 and not sharded:
        return None
    from .runtime.init import runtime

    rt = runtime()
    # With sharded optimizer state each replica steps part of its stage's parameters (each one
    # once over the RDP group), so the gradient norm is completed over the world instead.
    norm_kind = GroupKind.WORLD if sharded else GroupKind.MP
    return _Parallel(rt.groups[norm_kind], list(rt.group_ranks[norm_kind]), rt.groups[GroupKind.TP],
                     list(rt.group_ranks[GroupKind.TP]), rank_map.coord(st.rank).tp_rank)


def _sum(values: torch.Tensor, group: Any, ranks: list[int], what: str) -> torch.Tensor:
    """``values`` (float64, on the CPU: gloo carries it next to NCCL too) summed over ``group``."""
    from .runtime.failure import wait

    out = values.detach().to(device="cpu", dtype=torch.float64)
    if len(ranks) > 1:
        wait(dist.all_reduce(out, group=group, async_op=True), what, ranks)
    return out


def _grad_norm(pairs: list[tuple[torch.Tensor, torch.Tensor]], par: _Parallel | None) -> torch.Tensor:
    grads = [g for _, g in pairs]
    if par is None:
        return _norm(grads)
    counted = [g for p, g in pairs if is_tp_sharded(p) or par.tp_rank == 0]
    local = _norm(counted).double().cpu() ** 2 if counted else torch.zeros((), dtype=torch.float64)
    total = _sum(local.reshape(1), par.mp_group, par.mp_ranks, "FusedLAMB: gradient norm over the MP group")
    device = grads[0].device if grads else torch.device("cpu")
    return total.sqrt().reshape(()).to(device)


def _tp_norms(params: list[torch.Tensor], p_norms: list[torch.Tensor], u_norms: list[torch.Tensor],
              par: _Parallel) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The full tensors' norms for TP shards (the others are whole on every rank already).

    The TP peers hold the same parameters (shards of the same tensors), so they agree on whether
    there is anything to exchange.
    """
    shards = [i for i, p in enumerate(params) if is_tp_sharded(p)]
    if len(par.tp_ranks) < 2 or not shards:
        return p_norms, u_norms
    squares = torch.stack([x.double().cpu() ** 2 for i in shards for x in (p_norms[i], u_norms[i])])
    summed = _sum(squares, par.tp_group, par.tp_ranks, "FusedLAMB: TP shard norms").sqrt()
    p_norms, u_norms = list(p_norms), list(u_norms)
    for k, i in enumerate(shards):
        p_norms[i] = summed[2 * k].to(device=p_norms[i].device, dtype=p_norms[i].dtype)
        u_norms[i] = summed[2 * k + 1].to(device=u_norms[i].device, dtype=u_norms[i].dtype)
    return p_norms, u_norms

