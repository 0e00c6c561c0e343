"""`smp.DistributedModel`: partitions a module across the pipeline and runs it through the engine.

At wrap time nothing moves. On the first step (pp > 1) the partition is decided — manual
(`smp.partition`, `smp.set_partition`, ``default_partition``) or automatic (rank 0 traces one
microbatch, the core partitions the lowered tree, the decision is broadcast) — then every rank
keeps only its modules' parameters, parameters and buffers are broadcast from DP rank 0, the
post-partition hooks run and deferred ``load_state_dict`` calls apply.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import smp.state as smp_state
from smp.errors import NotInitializedError, SMPError
from smp.topology import GroupKind

from . import placement as partition_mod
from .engine.engine import Engine, current_task
from .engine.wire import Transport
from .failure import wait
from .nn.batch import scale_arguments, unscale_outputs
from .nn.params import gather_named, is_tp_sharded, shard_packed
from .runtime import runtime

logger = logging.getLogger("smp")


class FwdExecutionNotInStepFnError(SMPError, RuntimeError):
    """``model(...)`` outside an ``@smp.step`` function with pipeline_parallel_degree > 1."""


class BwdExecutionNotInStepFnError(SMPError, RuntimeError):
    """``model.backward`` outside an ``@smp.step`` function."""


class ModelNotPartitionedError(SMPError, RuntimeError):
    """A local_* method was called before the first step partitioned the model."""


class MultipleDistributedModelError(SMPError, RuntimeError):
    """A second DistributedModel in one process."""


class _Handle:
    """Removes a registered hook (like torch.utils.hooks.RemovableHandle)."""

    def __init__(self, hooks: list[Callable[..., Any]], hook: Callable[..., Any]) -> None:
        self._hooks, self._hook = hooks, hook

    def remove(self) -> None:
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)


class DistributedModel(nn.Module):
    """Wraps a model for pipeline, tensor and data parallelism (SMP v1 signature).

    Example:
        >>> model = smp.DistributedModel(Net())
        >>> optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    """

    def __init__(self, module: nn.Module, trace_device: str = "gpu", trace_execution_times: bool = False,
                 trace_memory_usage: bool = False, overlapping_allreduce: bool = True,
                 backward_passes_per_step: int = 1, average_grads_across_microbatches: bool = True,
                 bucket_cap_mb: int = 25, find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 gradient_as_bucket_view: bool = False) -> None:
        st = smp_state.current()
        if st.cfg is None:
            raise NotInitializedError("call smp.init(config) before smp.DistributedModel(...)")
        if st.model is not None:
            raise MultipleDistributedModelError("only one smp.DistributedModel per process (as in SMP v1)")
        if trace_device not in ("cpu", "gpu"):
            raise ValueError(f"trace_device={trace_device!r}: use 'cpu' or 'gpu'")
        if type(backward_passes_per_step) is not int or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r} must be an int >= 1")
        if not isinstance(module, nn.Module):
            raise TypeError(f"smp.DistributedModel wraps an nn.Module, got {type(module).__name__}")
        if st.cfg.tensor_parallel_degree > 1:
            # Modules marked with smp.tensor_parallelism() / set_tensor_parallelism() become their
            # distributed counterparts here, before partitioning (SMP v1 order).
            from .tp import apply_tensor_parallelism

            module = apply_tensor_parallelism(module)
        super().__init__()
        self.module = module
        self.trace_device = trace_device
        self.trace_execution_times = trace_execution_times
        self.overlapping_allreduce = overlapping_allreduce
        self.backward_passes_per_step = backward_passes_per_step
        self.average_grads_across_microbatches = average_grads_across_microbatches
        self.bucket_cap_mb = bucket_cap_mb
        self.broadcast_buffers = broadcast_buffers
        self._cfg = st.cfg
        self._pp_rank = st.rank_map.coord(st.rank).pp_rank if st.rank_map else 0
        self._owner: dict[str, int] = {}
        self._partition: Any = None
        self._partitioned = False
        self._engine: Engine | None = None
        self._orig_forward: dict[str, Callable[..., Any]] = {}
        self._post_partition_hooks: list[Callable[..., Any]] = []
        self._post_step_hooks: list[Callable[..., Any]] = []
        self._pending_loads: list[tuple[dict[str, Any], bool]] = []
        self._in_step = False
        self._tracing = False
        self._steps = 0
        self._plans: dict[Any, tuple[list[int], bool]] = {}
        self._plan_costs: dict[Any, Any] = {}
        self._local_param_ids: set[int] = set()
        self.last_timeline: list[Any] = []
        st.model = self
        from .saving import pending

        self._saved_partition: dict[str, int] | None = None
        if "partition" in pending:  # resume_from_checkpoint ran before the model existed
            self._use_saved_partition(pending.pop("partition"))
        if "model" in pending:
            sd, strict = pending.pop("model")
            self._pending_loads.append((sd, strict))
        if self._cfg.pipeline_parallel_degree == 1:
            self._apply_partition({p: 0 for p, _ in module.named_modules()}, None)

    # --- properties and accessors -----------------------------------------------------------------

    @property
    def partitioned(self) -> bool:
        return self._partitioned

    def get_module(self) -> nn.Module:
        return self.module

    def _require_partition(self) -> None:
        if not self._partitioned:
            raise ModelNotPartitionedError("the model is partitioned on the first smp.step call; call this after it")

    def _is_local(self, path: str) -> bool:
        return self._owner.get(path, 0) == self._pp_rank

    def local_named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        self._require_partition()
        for path, m in self.module.named_modules():
            if self._is_local(path):
                yield path, m

    def local_modules(self) -> Iterator[nn.Module]:
        for _, m in self.local_named_modules():
            yield m

    def local_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        self._require_partition()
        seen: set[int] = set()
        for path, m in self.module.named_modules():
            for name, p in m.named_parameters(recurse=False):
                if id(p) in seen or not self._param_is_local(p):
                    continue
                seen.add(id(p))
                yield (f"{path}.{name}" if path else name), p

    def local_parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.local_named_parameters():
            yield p

    def local_named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._require_partition()
        for path, m in self.module.named_modules():
            if self._is_local(path):
                for name, b in m.named_buffers(recurse=False):
                    yield (f"{path}.{name}" if path else name), b

    def local_buffers(self) -> Iterator[torch.Tensor]:
        for _, b in self.local_named_buffers():
            yield b

    def _param_is_local(self, p: nn.Parameter) -> bool:
        return id(p) in self._local_param_ids

    # --- hooks --------------------------------------------------------------------------------------

    def register_post_partition_hook(self, hook: Callable[..., Any]) -> _Handle:
        """``hook(model, optimizer)`` runs after partitioning, before the first forward."""
        self._post_partition_hooks.append(hook)
        return _Handle(self._post_partition_hooks, hook)

    def register_post_step_hook(self, hook: Callable[..., Any]) -> _Handle:
        """``hook(model, optimizer)`` runs once, after the first step."""
        self._post_step_hooks.append(hook)
        return _Handle(self._post_step_hooks, hook)

    # --- forward / backward -------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._cfg.pipeline_parallel_degree > 1 and not self._in_step and not self._tracing:
            raise FwdExecutionNotInStepFnError(
                "with pipeline_parallel_degree > 1 the model runs only inside an @smp.step function: move "
                "model(...) into the step (evaluation too: a second @smp.step without model.backward)")
        if self._cfg.tensor_parallel_degree > 1 and not self._cfg.prescaled_batch:
            # Each TP rank brought its own batch: the model runs on the TP group's combined batch
            # and every rank gets its own samples' outputs back (reference 2.5; smp.torch.nn.batch).
            args, kwargs, batch = scale_arguments(args, kwargs)
            return unscale_outputs(self.module(*args, **kwargs), batch)
        return self.module(*args, **kwargs)

    def backward(self, tensors: Any, grad_tensors: Any = None) -> None:
        """Backward of the model's outputs inside an ``@smp.step`` function (replaces loss.backward())."""
        if not self._in_step:
            raise BwdExecutionNotInStepFnError("model.backward(loss) must run inside an @smp.step function")
        if self._tracing:
            return
        if self._engine is not None and current_task() is not None:
            self._engine.backward(tensors, grad_tensors)
        else:
            torch.autograd.backward(tensors, grad_tensors)

    # --- partitioning -------------------------------------------------------------------------------

    def _use_saved_partition(self, assignment: dict[str, int]) -> None:
        """Take the partition a checkpoint was saved with (applied at the first step)."""
        if self._partitioned:
            if self._cfg.pipeline_parallel_degree > 1 and dict(assignment) != self._owner:
                raise SMPError("resume_from_checkpoint: the checkpoint was saved with another partition than the "
                               "one this model already has. Fix: call resume_from_checkpoint before the first "
                               "step, so the saved partition is used")
            return
        paths = {p for p, _ in self.module.named_modules()}
        if set(assignment) != paths:
            extra, missing = sorted(set(assignment) - paths), sorted(paths - set(assignment))
            raise SMPError(f"resume_from_checkpoint: the checkpoint's partition names other modules than this "
                           f"model has (only in the checkpoint: {extra[:5]}, only in the model: {missing[:5]}). "
                           f"Fix: build the same model as the one that was saved")
        self._saved_partition = dict(assignment)

    def _decide_partition(self, first_microbatch: Callable[[], Any]) -> None:
        cfg = self._cfg
        if self._saved_partition is not None:
            if smp_state.current().rank == 0:
                logger.info("partition loaded from the checkpoint (not traced or recomputed)")
            self._apply_partition(self._saved_partition, None)
            return
        if cfg.auto_partition:
            st = smp_state.current()
            decision = None
            if st.rank == 0:
                from .delayed import has_delayed_params

                tr = None
                delayed = has_delayed_params(self.module)
                if delayed:
                    logger.info("automatic partition: parameters are delayed (meta), so the model is not "
                                "traced; the partition follows parameter sizes and module counts")
                if not cfg.skip_tracing and not delayed:
                    self._tracing = True
                    try:
                        tr = partition_mod.trace(self.module, first_microbatch)
                    finally:
                        self._tracing = False
                tree = partition_mod.lower(self.module, tr)
                part = partition_mod.auto_partition(tree, cfg)
                decision = partition_mod.rehome_sequential_stateless(self.module, dict(part.assignment))
                logger.info("automatic partition:\n%s", part.report())
            from .comm import WORLD, allgather

            decision = allgather(decision, WORLD)[0]
            assert decision is not None
            self._apply_partition(decision, None)
        else:
            scopes = partition_mod.manual_scopes(self.module, cfg)
            tree = partition_mod.lower(self.module, None)
            part = scopes.resolve(tree)
            if smp_state.current().rank == 0:
                logger.info("manual partition:\n%s", part.report())
            self._apply_partition(dict(part.assignment), part)

    def _apply_partition(self, assignment: dict[str, int], part: Any) -> None:
        st = smp_state.current()
        self._owner = dict(assignment)
        self._partition = part
        modules = dict(self.module.named_modules())
        self._modules_by_path = modules
        self._groups_cache: dict[str, list[tuple[int, int, int]]] = {}
        local_ids: set[int] = set()
        for path, m in modules.items():
            if self._is_local(path):
                local_ids.update(id(p) for p in m.parameters(recurse=False))
        self._local_param_ids = local_ids
        from .delayed import pending_materialization

        delayed = pending_materialization(self.module)  # before other ranks' storage is freed
        if self._cfg.pipeline_parallel_degree > 1:
            for m in modules.values():
                for p in m.parameters(recurse=False):
                    if id(p) not in local_ids:
                        # Another rank owns it: free the storage, keep the Parameter object.
                        p.requires_grad_(False)
                        p.grad = None
                        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self._install_dispatch(modules)
            rt = runtime()
            pp_ranks = rt.group_ranks[GroupKind.PP]
            cfg = self._cfg
            self._engine = Engine(Transport(rt.engine_group, pp_ranks, st.rank), pp_ranks, self._pp_rank,
                                  self._run_local, float(cfg.comm_timeout))
            self._engine.strict_order = cfg.tensor_parallel_degree > 1
        if delayed is not None:  # allocate and initialise this rank's delayed parameters only
            delayed.materialize(self._param_is_local, self._cfg)
        self._partitioned = True
        self._install_microbatch_averaging()
        self._broadcast_from_dp0(params=True)
        for model_sd, strict in self._pending_loads:
            self._load_now(model_sd, strict)
        self._pending_loads.clear()
        for hook in list(self._post_partition_hooks):
            hook(self, st.optimizer)

    def _install_dispatch(self, modules: dict[str, nn.Module]) -> None:
        """Every module call checks where it runs; a module owned elsewhere becomes a request."""
        engine_ref = self

        for path, m in modules.items():
            orig = m.forward
            self._orig_forward[path] = orig
            owner = self._owner[path]
            is_seq = isinstance(m, nn.Sequential)

            def forward(*args: Any, _path: str = path, _orig: Callable[..., Any] = orig, _owner: int = owner,
                        _seq: bool = is_seq, _m: nn.Module = m, **kwargs: Any) -> Any:
                if current_task() is None:
                    return _orig(*args, **kwargs)
                if _owner != engine_ref._pp_rank:
                    assert engine_ref._engine is not None
                    return engine_ref._engine.remote_forward(_owner, _path, None, args, kwargs)
                if _seq and len(args) == 1 and not kwargs:
                    return engine_ref._run_sequential(_path, _m, args[0])
                return _orig(*args, **kwargs)

            m.forward = forward  # type: ignore[method-assign]

    def _sequence_groups(self, path: str, seq: nn.Module) -> list[tuple[int, int, int]]:
        """(owner, start, stop) runs of an nn.Sequential's children; fixed after partitioning, so cached."""
        cached = self._groups_cache.get(path)
        if cached is not None:
            return cached
        owners = [self._owner[f"{path}.{name}" if path else name] for name in seq._modules]
        groups: list[tuple[int, int, int]] = []
        for i, o in enumerate(owners):
            if groups and groups[-1][0] == o:
                groups[-1] = (o, groups[-1][1], i + 1)
            else:
                groups.append((o, i, i + 1))
        self._groups_cache[path] = groups
        return groups

    def _run_sequential(self, path: str, seq: nn.Module, x: Any) -> Any:
        """nn.Sequential with children on several ranks: one request per run of same-rank children."""
        children = list(seq._modules.values())
        for owner, start, stop in self._sequence_groups(path, seq):
            if owner == self._pp_rank:
                for child in children[start:stop]:
                    x = child(x)
            else:
                assert self._engine is not None
                x = self._engine.remote_forward(owner, path, (start, stop), (x,), {})
        return x

    def _run_local(self, path: str, span: tuple[int, int] | None, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
        module = self._modules_by_path[path]
        if span is not None:
            x = args[0]
            for child in list(module._modules.values())[span[0]:span[1]]:
                x = child(x)
            return x
        if isinstance(module, nn.Sequential) and len(args) == 1 and not kwargs:
            return self._run_sequential(path, module, args[0])
        return self._orig_forward[path](*args, **kwargs)

    # --- data parallel ------------------------------------------------------------------------------

    def _reduction_groups(self) -> tuple[tuple[Any, list[int]], tuple[Any, list[int]]]:
        """(DP group, RDP group): replicated tensors sync over DP, TP-sharded ones over RDP."""
        rt = runtime()
        return ((rt.groups[GroupKind.DP], rt.group_ranks[GroupKind.DP]),
                (rt.groups[GroupKind.RDP], rt.group_ranks[GroupKind.RDP]))

    def _broadcast_from_dp0(self, *, params: bool) -> None:
        """Make every DP replica start from DP rank 0's parameters and buffers (TP shards: RDP rank 0's)."""
        if not self._cfg.ddp:
            return

        (dp, dp_ranks), (rdp, rdp_ranks) = self._reduction_groups()
        tensors = [b for _, b in self.local_named_buffers()]
        if params:
            tensors = [p for p in self.local_parameters()] + tensors
        for t in tensors:
            pg, ranks = (rdp, rdp_ranks) if is_tp_sharded(t) else (dp, dp_ranks)
            if t.numel() and len(ranks) > 1:
                wait(dist.broadcast(t.data, ranks[0], group=pg, async_op=True), "broadcast from DP rank 0", ranks)

    def _install_microbatch_averaging(self) -> None:
        """Divide each microbatch's gradient by ``microbatches`` as autograd produces it.

        Dividing the accumulated ``.grad`` when the step ends would also divide what it held before
        the step: the earlier steps' gradients under ``backward_passes_per_step`` (or a script that
        accumulates over steps without ``zero_grad``). Parameters frozen at partition time get no
        hook (torch refuses hooks on them); one unfrozen later accumulates sums.
        """
        count = self._cfg.microbatches
        if count == 1:
            return

        def average(grad: torch.Tensor) -> torch.Tensor:
            return grad / count if self.average_grads_across_microbatches else grad

        for p in self.local_parameters():
            if p.requires_grad:
                p.register_hook(average)

    def _sync_gradients(self) -> None:
        """Average gradients over the DP group (every backward_passes_per_step); microbatches: above."""
        cfg = self._cfg
        if not cfg.ddp or self._steps % self.backward_passes_per_step:
            return

        (dp, dp_ranks), (rdp, rdp_ranks) = self._reduction_groups()
        params = [p for p in self.local_parameters() if p.grad is not None]
        # TP-sharded gradients average over the replicas of the same shard (RDP), the rest over DP.
        self._allreduce([p.grad for p in params if not is_tp_sharded(p)], dp, dp_ranks)
        self._allreduce([p.grad for p in params if is_tp_sharded(p)], rdp, rdp_ranks)

    def _allreduce(self, grads: list[torch.Tensor], pg: Any, ranks: list[int]) -> None:
        """Average ``grads`` over ``pg`` in flat buckets of ``bucket_cap_mb``."""
        if len(ranks) < 2 or not grads:
            return
        cap = max(1, self.bucket_cap_mb) * 1024 * 1024
        bucket: list[torch.Tensor] = []
        size = 0
        for g in grads + [None]:
            if g is not None:
                bucket.append(g)
                size += g.numel() * g.element_size()
            if bucket and (g is None or size >= cap):
                flat = torch.cat([b.reshape(-1) for b in bucket])
                wait(dist.all_reduce(flat, group=pg, async_op=True), "gradient allreduce over DP", ranks)
                flat.div_(len(ranks))
                offset = 0
                for b in bucket:
                    b.copy_(flat[offset:offset + b.numel()].view_as(b))
                    offset += b.numel()
                bucket, size = [], 0

    # --- state dicts ------------------------------------------------------------------------------

    def local_state_dict(self, cast_to_cpu: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, t in self._local_state_tensors().items():
            out[name] = t.detach().cpu() if cast_to_cpu else t.detach()
        out["_smp_is_partial"] = True
        return out

    def _local_state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's entries of the module's state dict, under every name (tied weights too)."""
        self._require_partition()
        ids = set(self._local_param_ids) | {id(b) for b in self.local_buffers()}
        return {k: v for k, v in self.module.state_dict(keep_vars=True).items() if id(v) in ids}

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False,  # type: ignore[override]
                   cast_to_cpu: bool = True, gather_to_rank0: bool = True) -> dict[str, Any]:
        """The full state dict, gathered from every pipeline rank of this replica (TP shards as full
        tensors, loadable by the unsharded model).

        Call it on every rank with ``dp_rank() == 0`` (``rdp_rank() == 0`` with TP), as in SMP v1.
        With ``gather_to_rank0`` (the default) only global rank 0 gets the entries when
        pipeline_parallel_degree > 1; the others return ``{}``.
        """
        tp_group = runtime().groups[GroupKind.TP] if self._cfg.tensor_parallel_degree > 1 else None
        if not self._partitioned or self._cfg.pipeline_parallel_degree == 1:
            # keep_vars=True even when the caller wants plain tensors: the TP marks (tp_split_dim)
            # live on the Parameter objects, and the detached copies of keep_vars=False lose them,
            # so the shards would be returned as if they were whole tensors.
            sd = self.module.state_dict(prefix=prefix, keep_vars=True)
            if tp_group is not None:
                sd = gather_named(sd, tp_group)
            elif not keep_vars:
                sd = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
            return {k: (v.detach().cpu() if cast_to_cpu and isinstance(v, torch.Tensor) else v)
                    for k, v in sd.items()}
        from .comm import PP_GROUP, allgather

        own = self._local_state_tensors()
        local = (gather_named(own, tp_group) if tp_group is not None
                 else {k: v.detach().cpu() for k, v in own.items()})
        # After the TP gather every TP rank holds its stage's full tensors, so one gather over the
        # pipeline (the ranks of this tp_rank) collects the whole model.
        parts = allgather(local, PP_GROUP)
        if gather_to_rank0 and smp_state.current().rank != 0:
            return {}
        full: dict[str, Any] = {}
        for part in parts:
            full.update({prefix + k: v for k, v in part.items()})
        order = [prefix + k for k in self.module.state_dict(keep_vars=True)]
        return {k: full[k] for k in order if k in full}

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, **_: Any) -> Any:  # type: ignore[override]
        """Load a full or partial state dict; before partitioning the load waits until after it."""
        if not self._partitioned:
            self._pending_loads.append((dict(state_dict), strict))
            return None
        return self._load_now(state_dict, strict)

    def _load_now(self, state_dict: dict[str, Any], strict: bool) -> Any:
        partial = bool(state_dict.get("_smp_is_partial", False))
        own = self._local_state_tensors()
        missing = [k for k in own if k not in state_dict]
        if strict and missing:
            raise KeyError(f"load_state_dict: missing keys for this rank's modules: {missing[:8]}")
        known = set(self.module.state_dict(keep_vars=True))
        unexpected = [k for k in state_dict if k != "_smp_is_partial" and k not in known]
        if strict and unexpected and not partial:
            raise KeyError(f"load_state_dict: unexpected keys: {unexpected[:8]}")
        with torch.no_grad():
            for k, t in own.items():
                if k in state_dict:
                    value = state_dict[k]
                    if is_tp_sharded(t) and tuple(value.shape) != tuple(t.shape):
                        # a full tensor (a full checkpoint, an unsharded model's state dict): this
                        # rank's shard of it
                        value = shard_packed(value, int(t.tp_split_dim), int(getattr(t, "tp_packed", 1)),
                                             runtime().groups[GroupKind.TP], k)
                    t.copy_(value)
        return None

    def step_timeline(self, title: str = "measured step") -> Any:
        """The last step's measured timeline over this pipeline (a collective over the PP group).

        Returns an ``smp.pipeline.Timeline`` in milliseconds (one lane per pp_rank) that
        ``smp.pipeline.render_svg`` / ``render_chrome_trace`` draw like a planned one. Clocks are the
        hosts' wall clocks: on several hosts, lanes are only as aligned as the clocks are.
        """
        from smp.pipeline import Timeline

        from .comm import PP_GROUP, allgather

        mine = [(self._pp_rank, e.kind, e.microbatch, 0, e.start, e.end) for e in self.last_timeline if e.end]
        events = [e for part in allgather(mine, PP_GROUP) for e in part]
        origin = min((e[4] for e in events), default=0.0)
        records = [(r, k, mb, seg, (s - origin) * 1e3, (t - origin) * 1e3) for r, k, mb, seg, s, t in events]
        return Timeline.from_records(records, num_ranks=self._cfg.pipeline_parallel_degree, unit="ms",
                                     title=title)

    def save_pretrained(self, path: str, **kwargs: Any) -> None:
        """Write the wrapped Hugging Face model to ``path`` in Hugging Face format (a collective: every rank).

        Pipeline stages and TP shards of the first replica are gathered; global rank 0 writes
        ``config.json`` and safetensors that ``transformers`` loads without smp (see
        `smp.torch.tp.save_distributed`).
        """
        from .tp.hf_checkpoint import save_distributed

        save_distributed(self, path, **kwargs)

    def cpu(self) -> DistributedModel:  # type: ignore[override]
        """Gather every pipeline stage's parameters and buffers into this process's module, on the CPU.

        A collective over the pipeline group. Under tensor parallelism the TP layers keep this
        rank's shards (they compute with them); `state_dict` gives the full tensors.
        """
        if self._partitioned and self._cfg.pipeline_parallel_degree > 1:
            from .comm import PP_GROUP, allgather

            # Over the pipeline of this tp_rank only: a TP rank must receive its own shards of the
            # other stages, not another TP rank's (the MP group mixes them under one name).
            full: dict[str, Any] = {}
            for part in allgather(self.local_state_dict(), PP_GROUP):
                full.update(part)
            local = set(self._local_state_tensors())
            with torch.no_grad():
                for name, t in self.module.state_dict(keep_vars=True).items():
                    if name in full and name not in local:
                        if isinstance(t, nn.Parameter) and t.numel() == 0:
                            t.data = full[name].clone()
                        elif t.shape == full[name].shape:
                            t.copy_(full[name])
        self.module.cpu()
        return self
