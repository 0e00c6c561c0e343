"""`StepOutput`, the per-microbatch results of an ``smp.step`` call, and `TFStepOps` for the core.

A step function runs once per microbatch; each tensor (or variable) it returns reaches the caller as
a `StepOutput` holding that value from every microbatch, in microbatch order (SMP v1's TF
``StepOutput``). Every method works eagerly (on EagerTensors) and inside a ``tf.function``. A
StepOutput is a ``tf.nest`` structure of its outputs (``__tf_flatten__``), so it can be passed into
or returned from a ``tf.function`` and into another step (microbatch ``m`` gets ``outputs[m]``).

`TFStepOps` implements the core's `smp.step.StepOps` protocol, which splits arguments and
aggregates return values (see `smp.step`).

Example::

    @smp.step
    def get_grads(x, y):
        loss = loss_obj(y, model(x, training=True))
        return optimizer.get_gradients(loss, model.trainable_variables), loss

    @tf.function
    def train_step(x, y):
        grads, loss = get_grads(x, y)
        optimizer.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
        return loss.reduce_mean()
"""

from __future__ import annotations

import logging
import reprlib
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from smp.errors import StepOutputError

from .state import tf_state

__all__ = ["StepOutput", "TFStepOps"]

logger = logging.getLogger("smp")

ACCUMULATE_METHODS = ("add_n", "accumulate_n", "variable")


NEXT_MICROBATCH = "_smp_next_microbatch"  # on a step's output tensor (pp 1): the start op of the next microbatch


def _next_waits(x: Any, token: Any) -> None:
    """Make the next microbatch's start (`NEXT_MICROBATCH` of ``x``, set by the step without a pipeline) wait
    for ``token``, the sum that consumed ``x``: so ``x`` is freed before the next microbatch computes."""
    start = getattr(x.values if isinstance(x, tf.IndexedSlices) else x, NEXT_MICROBATCH, None)
    op = getattr(token, "op", None)
    if start is not None and op is not None and op.graph is start.graph:
        start._add_control_inputs([op])  # noqa: SLF001 - the start op is ours, its graph still being traced


def _dense(x: Any) -> Any:
    """``x`` as a dense tensor (IndexedSlices from an embedding's gradient, numpy arrays)."""
    return x if isinstance(x, tf.Tensor) else tf.convert_to_tensor(x)


