"""fp32 master weights: this rank's parameters as the optimizer steps them, and the global gradient norm.

Under ``fp16: True`` / ``bf16: True`` the model holds 16-bit weights; `smp.DistributedOptimizer`
steps an fp32 copy of each of this rank's parameters (SMP v1's ``FP16_Optimizer``, as in apex and
Megatron) and copies the result back into the model. `global_grad_norm` is the norm that
``optimizer.clip_master_grads`` clips to: over every rank's gradients, each counted once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .nn.params import is_tp_sharded
from .runtime.failure import wait

__all__ = ["MasterWeights", "global_grad_norm"]


class MasterWeights:
    """This rank's parameters as the optimizer steps them: an fp32 master copy of each 16-bit one.

    `build` (after partitioning: only this rank's parameters exist) puts the masters into the
    optimizer's ``param_groups`` in place of the model's parameters, keeping the group dicts (an LR
    scheduler made earlier keeps working). Other parameters (fp32 ones, those of other pipeline
    ranks) stay as they are. With ``dtype`` None (fp32 training) nothing is copied: each parameter is
    its own "master".

    If the model's weights change behind the optimizer's back (``model.load_state_dict`` after the
    first step, an in-place edit), the next step takes them into the masters (`refresh_changed`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, dtype: torch.dtype | None) -> None:
        self.optimizer = optimizer
        self.dtype = dtype
        self.pairs: list[tuple[torch.nn.Parameter, torch.Tensor]] = []  # (model parameter, stepped tensor)
        self.built = False
        self._seen: dict[int, tuple[int, int]] = {}  # id(model param) -> (version, data_ptr) when in sync

    def build(self, local: set[int]) -> None:
        """Pair every local parameter of the optimizer with the tensor it steps (creating the masters)."""
        pairs = []
        for group in self.optimizer.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                if id(p) not in local:
                    continue
                if self.dtype is not None and p.dtype == self.dtype:
                    master = torch.nn.Parameter(p.detach().to(torch.float32, copy=True), requires_grad=p.requires_grad)
                    if p in self.optimizer.state:  # state made before the masters existed: now the master's
                        self.optimizer.state[master] = {
                            k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() else v
                            for k, v in self.optimizer.state.pop(p).items()}
                    params[i] = master
                    pairs.append((p, master))
                else:
                    pairs.append((p, p))
        self.pairs = pairs
        self.built = True
        self._mark_in_sync(p for p, _ in pairs)

    @property
    def masters(self) -> dict[int, torch.Tensor]:
        """id(model parameter) -> its fp32 master (16-bit parameters only)."""
        return {id(p): m for p, m in self.pairs if m is not p}

    def _mark_in_sync(self, params: Iterable[torch.Tensor]) -> None:
        for p in params:
            self._seen[id(p)] = (p._version, p.data_ptr())

    def refresh_changed(self) -> int:
        """Copy into its master every model weight changed since the masters last wrote it; returns how many."""
        changed = 0
        with torch.no_grad():
            for p, m in self.pairs:
                if m is p or self._seen.get(id(p)) == (p._version, p.data_ptr()):
                    continue
                if not torch.equal(p, m.to(p.dtype)):
                    m.copy_(p)
                    changed += 1
                self._mark_in_sync([p])
        return changed

    def grads_in(self, scale: float) -> bool:
        """Master grads = model grads / ``scale``; returns whether this rank found an inf/NaN in them."""
        grads: list[torch.Tensor] = []
        for p, m in self.pairs:
            if p.grad is None:
                if m is not p:
                    m.grad = None
                continue
            if m is not p:
                if m.grad is None or m.grad.shape != p.grad.shape:
                    m.grad = p.grad.detach().to(torch.float32, copy=True)
                else:
                    m.grad.copy_(p.grad)
            grads.append(m.grad)  # type: ignore[arg-type]
        found = False
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        for device, group in by_device.items():
            flag = torch.zeros(1, device=device)
            # torch's fused check-and-unscale (what torch.amp.GradScaler runs): grads *= 1/scale in place.
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, torch.full((1,), 1.0 / scale, device=device))
            found = found or bool(flag.item() > 0)
        return found

    def grads_signature(self) -> tuple[tuple[int, int] | None, ...]:
        """Which 16-bit gradients the model holds now (identity and version): changes with every backward,
        ``zero_grad`` and in-place edit, so master grads taken from older ones are known to be stale."""
        return tuple((id(p.grad), p.grad._version) if p.grad is not None else None
                     for p, m in self.pairs if m is not p)

    def weights_out(self) -> None:
        """Copy the masters into the model's 16-bit weights (after a step)."""
        with torch.no_grad():
            for p, m in self.pairs:
                if m is not p:
                    p.copy_(m)
        self._mark_in_sync(p for p, m in self.pairs if m is not p)

    def zero_model_grads(self, set_to_none: bool) -> None:
        for p, m in self.pairs:
            if m is not p and p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def load_masters(self, saved: dict[str, torch.Tensor], names: dict[int, str]) -> None:
        """Load saved fp32 masters (by parameter name) into this rank's masters; others are ignored."""
        with torch.no_grad():
            for p, m in self.pairs:
                value = saved.get(names.get(id(p), ""))
                if m is not p and value is not None:
                    m.copy_(value)
        self._mark_in_sync(p for p, m in self.pairs if m is not p)


def global_grad_norm(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], norm_type: float,
                     sharded: bool = False) -> float:
    """The norm of the stepped tensors' gradients over every rank, each gradient counted once.

    Pipeline ranks hold different parameters (summed); TP shards are different parts of one tensor
    (summed); a parameter replicated over the TP group counts on tp_rank 0 only; data-parallel
    replicas hold the same gradients (the world sum is divided by their number, ``rdp_size``) --
    unless ``sharded`` (``shard_optimizer_state``): then each replica steps different parameters,
    each counted once already. A collective over the world; with one process it is torch's
    ``clip_grad_norm_`` norm.
    """
    from .amp import agreement_group
    from .runtime.comm import rdp_size, tp_rank

    initialized = dist.is_initialized() and dist.get_world_size() > 1
    # Inside model.join() the norm is this replica's (over its MP group; the replicas hold the same
    # gradients): a replica out of batches is waiting in the join's collectives.
    group = agreement_group() if initialized and not sharded else None
    kwargs: dict[str, Any] = {"group": group[0]} if group is not None else {}
    ranks: Any = group[1] if group is not None else "world"
    first_tp = not initialized or tp_rank() == 0
    grads = [m.grad for p, m in pairs if m.grad is not None and (first_tp or is_tp_sharded(p))]
    if math.isinf(norm_type):
        local = max((float(g.detach().abs().max()) for g in grads if g.numel()), default=0.0)
        total = torch.tensor([local], dtype=torch.float64)
        if initialized:
            wait(dist.all_reduce(total, op=dist.ReduceOp.MAX, async_op=True, **kwargs), "clip_master_grads norm", ranks)
        return float(total.item())
    local_sum = sum((torch.linalg.vector_norm(g.detach(), norm_type).double().cpu() ** norm_type for g in grads),
                    torch.zeros((), dtype=torch.float64))
    total = local_sum.reshape(1)
    if initialized:
        wait(dist.all_reduce(total, async_op=True, **kwargs), "clip_master_grads norm", ranks)
        if not sharded and group is None:
            total /= rdp_size()
    return float(total.item()) ** (1.0 / norm_type)
