"""``@smp.step``: a ``tf.function`` whose body is traced once per microbatch (SMP v1's TF ``smp.step``).

Called eagerly, a step is its own ``tf.function``: traced once per input signature (pass
``input_signature``, whose batch dimension may be None, to trace once), then run as a graph.
Called while an outer ``@tf.function`` traces, it traces into that graph. Either way the body's
arguments are split by the core rules (`smp.step`), the body is traced once per microbatch ``m``
with ``tf_state().microbatch = m``, and every tensor or variable it returns reaches the caller as
a `StepOutput` (other leaves as lists), so::

    @smp.step
    def get_grads(x, y):                         # traced for x[0:B/M], x[B/M:2B/M], ...
        with tf.GradientTape() as tape:
            loss = loss_obj(y, model(x, training=True))
        return tape.gradient(loss, model.trainable_variables), loss

    @tf.function
    def train_step(x, y):
        grads, loss = get_grads(x, y)            # StepOutputs
        optimizer.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
        return loss.reduce_mean()

After the last microbatch the flat list of the returned tensors (microbatch 0's in structure
order, then microbatch 1's, ...) goes through each ``tf_state().finish_step`` callback, and the
step returns what they give back (the engine makes the outputs wait for its pending sends).

Python leaves a step returns (floats, strings, None) are computed when the body is traced, as in
any ``tf.function``; they come back unchanged (not as tensors) when the step runs as its own
``tf.function``.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Mapping
from dataclasses import is_dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import smp.state as smp_state
from smp.errors import NotInitializedError, SMPError, TensorSplitError
from smp.step import StepSpec, aggregate_outputs, split_arguments
from smp.structure import map_structure

from .state import tf_state
from .step_output import NEXT_MICROBATCH, StepOutput, TFStepOps

# AutoGraph turns an error raised while it traces the user's @tf.function into its StagingError
# unless it can rebuild the error's class from a message (not ours: they subclass ValueError & co.).
# Passed through, smp's errors keep their type around a tf.function train step
# (``except smp.errors.PartitionMemoryError`` works) and their message, which names the fix.
SMPError.ag_pass_through = True  # type: ignore[attr-defined]

__all__ = ["StepFunction", "StepFunctionCalledError", "StepOutput", "step"]

logger = logging.getLogger("smp")


class StepFunctionCalledError(SMPError, RuntimeError):
    """An ``@smp.step`` function was called from inside another one (SMP v1 name)."""


class FinishStepError(SMPError, RuntimeError):
    """A ``tf_state().finish_step`` callback returned something other than one tensor per output."""


def _is_leaf(x: object) -> bool:
    # The core's aggregation treats dataclasses and sets as leaves; so does the flattening here.
    return (is_dataclass(x) and not isinstance(x, type) and not isinstance(x, Mapping)) or isinstance(
        x, (set, frozenset))


class StepFunction:
    """A function decorated with ``@smp.step``; call it like the function.

    Attributes:
        func: the user's function.
        spec: its `smp.step.StepSpec` (split rules).
        input_signature: passed to ``tf.function``.
    """

    def __init__(self, func: Callable[..., Any], input_signature: Any, autograph: bool,
                 non_split_inputs: Any, input_split_axes: Any, tf_function_kwargs: Mapping[str, Any]) -> None:
        self.func = func
        self.spec = StepSpec.from_function(func, non_split_inputs, input_split_axes)
        self.input_signature = input_signature
        self.autograph = autograph
        self._converted: Callable[..., Any] | None = None
        # One template per trace: the traced function returns its trace id and the flat tensors; the
        # template puts the tensors back into the per-microbatch structures with their Python leaves.
        self._templates: dict[int, tuple[list[Any], int]] = {}
        self._trace_ids = itertools.count()
        # Sizes unknown at trace time are checked in Python first, so an eager call with a bad size
        # raises the core's TensorSplitError before any work.
        self._precheck = input_signature is not None or bool(tf_function_kwargs.get("reduce_retracing"))

        self._tf_function_kwargs = dict(tf_function_kwargs)
        # One tf.function per number of microbatches (the count is baked into each trace; it changes
        # only when smp.init runs again with another config).
        self._functions: dict[int, Any] = {}
        tf.function(lambda: None, **self._tf_function_kwargs)  # bad tf.function options fail here
        functools.update_wrapper(self, func)

    @tf.autograph.experimental.do_not_convert
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        st = smp_state.current()
        if st.cfg is None:
            raise NotInitializedError(f"call smp.init(config) before calling the @smp.step function "
                                      f"{self.spec.function_name}")
        if tf_state().microbatch is not None:
            raise StepFunctionCalledError(f"the @smp.step function {self.spec.function_name} was called inside "
                                          f"another @smp.step function; steps cannot nest. Fix: call it from "
                                          f"outside, or call the plain function inside")
        if not tf.executing_eagerly():
            return aggregate_outputs(self._trace(args, kwargs), TFStepOps(), StepOutput)
        if self._precheck:
            split_arguments(self.spec, args, kwargs, int(st.cfg.microbatches), _CheckOps(self.spec.function_name))
        try:
            trace_id, flat = self._function(int(st.cfg.microbatches))(*args, **kwargs)
        except tf.errors.InvalidArgumentError as e:
            marker = f"smp.step({self.spec.function_name}): cannot split"
            if marker in e.message:
                text = e.message[e.message.index(marker):].split("\n")[0]
                raise TensorSplitError(text) from e
            raise
        template, count = self._templates[int(trace_id)]
        return aggregate_outputs(_unflatten(template, list(flat)[:count]), TFStepOps(), StepOutput)

    def _function(self, num_microbatches: int) -> Any:
        """The step's own ``tf.function`` for ``num_microbatches``."""
        function = self._functions.get(num_microbatches)
        if function is None:
            @functools.wraps(self.func)
            def traced(*args: Any, **kwargs: Any) -> tuple[tf.Tensor, list[Any]]:
                per_mb = self._trace(args, kwargs)
                trace_id = next(self._trace_ids)
                flat, template = _flatten(per_mb)
                self._templates[trace_id] = (template, len(flat))
                return tf.constant(trace_id, tf.int64), flat

            function = tf.function(traced, input_signature=self.input_signature, autograph=False,
                                   **self._tf_function_kwargs)
            self._functions[num_microbatches] = function
        return function

    def _user_function(self) -> Callable[..., Any]:
        if self._converted is None:
            converted = self.func
            if self.autograph:
                try:
                    converted = tf.autograph.to_graph(self.func)
                except Exception as e:  # noqa: BLE001 - AutoGraph's own rule: run the function as written
                    logger.warning("smp.step(%s): AutoGraph could not convert the function (%s); it is traced "
                                   "as written (Python control flow on tensors will fail)",
                                   self.spec.function_name, e)
            self._converted = converted
        return self._converted

    def _trace(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """Split the arguments and trace the body once per microbatch; returns the per-microbatch results."""
        num_mb = int(smp_state.current().cfg.microbatches)  # type: ignore[union-attr]
        ops = TFStepOps(num_mb, self.spec.function_name)
        parts = split_arguments(self.spec, args, kwargs, num_mb, ops)
        state = tf_state()
        func = self._user_function()
        saved = state.num_microbatches
        state.step_traces += 1
        state.num_microbatches = num_mb
        results = []
        try:
            # Every op of the step (the body, the engine's transfers, the finish_step callbacks) runs after the
            # runtime split checks, so a bad batch size fails before any rank sends or waits for a message.
            with tf.control_dependencies(ops.checks):
                starts: list[tf.Operation | None] = []
                for m, (a, k) in enumerate(parts):
                    state.microbatch = m
                    starts.append(_start_after(results))
                    with tf.control_dependencies([starts[-1]] if starts[-1] is not None else []):
                        results.append(_values(func(*a, **k)))
                state.microbatch = None
                state.num_microbatches = saved
                return _link_next(_finish(results, state.finish_step), starts)
        finally:
            state.microbatch = None
            state.num_microbatches = saved


def _start_after(results: list[Any]) -> tf.Operation | None:
    """Without a pipeline, the op microbatch ``m`` starts after: it waits for every tensor microbatch
    ``m - 1`` returned (None for microbatch 0, or with a pipeline, whose exchanges order them).

    Nothing else orders the microbatches, and TensorFlow ran them all at once, holding every
    microbatch's gradients together: the MLP of ``benchmarks/bench_memory.py`` at pp 1 peaked at
    5.7 copies of its weights (TensorFlow's allocator). `StepOutput.accumulate` makes the op also
    wait for its sum of microbatch ``m - 1`` (`NEXT_MICROBATCH`), so a microbatch's gradients are
    added and freed before the next one computes its own.
    """
    cfg = smp_state.current().cfg
    if not results or (cfg is not None and int(cfg.pipeline_parallel_degree) > 1):
        return None
    previous = [x for x in tf.nest.flatten(results[-1], expand_composites=True) if isinstance(x, tf.Tensor)]
    with tf.control_dependencies(previous):
        return tf.no_op(name="smp_microbatch_start")


def _link_next(results: list[Any], starts: list[tf.Operation | None]) -> list[Any]:
    """Mark each tensor microbatch ``m`` returns with the start op of microbatch ``m + 1``."""
    if tf.executing_eagerly():
        return results
    for m, result in enumerate(results[:-1]):
        if starts[m + 1] is None:
            continue
        for x in tf.nest.flatten(result, expand_composites=True):
            if isinstance(x, tf.Tensor):
                setattr(x, NEXT_MICROBATCH, starts[m + 1])
    return results


def _values(result: Any) -> Any:
    """Variables a step returns become their values (the core aggregates tensors)."""
    def leaf(x: Any) -> Any:
        if isinstance(x, (tf.Variable, keras.Variable, np.ndarray)):
            return tf.convert_to_tensor(x)
        return x

    return map_structure(result, leaf, is_leaf=_is_leaf)


def _flatten(per_mb: list[Any]) -> tuple[list[Any], list[Any]]:
    """The tensors of the per-microbatch results in order, and the results with them marked."""
    ops = TFStepOps()
    flat: list[Any] = []

    def take(x: Any) -> Any:
        if ops.is_tensor(x):
            flat.append(x)
            return _Slot(len(flat) - 1)
        return x

    template = [map_structure(r, take, is_leaf=_is_leaf) for r in per_mb]
    return flat, template


def _unflatten(template: list[Any], flat: list[Any]) -> list[Any]:
    return [map_structure(r, lambda x: flat[x.index] if isinstance(x, _Slot) else x, is_leaf=_is_leaf)
            for r in template]


class _Slot:
    """Where the i-th flat tensor goes back into a template."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _finish(results: list[Any], callbacks: list[Callable[[list[Any]], list[Any]]]) -> list[Any]:
    """Pass the flat output tensors through each finish_step callback and put its answer back."""
    if not callbacks:
        return results
    flat, template = _flatten(results)
    for callback in list(callbacks):
        answer = callback(list(flat))
        if not isinstance(answer, (list, tuple)) or len(answer) != len(flat):
            raise FinishStepError(
                f"finish_step callback {getattr(callback, '__qualname__', callback)!r} returned "
                f"{type(answer).__name__}{'' if not isinstance(answer, (list, tuple)) else f' of {len(answer)}'}; "
                f"it must return a list of {len(flat)} tensor(s), one per output tensor it was given, in order")
        flat = list(answer)
    return _unflatten(template, flat)


class _CheckOps(TFStepOps):
    """`TFStepOps` that only checks sizes (narrow makes nothing): the eager pre-check."""

    def __init__(self, step_name: str) -> None:
        super().__init__(1, step_name)

    def dim_size(self, tensor: Any, dim: int) -> int:
        size = self._static(tensor, dim)
        return 1 if size is None else int(size)  # eager arguments always have known sizes

    def narrow(self, tensor: Any, dim: int, start: int, length: int) -> Any:
        return None


def step(func: Callable[..., Any] | None = None, input_signature: Any = None, autograph: bool = True, *,
         non_split_inputs: Any = None, input_split_axes: Any = None, **tf_function_kwargs: Any) -> Any:
    """Decorate a training or evaluation step (``@smp.step`` or ``@smp.step(...)``): a ``tf.function``.

    Args:
        func: the step body; it runs in graph mode, once per microbatch.
        input_signature: ``tf.function``'s: a list of ``tf.TensorSpec`` (the batch dimension may be
            None); without it the step retraces for new shapes, dtypes and Python arguments.
        autograph: convert Python control flow on tensors (``tf.function``'s option).
        non_split_inputs: argument names passed whole to every microbatch.
        input_split_axes: argument name -> the axis its tensors are split along (default 0).
        **tf_function_kwargs: passed to ``tf.function`` (``jit_compile``, ``reduce_retracing``, ...).

    Returns:
        A `StepFunction` (or a decorator making one).

    Raises:
        TensorSplitError: bad ``non_split_inputs`` / ``input_split_axes`` (at decoration), or a
            batch that cannot be split evenly (when called).
        NotInitializedError: called before ``smp.init``.

    Example (after ``smp.init({"microbatches": 2})``):
        >>> @smp.step(input_signature=[tf.TensorSpec([None, 3])])
        ... def double(x):
        ...     return x * 2
        >>> out = double(tf.ones((4, 3)))
        >>> len(out), out.merge().shape
        (2, TensorShape([4, 3]))
    """
    def wrap(f: Callable[..., Any]) -> StepFunction:
        return StepFunction(f, input_signature, autograph, non_split_inputs, input_split_axes, tf_function_kwargs)

    return wrap(func) if func is not None else wrap
