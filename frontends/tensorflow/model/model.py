"""``smp.DistributedModel``: a Keras 3 ``Model`` whose ``call()`` runs split across the pipeline ranks.

Users subclass it as they subclass ``keras.Model`` (SMP v1 TF). ``model(x)`` works only inside an
``@smp.step`` body, which runs on every rank; each call there runs only this rank's part of
``call()`` and returns the model outputs on every rank. At the first call of each input signature:

1. ``call()`` is traced once at the microbatch's input spec (`partitioning.trace`); the first trace
   also builds the variables, at pp > 1 as handles without values (every rank checks that it built
   the same variables as pipeline rank 0);
2. ops are placed (`partitioning.decide`: ``smp.partition`` scopes, or the auto-partitioner),
   variables get owners, the trace is cut into stages (`engine.stages`) and this rank's stages
   are pruned into functions; each rank gives values to its own variables only (the values one
   process would have: every initializer runs in Keras' order) and releases the others
   (`residency`); ``memory_per_rank`` is checked against each rank's estimate first (`memory`);
3. the ``register_post_partition_hook`` functions run (once per model), then the first forward.

Steps 1-3 run eagerly in a short-lived thread (`_in_fresh_thread` says why).

Gradients: ``tape.gradient(loss, model.trainable_variables)`` and
``optimizer.get_gradients(loss, ...)`` return a tensor for every variable on every rank (an empty
zero for the variables another rank owns). After ``optimizer.apply_gradients`` a variable is correct
on its owner (`DistributedModel.variable_owner`); the other ranks hold no value for it and run no op
that reads it; the optimizer keeps slots for, and steps, this rank's variables only.

Data parallelism (``horovod: True`` or ``ddp: True`` with more than one replica): the gradients
are already averaged over the DP group when the step returns them (`engine.stages.StagePlan.function`
averages each stage's variable reads, one bucketed allreduce per stage and microbatch); each
rank's loss stays its own replica's. The replicas of a stage start from DP rank 0's values.

Saving: `DistributedModel.save_model` writes the unpartitioned model (SMP v1), which plain
TensorFlow loads without smp; ``smp.CheckpointManager`` saves each stage's variables, and its
``restore()`` before the first step runs when the model is partitioned.

Example:
    >>> class Model(smp.DistributedModel):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.d1 = keras.layers.Dense(32, activation="relu")
    ...         self.d2 = keras.layers.Dense(10)
    ...     def call(self, x):
    ...         with smp.partition(0):
    ...             h = self.d1(x)
    ...         with smp.partition(1):
    ...             return self.d2(h)
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.common import global_state  # Keras' thread-local settings (no public accessor)

import smp.state as smp_state
from smp.errors import SMPError
from smp.partition import PartitionScopes, format_bytes
from smp.runtime.memory import give_back_freed

from .. import keras_loop
from ..engine.executor import PartitionedCall
from ..engine.link import current_link, dp_broadcast_array, pp_broadcast, world_broadcast
from ..engine.stages import StagePlan, plan_stages
from ..engine.timeline import ActionLog
from ..optimizers import install_for_session
from ..partitioning.decide import decide, placement_table
from ..partitioning.trace import initialize_deferred, input_signature, trace_call
from ..residency import release
from ..state import TFState, tf_state
from . import memory
from .hooks import note_model_constructed, run_post_partition_hooks

__all__ = ["DistributedModel"]

logger = logging.getLogger("smp.tensorflow")


@dataclass
class _Partitioned:
    """What one input signature of the model was turned into."""

    plan: StagePlan
    runner: PartitionedCall


@dataclass
class _ModelState:
    """The model's smp bookkeeping (one attribute, so Keras tracks none of it)."""

    programs: dict[Any, _Partitioned] = field(default_factory=dict)
    owners: dict[int, int] | None = None
    tf_state: TFState | None = None
    calls: dict[tuple[int, int], int] = field(default_factory=dict)
    log: ActionLog = field(default_factory=ActionLog)
    hooks_ran: bool = False
    pp_rank: int = 0
    whole: int = 0  # > 0 inside `DistributedModel.whole_model`: calls run keras.Model.__call__
    export_signature: list[Any] | None = None  # the first call's positional specs, batch None (save_model)