class StepOutput:
    """The values one return position of a step took in each microbatch.

    Attributes:
        outputs: the per-microbatch values (``tf.Tensor``, ``tf.IndexedSlices``), by microbatch.

    Example:
        >>> out = StepOutput([tf.constant([1.0, 2.0]), tf.constant([3.0, 4.0])])
        >>> len(out), out[1].numpy().tolist()
        (2, [3.0, 4.0])
        >>> out.reduce_mean().numpy().tolist(), out.concat().numpy().tolist()
        ([2.0, 3.0], [1.0, 2.0, 3.0, 4.0])
    """

    def __init__(self, outputs: Iterable[Any] | None = None) -> None:
        self.outputs: list[Any] = list(outputs) if outputs is not None else []

    # tf.nest protocol: a StepOutput is the structure of its outputs.
    def __tf_flatten__(self) -> tuple[Any, tuple[Any, ...]]:
        return (), tuple(self.outputs)

    @classmethod
    def __tf_unflatten__(cls, metadata: Any, components: Iterable[Any]) -> StepOutput:
        return cls(components)

    def __getitem__(self, index: int | slice) -> Any:
        """``outputs[index]``: the value of microbatch ``index`` (a list for a slice)."""
        return self.outputs[index]

    def __len__(self) -> int:
        return len(self.outputs)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.outputs)

    def _require_outputs(self, what: str) -> None:
        if not self.outputs:
            raise StepOutputError(f"StepOutput.{what}() of an empty StepOutput: there is nothing to reduce. "
                                  f"Fix: check that the step ran at least one microbatch (microbatches >= 1)")

    def _scaled(self) -> list[Any]:
        n = len(self.outputs)
        return [_dense(x) / n for x in self.outputs]

    def _unowned_zero(self) -> tf.Tensor | None:
        """One zero when every output is the engine's zero gradient of a variable this rank does not own.

        Then the mean, the sum and the accumulation are that zero: adding and scaling it once per
        microbatch would cost a pass over the variable each time for nothing (measured on the
        ``benchmarks/tf_pipeline.py`` model: a fifth of a rank's step).
        """
        from .engine.exchange import is_unowned_gradient

        if not self.outputs or not all(is_unowned_gradient(x) for x in self.outputs):
            return None
        first = self.outputs[0]
        scaled_dtype = (tf.zeros([], first.dtype) / len(self.outputs)).dtype
        # The zero itself, not a zeros_like: that of a released variable has size zero, and
        # ``tf.gradients`` gives it the variable's static shape, which Grappler would fold a
        # zeros_like of into a full-size constant.
        return tf.identity(tf.cast(first, scaled_dtype))

    def reduce_mean(self) -> tf.Tensor:
        """``tf.add_n([x / num_microbatches for x in outputs])`` (SMP v1): the batch value of a
        mean-reduced per-microbatch loss, or the batch gradient of per-microbatch gradients.

        Example:
            >>> StepOutput([tf.constant(1.0), tf.constant(2.0)]).reduce_mean().numpy()
            np.float32(1.5)
        """
        self._require_outputs("reduce_mean")
        zero = self._unowned_zero()
        return zero if zero is not None else tf.add_n(self._scaled())

    def reduce_sum(self) -> tf.Tensor:
        """``tf.add_n(outputs)``.

        Example:
            >>> StepOutput([tf.constant(1.0), tf.constant(2.0)]).reduce_sum().numpy()
            np.float32(3.0)
        """
        self._require_outputs("reduce_sum")
        if self._unowned_zero() is not None:
            return tf.zeros_like(self.outputs[0])
        return tf.add_n([_dense(x) for x in self.outputs])

    def concat(self) -> tf.Tensor:
        """``tf.concat(outputs, axis=0)``: the batch-sized tensor of per-sample outputs.

        0-dim outputs (per-microbatch scalars such as a loss) are stacked instead into a 1-D tensor
        of length ``len(self)``, as ``smp.torch`` does (``tf.concat`` rejects scalars).

        Example:
            >>> StepOutput([tf.zeros((2, 3)), tf.ones((2, 3))]).concat().shape
            TensorShape([4, 3])
        """
        return self.merge(axis=0)

    def stack(self) -> tf.Tensor:
        """``tf.stack(outputs)``: a new leading axis indexed by microbatch.

        Example:
            >>> StepOutput([tf.zeros((2, 3)), tf.ones((2, 3))]).stack().shape
            TensorShape([2, 2, 3])
        """
        self._require_outputs("stack")
        return tf.stack([_dense(x) for x in self.outputs])

    def merge(self, axis: int = 0) -> tf.Tensor:
        """The per-microbatch slices put back in the original batch order: the inverse of the split.

        ``smp.step`` cuts a split argument into ``num_microbatches`` consecutive equal slices along
        its axis (``input_split_axes``, default 0), so concatenating the per-microbatch outputs along
        the same axis restores the order of the samples in the batch (what SMP v1 did with
        ``dynamic_stitch``). 0-dim outputs are stacked.

        Args:
            axis: the axis the outputs' samples lie along (the input's split axis).

        Example:
            >>> out = StepOutput([tf.constant([[0, 1]]), tf.constant([[2, 3]])])   # split along axis 1
            >>> out.merge(axis=1).numpy().tolist()
            [[0, 1, 2, 3]]
        """
        self._require_outputs("merge")
        outs = [_dense(x) for x in self.outputs]
        if all(x.shape.rank == 0 for x in outs):
            return tf.stack(outs)
        return tf.concat(outs, axis=axis)

    def accumulate(self, method: str = "variable", var: Any = None) -> tf.Tensor:
        """The same value as `reduce_mean`, summed as the microbatches finish (SMP v1).

        Methods:
            - ``"add_n"``: ``tf.add_n`` of the scaled outputs (exactly `reduce_mean`);
            - ``"accumulate_n"``: SMP v1's ``tf.math.accumulate_n``, which TF 2 deprecated into
              ``tf.add_n``: the same as ``"add_n"``;
            - ``"variable"`` (default): each output is added to an accumulator variable as soon
              as it exists, so the per-microbatch values can be freed early, and the sum is scaled
              once, with the last one (the value of `reduce_mean` exactly when the number of
              microbatches is a power of two, within float rounding otherwise). ``var`` is that
              variable when given (its shape and dtype must match the outputs'); otherwise smp keeps
              one non-trainable variable per call site (created at the first trace of a
              ``tf.function``, reused when it retraces; eagerly a fresh one each call). The
              accumulator starts from the first microbatch's value on every call, so nothing carries
              over from an earlier step. An ``IndexedSlices`` output (an embedding's gradient) is
              scaled and scatter-added, staying sparse.

        The gradient of a variable another pipeline rank owns is the engine's zero in every
        microbatch; every method gives one zero for it, with no per-microbatch work.

        Args:
            method: one of ``"add_n"``, ``"accumulate_n"``, ``"variable"``.
            var: an accumulator ``tf.Variable`` for ``method="variable"``.

        Raises:
            StepOutputError: an unknown method, ``var`` with another method, or a ``var`` whose
                dtype or shape does not fit the outputs.

        Example:
            >>> StepOutput([tf.constant([1.0]), tf.constant([3.0])]).accumulate().numpy().tolist()
            [2.0]
        """
        if method not in ACCUMULATE_METHODS:
            raise StepOutputError(f"StepOutput.accumulate(method={method!r}): unknown method; valid methods are "
                                  f"{list(ACCUMULATE_METHODS)}. Fix: e.g. accumulate(method='variable')")
        if var is not None and method != "variable":
            raise StepOutputError(f"StepOutput.accumulate(method={method!r}, var=...): var is the accumulator of "
                                  f"method='variable' only. Fix: drop var, or use method='variable'")
        self._require_outputs("accumulate")
        if method == "add_n":
            return self.reduce_mean()
        if method == "accumulate_n":
            # tf.math.accumulate_n is deprecated in TF 2.x and computes tf.add_n (it logs so).
            zero = self._unowned_zero()
            return zero if zero is not None else tf.add_n(self._scaled())
        return self._accumulate_variable(var, sys._getframe(1))

    def _accumulate_variable(self, var: Any, caller: Any) -> tf.Tensor:
        n = len(self.outputs)
        first = self.outputs[0]
        dtype = (first.values if isinstance(first, tf.IndexedSlices) else _dense(first)).dtype
        scaled_dtype = (tf.zeros([], dtype) / n).dtype
        shape = _dense(first).shape if not isinstance(first, tf.IndexedSlices) else None
        ours = var is None
        if var is None:
            var = _ACCUMULATORS.get(caller, scaled_dtype)
            if var is None:
                _warn_once("accumulate(method='variable') needs a new accumulator variable while a tf.function "
                           "retraces (tf.function creates variables on its first trace only); this call sums "
                           "with tf.add_n instead (same value). Fix: pass var=<a tf.Variable made outside>.")
                return self.reduce_mean()
        else:
            self._check_var(var, scaled_dtype)
        token: Any = None
        zero = self._unowned_zero()
        if zero is not None:
            token = var.assign(zero)
        sparse = any(isinstance(x, tf.IndexedSlices) for x in self.outputs)
        for m, x in enumerate(self.outputs if zero is None else []):
            with tf.control_dependencies([token] if token is not None else []):
                if sparse and (not isinstance(x, tf.IndexedSlices) or x.dense_shape is None):
                    value = _dense(x) / n
                    token = var.assign(value) if m == 0 else var.assign_add(value)
                elif sparse:
                    if m == 0:
                        token = var.assign(tf.zeros(x.dense_shape, scaled_dtype))
                    with tf.control_dependencies([token]):
                        token = var.scatter_add(tf.IndexedSlices(x.values / n, x.indices, x.dense_shape))
                elif m == 0 and n > 1:
                    token = var.assign(tf.cast(_dense(x), scaled_dtype))
                elif m < n - 1 or (ours and n > 1):
                    token = var.assign_add(tf.cast(_dense(x), scaled_dtype))
                else:
                    # The sum is scaled once, by the last microbatch: one pass over the variable per step
                    # instead of one per microbatch (exact for a power-of-two count, else within rounding).
                    total = _dense(x) if m == 0 else var.read_value() + tf.cast(_dense(x), scaled_dtype)
                    token = var.assign(total / n)
            _next_waits(x, token)
        with tf.control_dependencies([token]):
            out = tf.identity(var.read_value())
        if ours and out.shape.rank != 0:
            # Our accumulator is needed within the step only: emptied once read, it does not keep a
            # copy of every gradient between steps (the read value lives on until it is consumed).
            # The empty value is gathered from the read value (no rows): the same rank (Grappler takes
            # a variable's shape from what is assigned to it, and a reduction over every axis of a
            # later read must see the true rank), a data dependence on the read that Grappler keeps
            # (a control dependence alone it may drop: the assign then ran too early), and a tensor
            # of its own (a slice would keep the whole read buffer alive).
            emptied = var.assign(tf.gather(out, tf.zeros([0], tf.int32)))
            if n > 1 and not sparse and zero is None:
                # Scaled after the variable let go of the sum: the division then owns the buffer and
                # writes in place, instead of holding a second copy of every gradient at once.
                with tf.control_dependencies([emptied]):
                    out = tf.identity(out) / tf.cast(n, scaled_dtype)
        elif ours and n > 1 and not sparse and zero is None:
            out = out / tf.cast(n, scaled_dtype)
        if shape is not None and not tf.executing_eagerly():
            out.set_shape(shape)
        return out

    def _check_var(self, var: Any, dtype: tf.DType) -> None:
        if not isinstance(var, (tf.Variable, keras.Variable)):
            raise StepOutputError(f"StepOutput.accumulate(var={var!r}): var must be a tf.Variable. Fix: "
                                  f"var=tf.Variable(tf.zeros(shape, dtype), trainable=False), made outside tf.function")
        first = self.outputs[0]
        shape = first.dense_shape if isinstance(first, tf.IndexedSlices) else _dense(first).shape
        var_dtype = tf.as_dtype(var.dtype)
        if var_dtype != dtype or (isinstance(shape, tf.TensorShape) and not var.shape.is_compatible_with(shape)):
            raise StepOutputError(f"StepOutput.accumulate(var=...): the variable is {var_dtype.name} {var.shape}, the "
                                  f"outputs divided by num_microbatches are {dtype.name} {shape}. Fix: make the "
                                  f"accumulator with that dtype and shape")

    def process_outputs(self, fn: Callable[[Any], Any]) -> StepOutput:
        """A new StepOutput with ``fn`` applied to every microbatch's value; ``self`` is unchanged.

        Example:
            >>> StepOutput([tf.constant(-1.0), tf.constant(2.0)]).process_outputs(tf.abs).reduce_sum().numpy()
            np.float32(3.0)
        """
        return StepOutput(fn(o) for o in self.outputs)

    def __repr__(self) -> str:
        outs = self.outputs
        n = len(outs)
        if n and all(isinstance(o, tf.Tensor) for o in outs):
            first = outs[0]
            if all(o.shape == first.shape and o.dtype == first.dtype for o in outs):
                return f"StepOutput({n} microbatches of {first.dtype.name} tensors of shape {first.shape})"
        return f"StepOutput({n} microbatches: {reprlib.repr(outs)})"


