"""Keras ``fit`` / ``evaluate`` / ``predict`` on a `DistributedModel` (SMP v1 >= 1.4 semantics).

Keras' ``train_step`` / ``test_step`` / ``predict_step`` are replaced by the functions here, which
run the forward under an ``smp.step``: the batch is split into ``microbatches`` pieces, each runs
through the partitioned ``call()``, and the results are put back together. Per training batch:

1. per microbatch (inside the step): ``y_pred = model(x_m, training=True)``, the loss
   ``model.compute_loss(x_m, y_m, y_pred, sample_weight_m, training=True)`` (Keras 3: the compiled
   loss plus ``model.losses``), scaled by ``optimizer.scale_loss``, and its gradients with a
   ``tf.GradientTape`` over ``model.trainable_variables``;
2. the gradients' mean over the microbatches (`StepOutput.reduce_mean`, the value
   ``accumulate()`` gives) goes to ``model.optimizer.apply_gradients``;
3. the loss tracker gets the microbatches' mean loss weighted by the batch size (as Keras does),
   the compiled metrics get the merged predictions (``model.compute_metrics`` on the whole batch),
   and the step returns ``model.get_metrics_result()`` through ``compute_metrics``: every metric
   tracker, so ``fit``'s history shows the real values (Keras 3.15 shows 0.0 for a returned
   ``{"loss": ...}`` alone).

With equal microbatches and a "sum over batch size" loss the mean of the microbatch losses is the
batch's mean loss, so history, ``evaluate`` and ``predict`` equal one Keras process up to float
summation order. The model's outputs reach every pipeline rank, so every rank computes the same
loss and metrics, and ``predict`` returns the full predictions in input order on every rank.

Batches must split evenly: a batch size (including the last batch of an epoch) not divisible by
``microbatches`` fails with smp.step's "cannot split" message. Give ``fit`` a sample count that is
a multiple of ``batch_size``, or a ``tf.data.Dataset`` batched with ``drop_remainder=True``.

SMP v1 rejects ``fit``'s ``workers``, ``max_queue_size`` and ``use_multiprocessing`` (data loading
processes next to the MPI ranks); `check_fit_kwargs` does. XLA cannot compile the engine's
transfers (``tf.numpy_function``): `compile_kwargs` keeps ``jit_compile`` off.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Mapping
from typing import Any

import keras
import tensorflow as tf

from smp.errors import SMPError
from smp.structure import map_structure

from .step import StepFunction, step
from .step_output import StepOutput

__all__ = ["check_fit_kwargs", "compile_kwargs", "predict_step", "test_step", "train_step"]

_REJECTED = ("workers", "max_queue_size", "use_multiprocessing")

# model -> {"train" | "test" | "predict": StepFunction}; weak, so the steps go with the model and
# Keras tracks nothing new on it.
_STEPS: weakref.WeakKeyDictionary[Any, dict[str, StepFunction]] = weakref.WeakKeyDictionary()


def check_fit_kwargs(kwargs: Mapping[str, Any], method: str = "fit") -> None:
    """Refuse the Keras data-loading arguments SMP v1 rejects (``workers``, ``max_queue_size``, ``use_multiprocessing``).

    Args:
        kwargs: the keyword arguments given to ``fit`` / ``evaluate`` / ``predict``.
        method: the method's name, for the message.

    Raises:
        SMPError: one of them was given (any value).
    """
    bad = [k for k in _REJECTED if k in kwargs]
    if bad:
        raise SMPError(
            f"DistributedModel.{method}() does not take {', '.join(repr(k) for k in bad)} (SMP v1 rule: data "
            "loading workers or processes beside the MPI ranks are not supported). Fix: drop the argument(s); "
            "to load data in parallel, pass a tf.data.Dataset with .prefetch(...) / num_parallel_calls")


def compile_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``compile``'s keyword arguments with ``jit_compile`` off (XLA cannot compile the pipeline transfers).

    ``jit_compile="auto"`` (Keras' default, XLA on a GPU machine) becomes False.

    Raises:
        SMPError: ``jit_compile=True`` was asked for.
    """
    out = dict(kwargs)
    if out.get("jit_compile", "auto") is True:
        raise SMPError("DistributedModel.compile(jit_compile=True): XLA cannot compile smp's pipeline transfers "
                       "(tf.numpy_function ops). Fix: leave jit_compile unset or pass jit_compile=False")
    out["jit_compile"] = False
    return out


