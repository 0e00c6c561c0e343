"""`smp.DistributedModel`: partitions a module across the pipeline and runs it through the engine.

At wrap time nothing moves. On the first step (pp > 1) the partition is decided
(`smp.torch.partitioning.decide`), then every rank keeps only its modules' parameters, module
calls are dispatched to their owners (`dispatch`), parameters and buffers are broadcast from DP
rank 0 (`data_parallel`), the post-partition hooks run and deferred ``load_state_dict`` calls
apply (`state_dict`). What ``@smp.step`` and checkpoints use of the model is declared in
`interface`.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

import smp.state as smp_state
from smp.errors import NotInitializedError, SMPError
from smp.partition import PartitionReport, format_bytes
from smp.runtime.memory import give_back_freed
from smp.topology import GroupKind

from ..engine.engine import Engine, current_task
from ..errors import (
    BwdExecutionNotInStepFnError,
    FwdExecutionNotInStepFnError,
    ModelNotPartitionedError,
    MultipleDistributedModelError,
)
from ..nn.batch import scale_arguments, unscale_outputs
from ..partitioning.decide import check_saved_partition, decide_partition
from ..runtime.init import runtime
from . import data_parallel, memory, precision
from . import state_dict as states
from .dispatch import Dispatch
from .interface import RecordedStep
from .join import UnevenInputs, check_can_join, finish_join
from .v1_path import install_v1_ddp_path

logger = logging.getLogger("smp")


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
        # Modules marked with smp.tensor_parallelism() / set_tensor_parallelism() become their
        # distributed counterparts here, before partitioning (SMP v1 order). At tp=1 only a marked
        # GPT-2 / BERT / RoBERTa does (SMP v1's distributed transformer at any degree, which its
        # scripts read: transformer.seq_layers); other marked modules stay as they are.
        from ..tp import apply_tensor_parallelism
        from ..tp.marking import is_marked
        from ..tp.registry import HF_SMP_V1_CLASSES

        if st.cfg.tensor_parallel_degree > 1:
            module = apply_tensor_parallelism(module)
        elif any(type(m).__name__ in HF_SMP_V1_CLASSES and is_marked(m) for m in module.modules()):
            module = apply_tensor_parallelism(module, only=HF_SMP_V1_CLASSES)
        half = precision.half_dtype(st.cfg)  # fp16/bf16: 16-bit weights (SMP v1's FP16_Module); masters: optimizer
        module = precision.cast_module(module, half)
        super().__init__()
        self._half = half
        self.module = module
        self.trace_device = trace_device
        self.trace_execution_times = trace_execution_times
        self.overlapping_allreduce = overlapping_allreduce
        self.backward_passes_per_step = backward_passes_per_step
        self.average_grads_across_microbatches = average_grads_across_microbatches
        self.bucket_cap_mb = bucket_cap_mb
        self.broadcast_buffers = broadcast_buffers
        self.cfg = st.cfg
        self._pp_rank = st.rank_map.coord(st.rank).pp_rank if st.rank_map else 0
        self._owner: dict[str, int] = {}
        self._report: PartitionReport | None = None  # the partition's report, with each rank's memory estimate
        self._partitioned = False
        self._dispatch: Dispatch | None = None
        self._post_partition_hooks: list[Callable[..., Any]] = []
        self._post_step_hooks: list[Callable[..., Any]] = []
        self._pending_loads: list[tuple[dict[str, Any], bool]] = []
        self._in_step = False
        self._tracing = False
        self._traced_backward: list[tuple[Any, Any]] = []  # model.backward calls made while tracing
        self._steps = 0
        self._average: data_parallel.MicrobatchAverage | None = None  # set when partitioned
        self._join: UnevenInputs | None = None  # inside `with model.join():`
        self._local_param_ids: set[int] = set()
        self._partition_hooks_ran = False
        self.plans: dict[Any, RecordedStep] = {}
        self.last_timeline: list[Any] = []
        st.model = self
        from ..checkpointing.saving import take_pending

        self._saved_partition: dict[str, int] | None = None
        saved_partition = take_pending("partition")  # resume_from_checkpoint ran before the model existed
        if saved_partition is not None:
            self.use_saved_partition(saved_partition)
        saved_model = take_pending("model")
        if saved_model is not None:
            self._pending_loads.append(saved_model)
        if self.cfg.pipeline_parallel_degree == 1:
            self._apply_partition({p: 0 for p, _ in module.named_modules()}, None)
        if self.cfg.ddp:
            install_v1_ddp_path(module)

    # --- properties and accessors -----------------------------------------------------------------

    @property
    def partitioned(self) -> bool:
        return self._partitioned

    @property
    def partition_assignment(self) -> dict[str, int]:
        """Module path -> pp_rank (empty before the first step partitions the model)."""
        return dict(self._owner)

    @property
    def pp_rank(self) -> int:
        return self._pp_rank

    @property
    def engine(self) -> Engine | None:
        return self._dispatch.engine if self._dispatch is not None else None

    @property
    def in_step(self) -> bool:
        return self._in_step

    @property
    def tracing(self) -> bool:
        """True while rank 0 traces the model for automatic partitioning."""
        return self._tracing

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

    def is_local_parameter(self, param: str | torch.Tensor) -> bool:
        """Whether ``param`` (a parameter, or its name) lives on this pp_rank (SMP v1).

        Names are those of ``local_named_parameters()`` (``"fc.weight"``) or of
        ``model.named_parameters()`` (``"module.fc.weight"``, SMP v1's spelling under ddp too).
        Raises ``ModelNotPartitionedError`` before the first step (pp > 1), and an error naming the
        argument when it is no parameter of this model.
        """
        self._require_partition()
        return self._is_local_member(param, "parameter", dict(self.module.named_parameters(remove_duplicate=False)),
                                     lambda t: id(t) in self._local_param_ids)

    def is_local_buffer(self, buffer: str | torch.Tensor) -> bool:
        """Whether ``buffer`` (a buffer, or its name) lives on this pp_rank (SMP v1); names as in `is_local_parameter`."""
        self._require_partition()
        local = {id(b) for b in self.local_buffers()}
        return self._is_local_member(buffer, "buffer", dict(self.module.named_buffers(remove_duplicate=False)),
                                     lambda t: id(t) in local)

    def _is_local_member(self, item: str | torch.Tensor, kind: str, named: dict[str, torch.Tensor],
                         is_local: Callable[[torch.Tensor], bool]) -> bool:
        if isinstance(item, str):
            name = item
            for prefix in ("module.module.", "module."):  # model.named_parameters(); SMP v1's DDP path
                if name not in named and name.startswith(prefix) and name[len(prefix):] in named:
                    name = name[len(prefix):]
            if name not in named:
                close = difflib.get_close_matches(name, list(named), n=3)
                raise SMPError(f"is_local_{kind}({item!r}): no {kind} of this model has that name"
                               + (f" (similar: {close})" if close else "")
                               + f". Fix: use a name from model.local_named_{kind}s() or the {kind} itself")
            return is_local(named[name])
        if isinstance(item, torch.Tensor):
            if not any(t is item for t in named.values()):
                raise SMPError(f"is_local_{kind}: the tensor (shape {tuple(item.shape)}) is no {kind} of this model"
                               f" (after tensor parallelism, take the {kind}s from the model again). Fix: pass "
                               f"one of model.{kind}s()")
            return is_local(item)
        raise TypeError(f"is_local_{kind} takes a {kind} or its name (str), got {type(item).__name__}")

    # --- hooks --------------------------------------------------------------------------------------

    def register_post_partition_hook(self, hook: Callable[..., Any]) -> _Handle:
        """``hook(model, optimizer)`` runs once after partitioning, in the first step before its first
        forward (at pipeline_parallel_degree 1 too, where the model is partitioned when created)."""
        self._post_partition_hooks.append(hook)
        return _Handle(self._post_partition_hooks, hook)

    def register_post_step_hook(self, hook: Callable[..., Any]) -> _Handle:
        """``hook(model, optimizer)`` runs once, after the first step."""
        self._post_step_hooks.append(hook)
        return _Handle(self._post_step_hooks, hook)

    # --- forward / backward -------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.cfg.pipeline_parallel_degree > 1 and not self._in_step and not self._tracing:
            raise FwdExecutionNotInStepFnError(
                "with pipeline_parallel_degree > 1 the model runs only inside an @smp.step function: move "
                "model(...) into the step (evaluation too: a second @smp.step without model.backward)")
        if self.cfg.tensor_parallel_degree > 1 and not self.cfg.prescaled_batch:
            # Each TP rank brought its own batch: the model runs on the TP group's combined batch
            # and every rank gets its own samples' outputs back (reference 2.5; smp.torch.nn.batch).
            args, kwargs = precision.cast_inputs(args, kwargs, self._half)
            args, kwargs, batch = scale_arguments(args, kwargs)
            return precision.cast_outputs(unscale_outputs(self.module(*args, **kwargs), batch), self._half)
        args, kwargs = precision.cast_inputs(args, kwargs, self._half)
        return precision.cast_outputs(self.module(*args, **kwargs), self._half)

    def backward(self, tensors: Any, grad_tensors: Any = None) -> None:
        """Backward of the model's outputs inside an ``@smp.step`` function (replaces loss.backward())."""
        if not self._in_step:
            raise BwdExecutionNotInStepFnError("model.backward(loss) must run inside an @smp.step function")
        if self._tracing:
            self._traced_backward.append((tensors, grad_tensors))  # the trace times it per module
            return
        from ..optimizer import scaled_for_backward

        tensors, grad_tensors = scaled_for_backward(tensors, grad_tensors)  # fp16: loss x loss scale
        engine = self.engine
        if engine is not None and current_task() is not None:
            engine.backward(tensors, grad_tensors)
        else:
            torch.autograd.backward(tensors, grad_tensors)

    # --- the step (interface.StepModel) -----------------------------------------------------------

    @contextmanager
    def step_scope(self, first_microbatch: Callable[[], Any]) -> Iterator[None]:
        self._in_step = True
        try:
            if not self._partitioned:
                self._partition_now(first_microbatch)
            if not self._partition_hooks_ran:
                # At pp == 1 the model is partitioned when it is created, but SMP v1 partitions in the
                # first step, and scripts register their loading hooks after creating the model.
                self._partition_hooks_ran = True
                for hook in list(self._post_partition_hooks):
                    hook(self, smp_state.current().optimizer)
            if self._steps == 1:  # the optimizer state exists: what this rank holds against the estimate
                memory.log_memory(self.memory_check(), self._pp_rank)
            if self._average is not None:
                self._average.begin()
            if self._join is not None:
                self._join.begin_step()
            if self.cfg.ddp and self.broadcast_buffers:
                self._broadcast_buffers()
            yield
        finally:
            self._in_step = False

    def after_step(self) -> None:
        if self._average is not None:
            self._average.end()
        self._steps += 1
        if self.cfg.ddp and self._steps % self.backward_passes_per_step == 0:
            self._sync_gradients(training=True)
        if self._steps == 1 or self._post_step_hooks:
            hooks, self._post_step_hooks = list(self._post_step_hooks), []
            for hook in hooks:
                hook(self, smp_state.current().optimizer)

    def _broadcast_buffers(self) -> None:
        if self._join is not None:
            self._join.broadcast_buffers(self.local_buffers())
        else:
            data_parallel.broadcast_from_dp0(self.local_buffers())

    def _sync_gradients(self, training: bool) -> None:
        if self._join is not None:
            self._join.sync_gradients(self.local_parameters(), self.bucket_cap_mb, training)
        else:
            data_parallel.sync_gradients(self.local_parameters(), self.bucket_cap_mb)

    # --- uneven inputs across replicas (join.py) --------------------------------------------------

    @contextmanager
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Iterator[None]:
        """Let DP replicas run different numbers of steps inside the block (SMP v1; DDP's ``join``).

        A replica that runs out of batches waits at the block's end, taking part in the others'
        gradient and buffer syncs with zeros, until every replica is done; then all take the model
        of one that trained longest. Gradients are divided by the initial DP size (the finished
        replicas count as zeros) unless ``divide_by_initial_world_size=False``, which divides by the
        number still training. ``throw_on_early_termination`` raises on every rank instead, at the
        first step where one replica has run out. Needs ``ddp: True``. The ranks of one pipeline
        or TP group must run the same number of steps (the step is a collective among them); the
        optimizer step of a finished replica is skipped, so its optimizer state stays behind.

        Example:
            >>> with model.join():
            ...     for x, y in loader:          # a different number of batches per replica
            ...         train_step(model, x, y)
            ...         optimizer.step()
        """
        check_can_join(self.cfg, enable, self._join)
        if not enable:
            yield
            return
        self._join = UnevenInputs(divide_by_initial_world_size, throw_on_early_termination)
        try:
            yield
            finish_join(self, self._join)
        finally:
            self._join = None

    def _shadow_step(self) -> None:
        """This rank's part in one step of the replicas still training, after its own last batch."""
        if self.broadcast_buffers:
            self._broadcast_buffers()
        self._steps += 1
        if self._steps % self.backward_passes_per_step == 0:
            self._sync_gradients(training=False)

    # --- partitioning -------------------------------------------------------------------------------

    def load_saved_partition(self, partition_info: dict[str, int]) -> None:
        """Use a saved partition decision (module path -> pp_rank) instead of computing one (SMP v1).

        ``partition_info`` is what ``model.partition_assignment`` returned in the run that saved it
        (``save_checkpoint`` stores it and ``resume_from_checkpoint`` reloads it by itself). Call it
        before the first step: automatic partitioning and later ``smp.set_partition`` calls are then
        ignored, as in SMP v1.

        Example:
            >>> model.load_saved_partition(torch.load("partition.pt"))   # saved: model.partition_assignment
        """
        if not isinstance(partition_info, dict):
            raise TypeError(f"load_saved_partition takes a dict of module path -> pp_rank (what "
                            f"model.partition_assignment returns), got {type(partition_info).__name__}")
        pp = self.cfg.pipeline_parallel_degree
        bad = {k: v for k, v in partition_info.items()
               if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < pp}
        if bad:
            shown = dict(list(bad.items())[:5])
            raise SMPError(f"load_saved_partition: {len(bad)} entr{'y' if len(bad) == 1 else 'ies'} not a module "
                           f"path mapped to a pp_rank in [0, {pp}) (pipeline_parallel_degree={pp}): {shown}. Fix: "
                           f"pass model.partition_assignment of a run with the same pipeline_parallel_degree")
        if self._partitioned and pp > 1 and dict(partition_info) != self._owner:
            raise SMPError("load_saved_partition after the first step: the model is already partitioned (another "
                           "way). Fix: call load_saved_partition before the first smp.step call")
        if smp_state.current().rank == 0 and not self._partitioned:
            logger.info("load_saved_partition: using the saved partition; automatic partitioning and "
                        "smp.set_partition calls are ignored")
        self._saved_partition = check_saved_partition(self.module, partition_info, "load_saved_partition")

    def use_saved_partition(self, assignment: dict[str, int]) -> None:
        """Take the partition a checkpoint was saved with (applied at the first step)."""
        if self._partitioned:
            if self.cfg.pipeline_parallel_degree > 1 and dict(assignment) != self._owner:
                raise SMPError("resume_from_checkpoint: the checkpoint was saved with another partition than the "
                               "one this model already has. Fix: call resume_from_checkpoint before the first "
                               "step, so the saved partition is used")
            return
        self._saved_partition = check_saved_partition(self.module, assignment)

    def _take_traced_backward(self) -> list[tuple[Any, Any]]:
        taken, self._traced_backward = self._traced_backward, []
        return taken

    @contextmanager
    def _tracing_scope(self) -> Iterator[None]:
        self._tracing = True
        try:
            yield
        finally:
            self._tracing = False

    def _partition_now(self, first_microbatch: Callable[[], Any]) -> None:
        if self._saved_partition is not None:
            if smp_state.current().rank == 0:
                logger.info("partition loaded from the checkpoint (not traced or recomputed)")
            self._apply_partition(self._saved_partition, None)
            return
        assignment, report = decide_partition(self.module, self.cfg, first_microbatch, self._tracing_scope,
                                              self._take_traced_backward)
        self._apply_partition(assignment, report)

    def _apply_partition(self, assignment: dict[str, int], report: PartitionReport | None) -> None:
        st = smp_state.current()
        self._owner = dict(assignment)
        self._report = report
        local_ids: set[int] = set()
        for path, m in self.module.named_modules():
            if self._is_local(path):
                local_ids.update(id(p) for p in m.parameters(recurse=False))
        self._local_param_ids = local_ids
        from .delayed import pending_materialization

        delayed = pending_materialization(self.module)  # before other ranks' storage is freed
        cfg = self.cfg
        if cfg.pipeline_parallel_degree > 1:
            for m in self.module.modules():
                for p in m.parameters(recurse=False):
                    if id(p) not in local_ids:
                        # Another rank owns it: free the storage, keep the Parameter object.
                        p.requires_grad_(False)
                        p.grad = None
                        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            rt = runtime()
            self._dispatch = Dispatch(self.module, self._owner, self._pp_rank)
            self._dispatch.start(rt.engine_group, rt.group_ranks[GroupKind.PP], st.rank, float(cfg.comm_timeout),
                                 strict_order=cfg.tensor_parallel_degree > 1)
            self._dispatch.engine.keep_remote = bool(cfg.fast_mode)  # type: ignore[union-attr]
        if delayed is not None:  # allocate and initialise this rank's delayed parameters only
            delayed.materialize(self._param_is_local, cfg)
        if cfg.pipeline_parallel_degree > 1:
            # The other ranks' parameters (and the traced microbatch) were just freed: give the pages
            # back, or smp's heap settings (runtime/heap.py) keep the whole model mapped here
            # (smp.runtime.memory).
            freed = give_back_freed()
            if st.rank == 0 and freed:
                logger.info("partitioned: rank 0 gave %s of freed memory back to the system", format_bytes(freed))
        self._partitioned = True
        self._average = data_parallel.MicrobatchAverage(self.local_parameters(), cfg.microbatches,
                                                        lambda: self.average_grads_across_microbatches)
        if cfg.ddp:
            data_parallel.broadcast_from_dp0([*self.local_parameters(), *self.local_buffers()])
        for model_sd, strict in self._pending_loads:
            states.load(self, model_sd, strict)
        self._pending_loads.clear()

    # --- memory -------------------------------------------------------------------------------------

    @property
    def partition_report(self) -> PartitionReport | None:
        """The partition's report (modules and memory estimate per rank); None if not decided here."""
        return self._report

    def memory_check(self) -> dict[str, dict[str, float]]:
        """This rank's memory: what it holds (bytes of its parameters, their gradients and the optimizer's
        state, counted from the tensors' storage) beside the partition report's estimate of them.

        Not a collective. Without a report (a partition loaded from a checkpoint), ``estimate`` is empty.
        Example: ``model.memory_check()["held"]`` -> ``{'weights': 6.7e7, 'gradients': 6.7e7, 'optimizer': 1.3e8}``.
        """
        self._require_partition()
        return memory.memory_check(self.module, smp_state.current().optimizer, self._report, self._pp_rank)

    # --- state dicts (state_dict.py) -------------------------------------------------------------

    def local_state_dict(self, cast_to_cpu: bool = True) -> dict[str, Any]:
        """This rank's entries of the state dict (a partial checkpoint), marked ``_smp_is_partial``."""
        self._require_partition()
        out: dict[str, Any] = {}
        for name, t in states.local_state_tensors(self).items():
            out[name] = t.detach().cpu() if cast_to_cpu else t.detach()
        out["_smp_is_partial"] = True
        # SMP v1's record of the layout: a partial load before the first step takes this partition
        # (scripts that load in a post-partition hook delete partition_info first).
        out[states.LOAD_INFO] = {"tensor_parallel_degree": self.cfg.tensor_parallel_degree,
                          "pipeline_parallel_degree": self.cfg.pipeline_parallel_degree,
                          "partition_info": dict(self.partition_assignment)}
        return out

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False,  # type: ignore[override]
                   cast_to_cpu: bool = True, gather_to_rank0: bool = True) -> dict[str, Any]:
        """The full state dict, gathered from every pipeline rank of this replica (TP shards as full
        tensors, loadable by the unsharded model).

        Call it on every rank with ``dp_rank() == 0`` (``rdp_rank() == 0`` with TP), as in SMP v1.
        With ``gather_to_rank0`` (the default) only global rank 0 gets the entries when
        pipeline_parallel_degree > 1; the others return ``{}``.
        """
        return states.state_dict(self, prefix, keep_vars, cast_to_cpu, gather_to_rank0)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True,  # type: ignore[override]
                        same_partition_load: bool = False, **_: Any) -> Any:
        """Load a full or partial state dict; before partitioning the load waits until after it.

        A partial state dict (``local_state_dict()``) carries the partition it was saved with
        (``_smp_load_info["partition_info"]``). Loaded before the first step, the model takes that
        partition, as in SMP v1; loaded after partitioning another way, the pipeline's partial dicts
        are joined (a collective over the PP group: every rank loads its own) and each rank takes
        what it owns now. ``same_partition_load`` is accepted (smp loads by name either way).
        """
        state_dict = dict(state_dict)
        saved = states.saved_partition(state_dict.pop(states.LOAD_INFO, None), state_dict)
        if not self._partitioned:
            if saved is not None:
                self.use_saved_partition(saved)
            self._pending_loads.append((dict(state_dict), strict))
        else:
            if saved is not None and self.cfg.pipeline_parallel_degree > 1 and saved != self._owner:
                state_dict = states.join_partial(self, state_dict)
            states.load(self, state_dict, strict)
        return None

    def step_timeline(self, title: str = "measured step") -> Any:
        """The last step's measured timeline over this pipeline (a collective over the PP group).

        Returns an ``smp.pipeline.Timeline`` in milliseconds (one lane per pp_rank) that
        ``smp.pipeline.render_svg`` / ``render_chrome_trace`` draw like a planned one. Clocks are the
        hosts' wall clocks: on several hosts, lanes are only as aligned as the clocks are.
        """
        from smp.pipeline import Timeline

        from ..runtime.comm import PP_GROUP, allgather

        mine = [(self._pp_rank, e.kind, e.microbatch, 0, e.start, e.end) for e in self.last_timeline if e.end]
        events = [e for part in allgather(mine, PP_GROUP) for e in part]
        origin = min((e[4] for e in events), default=0.0)
        records = [(r, k, mb, seg, (s - origin) * 1e3, (t - origin) * 1e3) for r, k, mb, seg, s, t in events]
        return Timeline.from_records(records, num_ranks=self.cfg.pipeline_parallel_degree, unit="ms",
                                     title=title)

    def save_pretrained(self, path: str, **kwargs: Any) -> None:
        """Write the wrapped Hugging Face model to ``path`` in Hugging Face format (a collective: every rank).

        Pipeline stages and TP shards of the first replica are gathered; global rank 0 writes
        ``config.json`` and safetensors that ``transformers`` loads without smp.
        """
        states.save_pretrained(self, path, **kwargs)

    def cpu(self) -> DistributedModel:  # type: ignore[override]
        """Gather every pipeline stage's parameters and buffers into this process's module, on the CPU.

        A collective over the pipeline group. Under tensor parallelism the TP layers keep this
        rank's shards (they compute with them); `state_dict` gives the full tensors.
        """
        states.gather_to_cpu(self)
        self.module.cpu()
        return self