class DistributedModel(keras.Model):
    """A Keras model partitioned across the pipeline ranks (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._smp = _ModelState()
        cfg = smp_state.current().cfg
        if cfg is not None:
            install_for_session()  # optimizer.get_gradients, when smp.init ran before Keras was imported
            note_model_constructed()
        self._smp_scopes = PartitionScopes.from_settings(cfg.partition_section()) if cfg is not None else None

    # -- what users and tests read -----------------------------------------------------------
    @property
    def partitioned(self) -> bool:
        """Whether the first step has partitioned the model."""
        return bool(self._smp.programs)

    def variable_owner(self, variable: Any) -> int | None:
        """The pipeline rank that owns ``variable`` (an element of ``variables``, or its index)."""
        index = variable if isinstance(variable, int) else self._variable_index(variable)
        owners = self._smp.owners
        return owners.get(index, 0) if owners is not None else None

    def is_local_variable(self, variable: Any) -> bool:
        """Whether this rank owns ``variable`` (so its value here is the trained one)."""
        return self.variable_owner(variable) == self._smp.pp_rank

    def memory_check(self, optimizer: Any = None) -> dict[str, dict[str, float]]:
        """This rank's memory: the bytes it holds in variables (and in ``optimizer``'s slots), beside the
        placement's estimate of its weights, gradients and optimizer state (`memory`). Not a collective.

        Example:
            >>> model.memory_check(optimizer)["held"]   # after the first step  # doctest: +SKIP
            {'weights': 16777216.0, 'optimizer': 33554440.0}
        """
        if self._smp.owners is None:
            raise SMPError("memory_check() before the first step: the model is partitioned by its first call")
        pp_size = len(current_link().ranks)
        return memory.memory_check(self, optimizer, self._smp.owners, self._smp.pp_rank, pp_size)

    @property
    def step_actions(self) -> list[list[tuple[int, str, int]]]:
        """The last steps' actions on this rank, each ``[(microbatch, "F" | "B", stage), ...]`` in run order."""
        return list(self._smp.log.steps)

    def step_timeline(self, title: str = "measured step") -> Any:
        """The last step as measured on every rank of this pipeline (a collective over the PP group).

        An `smp.pipeline.Timeline` that the torch frontend's renderers draw (``to_svg``, ASCII,
        Chrome trace); see `engine.timeline.step_timeline`.
        """
        from ..engine.timeline import step_timeline

        cfg = smp_state.current().cfg
        return step_timeline(self._smp.log, self._smp.pp_rank, cfg.pipeline_parallel_degree if cfg else 1, title)

    def stage_plan(self) -> StagePlan:
        """The stages of the first partitioned input signature (for tests and reports)."""
        if not self._smp.programs:
            raise SMPError("the model is not partitioned yet: it is partitioned by its first call inside an smp.step")
        return next(iter(self._smp.programs.values())).plan

    def _variable_index(self, variable: Any) -> int:
        for i, v in enumerate(self.variables):
            if v is variable:
                return i
        raise SMPError(f"{variable!r} is not a variable of this model")

    # -- saving ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def whole_model(self) -> Iterator[None]:
        """Inside it, ``model(x)`` runs all of ``call()`` on this rank as a plain Keras model (export mode).

        For writers that trace ``model(x)`` (``model.export``, ``model.save``); this rank's values of the
        variables other ranks own are used, so `save_model` puts the owners' values in first.
        """
        self._smp.whole += 1
        try:
            yield
        finally:
            self._smp.whole -= 1

    def save_model(self, save_path: str = "/opt/ml/model") -> None:
        """Save the unpartitioned model, loadable by plain TensorFlow/Keras without smp (SMP v1; collective).

        Every variable's trained value comes from its owner stage; world rank 0 writes a SavedModel
        directory (``tf.saved_model.load(save_path).serve(x)``), or a Keras archive when
        ``save_path`` ends in ``.keras`` (see `smp.tensorflow.checkpointing.saving.save_model`).

        Raises:
            SMPError: before the first step (the model is partitioned, and its variables exist, only then).
            SMPCheckpointError: a rank could not take part or rank 0 could not write (on every rank).
        """
        from ..checkpointing.saving import save_model

        if not self.partitioned:
            raise SMPError(f"{type(self).__name__}.save_model() before the first step: the model is built and "
                           "partitioned by its first call inside an smp.step. Fix: save after training steps")
        signature = self._smp.export_signature
        export = None
        if signature is not None and not str(save_path).endswith(".keras"):
            # Keras infers a subclassed model's export signature with its default float dtype; the
            # first call's specs keep integer inputs (token ids) integer.
            def export(model: Any, directory: str) -> None:
                model.export(directory, input_signature=signature, verbose=False)

        save_model(self, save_path, owner_of=self.variable_owner, export=export, whole_model=self.whole_model)

    # -- the Keras loop (SMP v1 >= 1.4: fit / evaluate / predict run their steps under smp) -----
    def compile(self, *args: Any, **kwargs: Any) -> None:
        """``keras.Model.compile``; ``jit_compile`` is off (XLA cannot compile the engine's transfers)."""
        super().compile(*args, **keras_loop.compile_kwargs(kwargs))

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        """``keras.Model.fit`` with each batch run by `keras_loop.train_step` under ``smp.step``."""
        keras_loop.check_fit_kwargs(kwargs, "fit")
        return super().fit(*args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        keras_loop.check_fit_kwargs(kwargs, "evaluate")
        return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        keras_loop.check_fit_kwargs(kwargs, "predict")
        return super().predict(*args, **kwargs)

    def train_step(self, data: Any) -> dict[str, Any]:
        return keras_loop.train_step(self, data)

    def test_step(self, data: Any) -> dict[str, Any]:
        return keras_loop.test_step(self, data)

    def predict_step(self, data: Any) -> Any:
        return keras_loop.predict_step(self, data)

    # -- the call ----------------------------------------------------------------------------
    @tf.autograph.experimental.do_not_convert
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._smp.whole:
            return super().__call__(*args, **kwargs)
        st = tf_state()
        if st.microbatch is None:
            raise SMPError(
                f"{type(self).__name__}(...) was called outside an smp.step: a DistributedModel runs only "
                "inside a function decorated with @smp.step (SMP v1 rule). Fix: call the model in the "
                "@smp.step body, e.g. `@smp.step def get_grads(x, y): preds = model(x); ...`")
        if self._smp.tf_state is not None and self._smp.tf_state is not st:
            raise SMPError(f"this {type(self).__name__} was partitioned before smp.reset(); build a new model "
                           "after smp.init()")
        # As keras.Layer.__call__ does: training= / mask= reach call() only when it takes them.
        for name, takes in (("training", "_call_has_training_arg"), ("mask", "_call_has_mask_arg")):
            if name in kwargs and not getattr(self, takes, True):
                kwargs = {k: v for k, v in kwargs.items() if k != name}
        _, key = input_signature(args, kwargs)
        program = self._smp.programs.get(key)
        if program is None:
            program = _in_fresh_thread(lambda: self._partition(args, kwargs, st))
            self._smp.programs[key] = program
            if self._smp.export_signature is None:
                self._smp.export_signature = _export_signature(args, kwargs)
        slot = (st.step_traces, st.microbatch)
        call = self._smp.calls.get(slot, 0)
        self._smp.calls = {slot: call + 1}
        flat = [tf.convert_to_tensor(leaf) for leaf in tf.nest.flatten((args, kwargs))
                if isinstance(leaf, (tf.Tensor, tf.Variable, np.ndarray))]
        outs = program.runner(flat, step_trace=st.step_traces, microbatch=st.microbatch, call=call,
                              num_microbatches=st.num_microbatches)
        return tf.nest.pack_sequence_as(program.plan.traced.output_structure, outs)

    # -- partitioning (eager, under tf.init_scope) --------------------------------------------
    def _partition(self, args: tuple[Any, ...], kwargs: dict[str, Any], st: TFState) -> _Partitioned:
        cfg = smp_state.current().cfg
        link = current_link()
        self._smp.pp_rank = link.pp_rank
        pp_size = len(link.ranks)
        st.model = self
        if self._smp_scopes is None:
            self._smp_scopes = PartitionScopes.from_settings(cfg.partition_section())
        first = self._smp.owners is None
        # A pipeline builds the variables without values; each rank gives values to its own only.
        traced = trace_call(self, args, kwargs, call=keras.Model.__call__, defer_values=first and pp_size > 1)
        world = smp_state.current().rank_map.world_size
        if first and world > 1:
            self._check_same_variables(world > pp_size)
        placement = decide(traced, pp_size=pp_size, cfg=cfg, owners=self._smp.owners,
                           broadcast=(lambda obj: pp_broadcast(obj, "the op placement")) if pp_size > 1 else None,
                           is_root=link.pp_rank == 0)
        self._smp.owners = placement.owners
        if first:
            if pp_size > 1:  # every rank agreed on the placement, so every rank raises alike
                memory.require_fit(memory.estimates(self.variables, placement.owners, pp_size), cfg.memory_per_rank)
            mine = {id(v) for i, v in enumerate(self.variables) if placement.owners.get(i, 0) == link.pp_rank}
            initialize_deferred(traced.deferred, lambda v: id(v) in mine)
            if world > pp_size:  # the replicas of this stage start alike: dp rank 0's values
                self._agree_on_variables([v for v in self.variables if id(v) in mine])
        plan = plan_stages(traced, placement, pp_size)
        for stage in plan.stages:
            if stage.partition == link.pp_rank:
                plan.function(stage)
        if first:
            logger.info("smp.tensorflow: %s placement of %s\n%s\n%s", placement.method, type(self).__name__,
                        placement_table(traced, placement, pp_size), plan.describe())
        index = {id(v): i for i, v in enumerate(self.variables)}
        trainable = list(self.trainable_variables)
        not_mine = [v for v in trainable if placement.owners.get(index[id(v)], -1) != link.pp_rank]
        if pp_size > 1 and len(not_mine) == 0 and trainable:
            not_mine = trainable[:1]
        runner = PartitionedCall(plan, link, not_mine if pp_size > 1 else [], self._smp.log)
        if self._smp.tf_state is None:
            self._smp.tf_state = st
            transport = link.transport
            log = self._smp.log
            st.finish_step.append(lambda outputs: _after_sends(outputs, transport, log))
        if not self._smp.hooks_ran:
            self._smp.hooks_ran = True
            run_post_partition_hooks()
        if pp_size > 1:  # after the hooks (a deferred restore brings every stage's values in)
            foreign = [v for i, v in enumerate(self.variables) if placement.owners.get(i, 0) != link.pp_rank]
            freed = release(foreign)
            give_back_freed()  # the released storage leaves the process (smp.runtime.memory)
            if first and freed:
                logger.info("smp.tensorflow: pp_rank %d holds %d of %d variables; released %s owned by other "
                            "ranks", link.pp_rank, len(self.variables) - len(foreign), len(self.variables),
                            format_bytes(freed))
        return _Partitioned(plan=plan, runner=runner)

    def _check_same_variables(self, replicas: bool) -> None:
        """Fail, naming the first mismatch, unless every rank built the variables pipeline rank 0 built."""
        prefix = self.name + "/"
        mine = [(v.path[len(prefix):] if v.path.startswith(prefix) else v.path, tuple(v.shape), str(v.dtype))
                for v in self.variables]
        bcast = world_broadcast if replicas else pp_broadcast
        names = bcast(mine, "the DistributedModel's variables (names, shapes, dtypes)")
        for i, (a, b) in enumerate(zip(mine, names)):
            if a != b:
                raise SMPError(f"variable {i} differs between this rank and pipeline rank 0: {a} here, {b} there. "
                               "Fix: build the same model on every rank (same layers in the same order)")
        if len(mine) != len(names):
            raise SMPError(f"this rank built {len(mine)} variables, pipeline rank 0 built {len(names)}. Fix: build "
                           "the same model on every rank")

    def _agree_on_variables(self, variables: list[Any]) -> None:
        """The data-parallel replicas of this stage take DP rank 0's values of ``variables`` (this rank's),
        one variable at a time and unpickled: no rank holds a second copy of its part."""
        for v in variables:
            value = dp_broadcast_array(np.asarray(v.numpy()), f"the initial value of {v.path}")
            v.assign(value)


def _export_signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any] | None:
    """The positional arguments as TensorSpecs with the batch dimension None; None when not all tensors."""
    if any(isinstance(leaf, (tf.Tensor, tf.Variable, np.ndarray, tf.TensorSpec)) for leaf in tf.nest.flatten(kwargs)):
        return None
    leaves = tf.nest.flatten(args)
    if not leaves or not all(isinstance(leaf, (tf.Tensor, np.ndarray, tf.TensorSpec)) for leaf in leaves):
        return None

    def spec(leaf: Any) -> tf.TensorSpec:
        shape = leaf.shape if isinstance(leaf, tf.TensorSpec) else tf.convert_to_tensor(leaf).shape
        dtype = leaf.dtype if isinstance(leaf, tf.TensorSpec) else tf.as_dtype(leaf.dtype)
        dims = shape.as_list() if shape.rank is not None else None
        return tf.TensorSpec(None if dims is None else [None, *dims[1:]] if dims else [], dtype)

    return list(tf.nest.map_structure(spec, args))