class _Accumulators:
    """The accumulator variables of ``accumulate(method="variable")`` without ``var``.

    Inside a ``tf.function`` a variable may only be created on its first trace, so each call site
    keeps its variables: the k-th call from one source line in one graph (a list comprehension
    over the gradients calls it once per gradient) uses variable (site, k, dtype). A retrace makes
    a new graph, counts from 0 again and finds the same variables. Variables have no fixed shape,
    so a retrace with other shapes reuses them too. Eagerly each call gets a fresh variable.
    ``smp.reset()`` drops them (a close hook).
    """

    def __init__(self) -> None:
        self.variables: dict[tuple[Any, ...], tf.Variable] = {}
        self.counts: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], int]] = weakref.WeakKeyDictionary()
        self.hooked: Any = None

    def get(self, frame: Any, dtype: tf.DType) -> tf.Variable | None:
        if tf.executing_eagerly():
            return tf.Variable(tf.zeros([], dtype), shape=tf.TensorShape(None), trainable=False,
                               name="smp_accumulator")
        site = (frame.f_code.co_filename, frame.f_code.co_name, frame.f_lineno)
        counts = self.counts.setdefault(tf.compat.v1.get_default_graph(), {})
        k = counts.get(site, 0)
        counts[site] = k + 1
        key = (*site, k, dtype.name)
        found = self.variables.get(key)
        if found is not None:
            return found
        state = tf_state()
        if self.hooked is not state:
            state.close_hooks.append(self.clear)
            self.hooked = state
        try:
            with tf.init_scope():
                found = tf.Variable(tf.zeros([], dtype), shape=tf.TensorShape(None), trainable=False,
                                    name="smp_accumulator")
        except ValueError as e:
            if "singleton" not in str(e):
                raise
            return None
        self.variables[key] = found
        return found

    def clear(self) -> None:
        self.variables.clear()
        self.counts = weakref.WeakKeyDictionary()
        self.hooked = None


