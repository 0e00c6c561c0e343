"""``@smp.step``: split the batch into microbatches, run them through the pipeline, gather the outputs.

The body runs once per microbatch on each pipeline's pp_rank 0; the other pipeline ranks serve its
module calls. Every rank of the pipeline returns the same values: tensors as `StepOutput`s, other
leaves as lists. When the step returns, gradients are averaged over microbatches and allreduced
over data-parallel replicas, so ``optimizer.step()`` can follow.

Example:
    >>> @smp.step
    ... def train_step(model, data, target):
    ...     output = model(data)
    ...     loss = F.nll_loss(output, target)
    ...     model.backward(loss)
    ...     return output, loss
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

import smp.state as smp_state
from smp.errors import NotInitializedError, SMPError
from smp.pipeline.baton import Baton
from smp.pipeline.choose import fastest_schedule, rank_plan, segment_costs
from smp.step import StepSpec, aggregate_outputs, split_arguments
from smp.structure import map_structure

from .errors import StepFunctionCalledError
from .model.interface import RecordedStep, StepModel
from .partitioning import record
from .step_output import StepOutput, TorchStepOps

__all__ = ["StepOutput", "step"]

logger = logging.getLogger("smp")
_OPS = TorchStepOps()


class StepFunction:
    """A function decorated with ``@smp.step``."""

    def __init__(self, func: Callable[..., Any], non_split_inputs: Any, input_split_axes: Any,
                 detach_outputs: bool) -> None:
        self.func = func
        self.spec = StepSpec.from_function(func, non_split_inputs, input_split_axes)
        self.detach_outputs = detach_outputs
        self.record_key: str | None = None  # of the records of this step's durations (partitioning/record.py)
        functools.update_wrapper(self, func)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        st = smp_state.current()
        if st.cfg is None:
            raise NotInitializedError("call smp.init(config) before an @smp.step function")
        model = st.model
        cfg = st.cfg
        if model is not None and model.in_step:
            raise StepFunctionCalledError("an @smp.step function cannot call another @smp.step function")
        parts = split_arguments(self.spec, args, kwargs, cfg.microbatches, _OPS)
        if model is None:
            results = [self.func(*a, **k) for a, k in parts]
            return aggregate_outputs(results, _OPS, StepOutput)
        a0, k0 = parts[0]
        # A partial: the records' key (partitioning/record.py) reads the step function and the input shapes.
        first = functools.partial(self.func, *a0, **k0)
        if id(self) not in model.plans and model.pp_rank == 0 and record.cache_dir() is not None:
            self.record_key = record.fingerprint(getattr(model, "module", model), cfg, first)
            first.record_key = self.record_key  # type: ignore[attr-defined] - the partition reads it (decide.py)
        with model.step_scope(first):
            results = self._run(model, cfg, parts)
        model.after_step()
        if self.detach_outputs:
            results = [map_structure(r, lambda x: x.detach() if isinstance(x, torch.Tensor) else x) for r in results]
        return aggregate_outputs(results, _OPS, StepOutput)

    def _run(self, model: StepModel, cfg: Any, parts: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> list[Any]:
        engine = model.engine
        if engine is None:  # pp == 1: microbatches run one after the other (gradient accumulation)
            return [self.func(*a, **k) for a, k in parts]
        key = id(self)
        recorded = model.plans.get(key)
        policy = "simple" if cfg.pipeline == "simple" else "interleaved"
        plan = expected = None
        lights: list[tuple[str, int]] = []
        if recorded is not None and recorded.static:
            if recorded.plan is None:
                try:
                    section = self._section(cfg, recorded)
                    recorded.schedule = section.schedule
                    recorded.plan = rank_plan(section, recorded.chain, recorded.backward,
                                              model.pp_rank, engine.light, recorded.costs,
                                              forward_active=cfg.active_microbatches,
                                              split_weights=cfg.tensor_parallel_degree == 1)
                except SMPError as e:
                    recorded.plan = e
                    logger.warning("no static plan for chain %s (%s); using SMP v1's dynamic order",
                                   recorded.chain, e)
            if not isinstance(recorded.plan, SMPError):
                plan, expected, lights = recorded.plan
        # The first (recording) step runs one microbatch at a time: its order cannot depend on
        # timing, so buffers such as BatchNorm statistics see the microbatches in order, and the
        # durations measured to pick light actions are undisturbed.
        # With TP and no static plan, TP peers must still run one order: one microbatch at a time.
        active = cfg.active_microbatches if recorded is not None and (recorded.static or engine.strict_order is False) \
            else 1
        # A plan that waits longer than a few recorded steps for an action lost track of a microbatch
        # (one that skipped a planned visit here); the dynamic rule takes over (Baton.stall_s).
        stall = None if plan is None else min(float(cfg.comm_timeout) / 2, max(2.0, 3 * recorded.seconds))
        baton = Baton(plan, policy, active, float(cfg.comm_timeout),
                      on_fallback=engine.notify_dynamic, expected=expected, light_plan=lights, stall_s=stall)
        leader = model.pp_rank == 0
        bodies = [functools.partial(self.func, *a, **k) for a, k in parts] if leader else None

        def payload(_results: list[Any]) -> Any:
            task = engine.tasks[0]
            return {"chain": task.chain or [0], "backward": task.backward_called, "trail": task.trail}

        started = time.perf_counter()
        results, info = engine.run_step(bodies, len(parts), baton, torch.is_grad_enabled(), payload)
        model.last_timeline = list(engine.events)
        if recorded is not None and recorded.static:  # the same on every pipeline rank (the leader's record)
            recorded.planned += 1
            if recorded.planned == _MEASURE_AGAIN:
                # Note [costs measured again]: the recording step ran one microbatch at a time; a
                # planned step runs them side by side, and its durations are what the plan meets.
                recorded.costs = segment_costs(recorded.chain, _durations(engine, cfg, self, "planned",
                                                                          recorded.chain)) or recorded.costs
                recorded.plan = None
        if recorded is None and info is not None:
            # The dynamic rules (interleaved, simple) become static plans by simulating them with
            # the costs measured on this first step (every pipeline rank shares its durations).
            per_rank = _durations(engine, cfg, self, "recording", list(info["chain"]))
            # Light actions would issue TP collectives from a second thread, in an order that
            # differs between peers: with TP every action takes the baton.
            engine.mark_light(per_rank[model.pp_rank] if cfg.tensor_parallel_degree == 1 else {})
            chain = list(info["chain"])
            # The scheduler's plans walk the chain backward in reverse; a step whose backward skips
            # some of its forward visits (calls under no_grad, detached outputs) keeps the dynamic order.
            static = not info["backward"] or list(info["trail"][len(chain):]) == chain[::-1]
            model.plans[key] = RecordedStep(chain, bool(info["backward"]), segment_costs(chain, per_rank), static,
                                             time.perf_counter() - started)
            if not static:
                logger.warning("step %s: its backward visits ranks %s, not the forward chain %s in reverse; "
                               "SMP v1's dynamic order is used for it", self.func.__name__,
                               "->".join(map(str, info["trail"][len(chain):])), "->".join(map(str, chain)))
            if smp_state.current().rank == 0:
                plan = f"the {cfg.pipeline!r} plan" if "pipeline" in cfg.given else "a static plan"
                logger.info("step %s: microbatch chain %s; later steps follow %s", self.func.__name__,
                            "->".join(map(str, info["chain"])), plan)
        return results

    def _section(self, cfg: Any, recorded: RecordedStep) -> Any:
        """The pipeline section of the plan: the user's ``pipeline``, or (none set) the simulator's fastest.

        Without a ``pipeline`` key, the candidates (`smp.pipeline.choose.DEFAULT_CANDIDATES`: SMP v1's
        interleaved order and the schedules that hold no more microbatches than it) are simulated
        with the costs measured on this model and the fastest is planned; the numbers of training
        are the same under every plan. The costs are shared by the pipeline's ranks, so all pick alike.
        """
        section = cfg.pipeline_section()
        if "pipeline" in cfg.given or recorded.costs is None or not recorded.backward:
            return section
        best, makespans = fastest_schedule(section, recorded.chain, recorded.costs,
                                           split_weights=cfg.tensor_parallel_degree == 1)
        if smp_state.current().rank == 0 and makespans:
            logger.info("step %s: no pipeline set; the plan is %r, the fastest in smp's simulator with the measured "
                        "costs (%s per step; set pipeline to choose)", self.func.__name__, best.schedule,
                        ", ".join(f"{name} {t * 1e3:.0f} ms" for name, t in makespans.items()))
        return best


# Note [costs measured again]: the static plan is built from the durations of the recording step,
# whose microbatches ran one at a time (so that its order cannot depend on timing). Run side by
# side they take other times: two microbatches' threads share the rank, and memory is warm. Once,
# after the first planned step, every rank shares that step's durations (each kind of action's
# median over the microbatches) and builds its plan again from them. Measured on the ModuleList
# GPT of benchmarks/bench_pipeline.py under zb_v with the V cut inside block 1 (2 CPU ranks, 8
# microbatches, paired launches, median step after the refresh): 498-512 ms against 524-528 with
# the recording step's costs (refresh after the third step), 515 / 521 / 564 against 562 / 528 /
# 570 (after the first) in a slower hour. Once, not on every step: a plan that followed each step's
# noise would change the order back and forth.
_MEASURE_AGAIN = 1


def _durations(engine: Any, cfg: Any, step_function: Any, when: str, chain: list[int]) -> list[dict[tuple[str, int], float]]:
    """Every pipeline rank's median (kind, ordinal) action durations of the step that just ran.

    TP peers sit in different pipelines and meet in collectives inside their actions: they must
    run the very same order, so all of them use tp_rank 0's measurements. Where an earlier launch
    of the same model and configuration recorded the durations of this step (``when``: "recording"
    or "planned"), those are used instead, so the plan is the same as in that launch
    (partitioning/record.py); otherwise the pipeline's leader records these.
    """
    from .runtime.comm import PP_GROUP, TP_GROUP, allgather

    per_rank = allgather(engine.durations(engine.events), PP_GROUP)
    key = getattr(step_function, "record_key", None)  # set on pp_rank 0 only, where records are kept
    recorded = allgather(record.load_durations(key, when, chain) if key else None, PP_GROUP)[0]
    if cfg.tensor_parallel_degree > 1:
        per_rank, recorded = allgather((per_rank, recorded), TP_GROUP)[0]
    if recorded is not None and len(recorded) == len(per_rank):
        return recorded
    if key:
        record.save_durations(key, when, chain, per_rank)
    return per_rank


def step(func: Callable[..., Any] | None = None, *, non_split_inputs: Any = None, input_split_axes: Any = None,
         detach_outputs: bool = True) -> Any:
    """Decorate a training or evaluation step (usable as ``@smp.step`` or ``@smp.step(...)``)."""
    def wrap(f: Callable[..., Any]) -> StepFunction:
        return StepFunction(f, non_split_inputs, input_split_axes, detach_outputs)

    return wrap(func) if func is not None else wrap