def train_step(model: Any, data: Any) -> dict[str, Any]:
    """Keras ``train_step`` under smp: microbatched forward, loss and gradients, one optimizer step.

    Args:
        model: the compiled `DistributedModel` (any Keras model works: at pp 1 it is plain Keras
            with microbatches).
        data: the batch Keras gives ``train_step``: ``x``, ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``.

    Returns:
        ``model.compute_metrics(...)``: the value of every metric tracker, the loss included.
    """
    _check_compiled(model, "fit")
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    grads, losses, preds = _steps(model)["train"](x, y, sample_weight)
    pairs = [(g.reduce_mean(), v) for g, v in zip(grads, model.trainable_variables) if isinstance(g, StepOutput)]
    if pairs:
        model.optimizer.apply_gradients(pairs)
    _track_loss(model, losses, x)
    return model.compute_metrics(x, y, _merged(preds), sample_weight=sample_weight)


def test_step(model: Any, data: Any) -> dict[str, Any]:
    """Keras ``test_step`` under smp: microbatched forward and loss, metrics on the merged predictions."""
    _check_compiled(model, "evaluate")
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    losses, preds = _steps(model)["test"](x, y, sample_weight)
    _track_loss(model, losses, x)
    return model.compute_metrics(x, y, _merged(preds), sample_weight=sample_weight)


def predict_step(model: Any, data: Any) -> Any:
    """Keras ``predict_step`` under smp: the predictions of the whole batch, in input order."""
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    return _merged(_steps(model)["predict"](x))


def _check_compiled(model: Any, method: str) -> None:
    if getattr(model, "optimizer", None) is None and method == "fit":
        raise SMPError(f"{type(model).__name__}.fit(): the model has no optimizer. Fix: call "
                       "model.compile(optimizer=..., loss=...) first")


def _forward(model: Any, x: Any, training: bool) -> Any:
    if _takes_training(model):
        return model(x, training=training)
    return model(x)


def _takes_training(model: Any) -> bool:
    known = getattr(model, "_call_has_training_arg", None)  # Keras' own answer (Layer attribute)
    if known is not None:
        return bool(known)
    return "training" in inspect.signature(model.call).parameters


def _loss(model: Any, x: Any, y: Any, y_pred: Any, sample_weight: Any, training: bool) -> Any:
    # Keras' wrapper passes `training` only to compute_loss overrides that accept it (added in Keras 3.3).
    compute = getattr(model, "_compute_loss", None)
    if compute is not None:
        return compute(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)
    return model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)


def _steps(model: Any) -> dict[str, StepFunction]:
    """The model's three smp.steps (made once per model: each keeps its traces)."""
    steps = _STEPS.get(model)
    if steps is not None:
        return steps
    ref = weakref.ref(model)

    def train(x: Any, y: Any, sample_weight: Any) -> tuple[list[Any], Any, Any]:
        m = ref()
        with tf.GradientTape() as tape:
            y_pred = _forward(m, x, True)
            loss = _loss(m, x, y, y_pred, sample_weight, True)
            scaled = m.optimizer.scale_loss(loss)
        return tape.gradient(scaled, m.trainable_variables), loss, y_pred

    def test(x: Any, y: Any, sample_weight: Any) -> tuple[Any, Any]:
        m = ref()
        y_pred = _forward(m, x, False)
        return _loss(m, x, y, y_pred, sample_weight, False), y_pred

    def predict(x: Any) -> Any:
        return _forward(ref(), x, False)

    # autograph off: Keras traces its own train function with AutoGraph already, and these bodies
    # have no tensor-dependent Python control flow.
    steps = {"train": step(train, autograph=False), "test": step(test, autograph=False),
             "predict": step(predict, autograph=False)}
    _STEPS[model] = steps
    return steps


def _track_loss(model: Any, losses: StepOutput, x: Any) -> None:
    """Keras' loss tracker: this batch's mean loss, weighted by the batch size."""
    tracker = getattr(model, "_loss_tracker", None)  # Keras' "loss" Mean (made by compile)
    if tracker is None:
        return
    first = next(t for t in tf.nest.flatten(x) if t is not None)
    tracker.update_state(losses.reduce_mean(), sample_weight=tf.shape(first)[0])


def _merged(preds: Any) -> Any:
    """Every StepOutput in ``preds`` merged back into the whole batch (axis 0, input order)."""
    return map_structure(preds, lambda p: p.merge() if isinstance(p, StepOutput) else p,
                         is_leaf=lambda p: isinstance(p, StepOutput))