# Keras' thread-local settings the partitioning thread inherits (keras.src.backend.common.global_state).
_KERAS_SETTINGS = ("dtype_policy", "global_seed_generator", "flash_attention", "nnx_enabled", "use_legacy_config",
                   "traceback_filtering")


def _in_fresh_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` in a new thread: eager, outside the caller's ``tf.function`` (see below), re-raising its error.

    The first call usually happens while the user's step is being traced. Keras creates the variables
    there, and a ``tf.function`` trace captures variable creation (its variable creator scope holds
    even under ``tf.init_scope``) and retraces the whole step afterwards. A new thread starts with
    TensorFlow's and Keras' thread-local state empty: eager mode, no creator scope, no outer call.
    The Keras settings a script makes process-wide (the dtype policy of
    ``keras.mixed_precision.set_global_policy``, the global seed generator of
    ``keras.utils.set_random_seed``) are thread-local in Keras, so they are carried over.
    """
    box: dict[str, Any] = {}
    inherited = {name: global_state.get_global_attribute(name) for name in _KERAS_SETTINGS}

    def run() -> None:
        try:
            for name, value in inherited.items():
                if value is not None:
                    global_state.set_global_attribute(name, value)
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread below
            box["error"] = e

    worker = threading.Thread(target=run, name="smp-partition")
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _after_sends(outputs: list[Any], transport: Any, log: ActionLog) -> list[Any]:
    """Complete this rank's pending sends and close the step's action log, at the end of the step.

    A stateful op: its ``tf.function`` (the step's own, or the script's around it) does not return
    before it ran. The outputs are not made to wait for it: a gradient a microbatch produced is
    consumed (accumulated, its memory freed) while later microbatches run, instead of every
    microbatch's gradients living until the last send completes (the sends hold copies of their
    tensors, `runtime.transport`).
    """

    def flush() -> np.int32:
        transport.flush("the pipeline sends of this step")
        log.end_step()
        return np.int32(0)

    tf.numpy_function(flush, [], tf.int32, stateful=True, name="smp_flush")
    return outputs
