"""Loss scaling, with the inf/NaN check agreed by every rank: ``smp.amp.GradScaler`` and the loss scalers of
``smp.DistributedOptimizer`` under ``fp16: True``.

Each pipeline rank only sees its own parameters' gradients (and each TP rank its own shards), so one
rank may find an overflow the others do not. `any_rank` takes the maximum of the ranks' "found
inf" flags over the world, so every rank skips ``optimizer.step()`` together and keeps the same scale
(SMP v1 semantics of ``smp.amp.GradScaler``; the same rule for ``fp16: True``).

Two ways to scale, as in SMP v1:

- ``torch.autocast`` with fp32 weights and ``smp.amp.GradScaler`` (torch's scaler, agreed check);
- ``fp16: True``: half-precision weights, fp32 master weights in the optimizer, and a `LossScaler`
  (static) or `DynamicLossScaler` built from ``smp.DistributedOptimizer``'s ``static_loss_scale`` /
  ``dynamic_loss_scale`` / ``dynamic_loss_args`` (`make_loss_scaler`). ``model.backward(loss)``
  multiplies the loss by the scale.

Example:
    >>> scaler = smp.amp.GradScaler()
    >>> # inside the step: model.backward(scaler.scale(loss))
    >>> scaler.step(optimizer); scaler.update()
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from smp.errors import ConfigProblem, SMPInvalidArgumentError, flag_arguments

from .runtime.failure import wait

__all__ = ["DYNAMIC_LOSS_DEFAULTS", "DynamicLossScaler", "GradScaler", "LossScaler", "agreement_group", "any_rank",
           "make_loss_scaler"]


def agreement_group() -> tuple[Any, Any] | None:
    """(process group, its ranks) the optimizer's checks agree over: the world, or None for the default group.

    Inside a ``model.join()`` block it is this replica's MP group instead: a replica that has run
    out of batches waits in the join's DP-group collectives, not in these, and after the DP average
    the replicas still training hold the same gradients, so their MP groups reach the same answer.
    """
    import smp.state as smp_state

    model = smp_state.current().model
    if model is None or getattr(model, "_join", None) is None:
        return None
    from smp.topology import GroupKind

    from .runtime.init import runtime

    rt = runtime()
    return rt.groups[GroupKind.MP], rt.group_ranks[GroupKind.MP]


def any_rank(local: torch.Tensor | float, what: str) -> bool:
    """Whether ``local`` > 0 on any rank of the world (found an inf/NaN, say): a collective over the world
    (over the MP group inside ``model.join()``: `agreement_group`).

    Every rank must call it at the same point (each ``optimizer.step()``); with one process it returns
    ``local > 0``. ``what`` names the wait in a timeout error.
    """
    flag = torch.tensor([float(local)]) if not isinstance(local, torch.Tensor) else \
        local.detach().float().reshape(1).cpu().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        group = agreement_group()
        if group is None:
            wait(dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), what, "world")
        elif len(group[1]) > 1:
            wait(dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group[0], async_op=True), what, group[1])
    return bool(flag.item() > 0)


class GradScaler(torch.amp.GradScaler):
    """A drop-in for ``torch.cuda.amp.GradScaler`` (CPU when CUDA is absent)."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, device: str | None = None) -> None:
        super().__init__("cuda" if device is None and torch.cuda.is_available() else (device or "cpu"),
                         init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval, enabled=enabled)

    def _ensure_scale(self) -> None:
        # The step body (and so ``scaler.scale(loss)``) runs only on pp_rank 0; the other pipeline
        # ranks still unscale and step, with the same initial scale and the same updates.
        if self.is_enabled() and self._scale is None:
            self._lazy_init_scale_growth_tracker(torch.device(self._device))

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if getattr(optimizer, "master_weights", None) is not None:
            raise SMPInvalidArgumentError([ConfigProblem(
                "smp.amp.GradScaler", type(optimizer).__name__,
                "with fp16 or bf16 in the config, smp.DistributedOptimizer scales the loss itself (model.backward "
                "multiplies it by optimizer.loss_scaler.loss_scale) and keeps fp32 master weights",
                "drop the GradScaler (pass static_loss_scale / dynamic_loss_scale to smp.DistributedOptimizer), "
                "or turn fp16/bf16 off and use torch.autocast with smp.amp.GradScaler")])
        self._ensure_scale()
        super().unscale_(optimizer)
        self._unscale_foreign(optimizer)
        if not (self.is_enabled() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        flags = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        local = torch.zeros(1)
        for flag in flags.values():
            local += flag.detach().float().cpu()
        found = any_rank(local, "GradScaler inf check")
        for flag in flags.values():
            flag.fill_(float(found))

    def _unscale_foreign(self, optimizer: torch.optim.Optimizer) -> None:
        """With ``shard_optimizer_state`` the optimizer lists only the parameters this rank steps; the
        others' gradients are unscaled too, so ``clip_grad_norm_(model.parameters())`` after
        ``unscale_`` sees every gradient unscaled, as without sharding (their inf/NaN is their owner's
        to find; the ranks agree on it below)."""
        shard_of = getattr(optimizer, "state_shard", None)
        shard = shard_of() if callable(shard_of) else None
        if shard is None or not self.is_enabled() or self._scale is None:
            return
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for p in shard.params:
            if not shard.owns(p) and p.grad is not None:
                by_device.setdefault(p.grad.device, []).append(p.grad)
        inv_scale = self._scale.double().reciprocal().float()
        for device, grads in by_device.items():  # torch's own unscale, as for the optimizer's parameters
            torch._amp_foreach_non_finite_check_and_unscale_(grads, torch.zeros(1, device=device),
                                                             inv_scale.to(device))

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> float | None:
        self._ensure_scale()
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        self._ensure_scale()
        super().update(new_scale)


class LossScaler:
    """A static loss scale (SMP v1 ``static_loss_scale``): the loss is multiplied by ``loss_scale`` before
    backward and the gradients divided by it before the step; an overflow skips the step, the scale stays.

    Example:
        >>> s = LossScaler(128.0)
        >>> s.update_scale(overflow=True); s.loss_scale
        128.0
    """

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        self.cur_scale = float(scale)
        self.cur_iter = 0

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update_scale(self, overflow: bool) -> None:
        """Called once per ``optimizer.step()``, with whether this step's gradients overflowed on any rank."""
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key, value in state.items():
            if key in vars(self):
                setattr(self, key, value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(loss_scale={self.cur_scale})"


# SMP v1's dynamic loss scaling arguments and their defaults (reference section 3.6).
DYNAMIC_LOSS_DEFAULTS: dict[str, Any] = {"init_scale": 2.0**32, "scale_factor": 2.0, "scale_window": 1000,
                                         "min_scale": 1.0, "delayed_shift": 1, "consecutive_hysteresis": False}


class DynamicLossScaler(LossScaler):
    """SMP v1's dynamic loss scale: divide by ``scale_factor`` on an overflow, multiply after
    ``scale_window`` clean steps.

    ``delayed_shift`` = k tolerates k - 1 overflows before lowering the scale (hysteresis); the
    tolerance is restored after ``scale_window`` clean steps, or after every clean step with
    ``consecutive_hysteresis``. The scale never goes below ``min_scale``.

    Worked example (``init_scale=8, scale_window=2, delayed_shift=1``; O = overflow, . = clean)::

        step      0   1   2   3   4   5
        overflow  O   .   .   O   .   .
        scale     8   4   4   8   4   4   (scale used by the step; 8 after step 5)

    Example:
        >>> s = DynamicLossScaler(init_scale=8.0, scale_window=2)
        >>> for overflow in (True, False, False, True, False, False):
        ...     s.update_scale(overflow)
        >>> s.loss_scale
        8.0
    """

    dynamic = True

    def __init__(self, init_scale: float = 2.0**32, scale_factor: float = 2.0, scale_window: int = 1000,
                 min_scale: float = 1.0, delayed_shift: int = 1, consecutive_hysteresis: bool = False) -> None:
        super().__init__(init_scale)
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(delayed_shift)
        self.cur_hysteresis = int(delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.last_overflow_iter = -1

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


def _number(value: Any) -> bool:
    return type(value) in (int, float)


# name -> (accepts the value, the rule in words)
_DYNAMIC_RULES: dict[str, tuple[Any, str]] = {
    "init_scale": (lambda v: _number(v) and v > 0, "a number > 0"),
    "scale_factor": (lambda v: _number(v) and v > 1, "a number > 1"),
    "scale_window": (lambda v: type(v) is int and v >= 1, "an int >= 1"),
    "min_scale": (lambda v: _number(v) and v > 0, "a number > 0"),
    "delayed_shift": (lambda v: type(v) is int and v >= 1, "an int >= 1"),
    "consecutive_hysteresis": (lambda v: type(v) is bool, "a bool"),
}


def make_loss_scaler(static_loss_scale: float | None, dynamic_loss_scale: bool,
                     dynamic_loss_args: Mapping[str, Any] | None) -> LossScaler:
    """The loss scaler of ``smp.DistributedOptimizer(opt, static_loss_scale, dynamic_loss_scale, ...)``.

    Every bad argument is reported at once, with the rule and the fix.

    Example:
        >>> make_loss_scaler(None, True, {"scale_window": 500}).scale_window
        500
        >>> make_loss_scaler(1024.0, False, None).loss_scale
        1024.0
    """
    problems: list[ConfigProblem] = []
    where = "smp.DistributedOptimizer"
    try:  # SMP v1 scripts pass argparse ints (dynamic_loss_scale=args.dynamic_loss_scale)
        dynamic_loss_scale = flag_arguments(where, dynamic_loss_scale=dynamic_loss_scale)["dynamic_loss_scale"]
    except SMPInvalidArgumentError as e:
        problems.extend(e.problems)
    args = dict(dynamic_loss_args or {})
    for name, value in args.items():
        if name not in _DYNAMIC_RULES:
            problems.append(ConfigProblem(f"{where} dynamic_loss_args[{name!r}]", value, "unknown argument",
                                          f"use only {sorted(_DYNAMIC_RULES)}"))
            continue
        ok, rule = _DYNAMIC_RULES[name]
        if not ok(value):
            problems.append(ConfigProblem(f"{where} dynamic_loss_args[{name!r}]", value, f"must be {rule}",
                                          f"pass {rule} (SMP v1 default: {DYNAMIC_LOSS_DEFAULTS[name]!r})"))
    if dynamic_loss_scale is not True:
        if args:
            problems.append(ConfigProblem(f"{where} dynamic_loss_args", args,
                                          "dynamic loss scaling arguments need dynamic_loss_scale=True",
                                          "pass dynamic_loss_scale=True, or drop the arguments"))
        if static_loss_scale is None or not (_number(static_loss_scale) and static_loss_scale > 0):
            problems.append(ConfigProblem(f"{where}(static_loss_scale=...)", static_loss_scale,
                                          "without dynamic_loss_scale the static loss scale must be a number > 0",
                                          "pass static_loss_scale=1.0 (no scaling) or a power of two such as "
                                          "1024.0, or dynamic_loss_scale=True"))
    if problems:
        raise SMPInvalidArgumentError(problems)
    if dynamic_loss_scale:
        return DynamicLossScaler(**args)
    return LossScaler(float(static_loss_scale))  # type: ignore[arg-type]