_ACCUMULATORS = _Accumulators()
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


# Passed whole into a step as a matter of course: no "passed unchanged" warning.
_QUIET_TYPES: tuple[type, ...] = (
    keras.Model,
    keras.layers.Layer,
    keras.optimizers.Optimizer,
    keras.losses.Loss,
    keras.metrics.Metric,
    keras.Variable,
    tf.Variable,
    tf.Module,
    tf.DType,
    tf.TensorSpec,
)


class TFStepOps:
    """The core's `smp.step.StepOps` for TensorFlow.

    Tensors (split and aggregated): ``tf.Tensor`` (eager or symbolic), ``tf.IndexedSlices`` and
    ``numpy.ndarray`` (converted with ``tf.convert_to_tensor`` when split). Variables
    (``tf.Variable``, Keras variables) are passed whole into a step, not split; a step returning a
    variable returns its value (``smp.step`` reads it before aggregation).

    A dimension unknown at trace time (a None batch dimension in ``input_signature``) is reported
    as ``num_microbatches`` *units* of ``tf.shape(x)[dim] // num_microbatches`` elements, so the
    core's even-split arithmetic holds; `narrow` turns units into elements and adds a runtime
    check that the size is divisible (its message is the core's `TensorSplitError` text).

    Args:
        num_microbatches: the microbatches of the step being split (for unknown dimensions).
        step_name: the step function's name, for the runtime check's message.
        extra_quiet_types: more types passed whole without a warning.

    Example:
        >>> ops = TFStepOps(2)
        >>> ops.narrow(tf.range(6), 0, 2, 2).numpy().tolist(), ops.quiet(keras.layers.Dense(1))
        ([2, 3], True)
    """

    def __init__(self, num_microbatches: int = 1, step_name: str = "step",
                 extra_quiet_types: tuple[type, ...] = ()) -> None:
        self.num_microbatches = num_microbatches
        self.step_name = step_name
        self.quiet_types = _QUIET_TYPES + tuple(extra_quiet_types)
        self._unit: dict[tuple[int, int], Any] = {}  # (id(tensor), dim) -> checked unit size
        self._held: list[Any] = []  # keeps the tensors of _unit alive, so their ids stay unique
        self.checks: list[Any] = []  # the runtime divisibility checks made (graph mode; smp.step orders the body after them)

    def is_tensor(self, x: object) -> bool:
        return isinstance(x, (tf.Tensor, tf.IndexedSlices, np.ndarray))

    def _static(self, tensor: Any, dim: int) -> int | None:
        shape = tf.TensorShape(np.shape(tensor)) if isinstance(tensor, np.ndarray) else _dense(tensor).shape
        if shape.rank is None:
            return None
        if not -shape.rank <= dim < shape.rank:
            raise IndexError(f"it has {shape.rank} dimension(s) (shape {shape}), so axis {dim} does not exist")
        return shape[dim]

    def dim_size(self, tensor: Any, dim: int) -> int:
        size = self._static(tensor, dim)
        return self.num_microbatches if size is None else int(size)

    def narrow(self, tensor: Any, dim: int, start: int, length: int) -> Any:
        x = _dense(tensor)
        static = self._static(x, dim)
        rank = x.shape.rank
        if rank is None:
            raise ValueError(f"smp.step({self.step_name}): cannot split a tensor of unknown rank; give it a "
                             f"shape in input_signature")
        axis = dim % rank
        if static is not None:
            begin, size = start, length
        else:
            unit = self._unit_size(x, axis)
            begin, size = start * unit, length * unit
        index = [slice(None)] * axis + [slice(begin, begin + size)]
        return x[tuple(index)]

    def _unit_size(self, x: tf.Tensor, axis: int) -> Any:
        key = (id(x), axis)
        if key not in self._unit:
            n = self.num_microbatches
            size = tf.shape(x)[axis]
            check = tf.debugging.assert_equal(
                tf.math.floormod(size, n), 0,
                message=(f"smp.step({self.step_name}): cannot split an argument into {n} microbatches: its size "
                         f"along axis {axis} (unknown when the step was traced) is not divisible by {n}. Rule: "
                         f"every tensor of a split argument is cut into num_microbatches equal parts along its "
                         f"axis. Fix: use a batch size divisible by {n} (drop_remainder=True in tf.data), change "
                         f"the microbatches config, or list the argument in non_split_inputs"))
            if check is not None:
                self.checks.append(check)
            with tf.control_dependencies([check] if check is not None else []):
                self._unit[key] = tf.identity(size // n)
            self._held.append(x)
        return self._unit[key]

    def is_step_output(self, x: object) -> bool:
        return isinstance(x, StepOutput)

    def quiet(self, x: object) -> bool:
        return isinstance(x, self.quiet_types)

    def probable_bug(self, x: object) -> str | None:
        if isinstance(x, self.quiet_types):
            return None
        if isinstance(x, tf.data.Dataset):
            return ("a tf.data.Dataset is not split into microbatches, and iterating it inside the step would run "
                    "once per microbatch. Fix: iterate the dataset outside the step and pass each batch's tensors "
                    "(SMP splits tensors).")
        if isinstance(x, (tf.data.Iterator, Iterator)):
            return ("an iterator passed into a step is shared by every microbatch. Fix: call next() outside the "
                    "step and pass the batch's tensors.")
        return None
