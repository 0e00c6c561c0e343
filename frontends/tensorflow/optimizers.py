"""``optimizer.get_gradients(loss, params)`` on Keras 3 optimizers: the SMP v1 spelling, brought back.

Keras 3 optimizers have no ``get_gradients`` (Keras 2's ``OptimizerV2`` had it, and SMP v1 TF
scripts call it inside ``@smp.step``). `install` adds it to ``keras.optimizers.Optimizer``, the
base class of every Keras 3 optimizer (``tf.keras.optimizers.Optimizer`` is the same class), as

    ``tf.gradients(loss, params, unconnected_gradients="zero")``

so it returns one tensor per parameter, never None (a parameter the loss does not reach gets
zeros), which is what ``[g.accumulate() for g in grads]`` needs on every rank. ``tf.gradients``
exists only in graph mode: outside a traced function (``@smp.step`` always traces its body) the
method raises, naming ``smp.step``. `uninstall` removes exactly what `install` added.

SMP v1 scripts call nothing: `install_for_session` runs at ``smp.init`` when Keras is already
imported (``runtime/init.py``; a runtime-only script never imports TensorFlow for it), else when
the first ``DistributedModel`` is constructed, and ``smp.reset()`` undoes it (``tf_state().close_hooks``).

``compute_gradients``: not added. It is the TF1 ``tf.compat.v1.train.Optimizer`` method (returning
``(gradient, variable)`` pairs), never a Keras optimizer method, so no SMP v1 TF2 script calls it
on a Keras optimizer; adding a second, non-Keras spelling would only widen the patched surface.
Scripts on TF1 optimizers keep TF's own ``compute_gradients``, which works inside a step as is.

``apply`` (under ``apply_gradients``) is patched too, to skip the variables this rank does not hold
(`apply_held`): each rank's optimizer builds slots for, and steps, its own variables only, one after
another.

Example:
    >>> install()
    >>> @smp.step
    ... def get_grads(x, y):
    ...     loss = loss_obj(y, model(x))
    ...     return optimizer.get_gradients(loss, model.trainable_variables), loss
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf
from keras.src.optimizers.base_optimizer import BaseOptimizer

from smp.errors import SMPError

from .residency import is_released
from .state import tf_state

__all__ = ["get_gradients", "install", "install_for_session", "installed", "uninstall"]


def get_gradients(self: Any, loss: tf.Tensor, params: Sequence[Any]) -> list[tf.Tensor]:
    """The gradients of ``loss`` with respect to ``params`` (Keras 2 ``Optimizer.get_gradients``).

    Args:
        loss: a scalar loss tensor of the traced step.
        params: the variables (``model.trainable_variables``).

    Returns:
        One tensor per parameter, in order; zeros where the loss does not depend on it.

    Raises:
        SMPError: called eagerly (``tf.gradients`` needs a graph; ``@smp.step`` provides one).
    """
    if tf.executing_eagerly():
        raise SMPError(
            "optimizer.get_gradients(loss, params) works only in graph mode, i.e. inside an @smp.step "
            "function (which traces its body). Fix: call it in the @smp.step body, or use tf.GradientTape")
    params = list(params)
    tensors = [p.value if isinstance(p, keras.Variable) else p for p in params]
    grads = tf.gradients(loss, tensors, unconnected_gradients="zero")
    return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]


def apply_held(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
    """``Optimizer.apply`` over the variables this rank holds, one variable's update after another.

    Pairs whose variable another pipeline rank owns (its storage released here, `residency`) are
    dropped before Keras builds slots or steps: ``optimizer.apply_gradients(zip(grads,
    model.trainable_variables))`` in an SMP v1 loop keeps Adam's moments for this rank's variables
    only, and steps nothing else.

    Traced (the ``tf.function`` of a train step), each variable's update waits for the previous
    one's: TensorFlow would otherwise run them all at once, each with its temporaries (Adam's are
    the size of the variable), and a rank peaked after its last microbatch at 6.0 copies of its
    variables with the overlap's inter-op pool and 4.5-4.75 in lockstep; in order, 4.6-4.9 and
    4.25 (TensorFlow's allocator, the MLP of ``benchmarks/bench_memory.py`` at pp 2; 4 is the
    floor: weights, Adam's two moments, the sum of the microbatches' gradients).
    """
    if trainable_variables is not None:
        pairs = [(g, v) for g, v in zip(grads, trainable_variables) if not is_released(v)]
        grads, trainable_variables = [g for g, _ in pairs], [v for _, v in pairs]
    if tf.executing_eagerly():
        return _BASE_APPLY(self, grads, trainable_variables)
    update_step = self.update_step
    previous: list[Any] = []

    def in_order(gradient: Any, variable: Any, learning_rate: Any) -> Any:
        with tf.control_dependencies(previous):
            out = update_step(gradient, variable, learning_rate)
            previous[:] = [tf.identity(variable)]  # a read after the update (automatic control dependencies)
        return out

    own = self.__dict__.get("update_step", _NONE)
    object.__setattr__(self, "update_step", in_order)  # past Keras's attribute tracking
    try:
        return _BASE_APPLY(self, grads, trainable_variables)
    finally:
        if own is _NONE:
            object.__delattr__(self, "update_step")
        else:
            object.__setattr__(self, "update_step", own)


_BASE_APPLY = BaseOptimizer.apply
_NONE = object()


def install() -> None:
    """Add ``get_gradients`` to ``keras.optimizers.Optimizer`` and make its ``apply`` skip the variables
    this rank does not hold (idempotent; ``smp.init`` calls it)."""
    base = keras.optimizers.Optimizer
    if getattr(base, "get_gradients", None) is get_gradients:
        return
    if "get_gradients" in base.__dict__ or "apply" in base.__dict__:
        raise SMPError("keras.optimizers.Optimizer already has a get_gradients or apply that smp did not add; "
                       "smp.tensorflow leaves it alone. Fix: remove the other patch")
    base.get_gradients = get_gradients
    base.apply = apply_held


def uninstall() -> None:
    """Remove what `install` added (``smp.reset`` calls it)."""
    base = keras.optimizers.Optimizer
    if base.__dict__.get("get_gradients") is get_gradients:
        del base.get_gradients
    if base.__dict__.get("apply") is apply_held:
        del base.apply


def installed() -> bool:
    """Whether `install` is in effect."""
    return keras.optimizers.Optimizer.__dict__.get("get_gradients") is get_gradients


def install_for_session() -> None:
    """`install`, undone by ``smp.reset()`` (idempotent within one ``smp.init`` session)."""
    hooks = tf_state().close_hooks
    install()
    if uninstall not in hooks:
        hooks.append(uninstall)
