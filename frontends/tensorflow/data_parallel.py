"""Data parallelism for smp.tensorflow: gradients averaged over the DP group inside the backward pass.

With ``horovod: True`` (or ``ddp: True``, its alias here) and more than one replica, the gradients a
step returns are already the average over the DP group (issue 11's decision), so a script without
any Horovod call trains correctly, and `smp.tensorflow.horovod.allreduce` of such a gradient gives
it back unchanged. Each rank's loss stays its own replica's.

How: the engine wraps every variable read of the partitioned call with `average_over_dp` (or the
reads of one partition together with `average_many`). The wrapper is the identity in the forward;
its gradient is the upstream gradient averaged over the DP group, computed by
``runtime().transport.allreduce_mean`` inside a ``tf.numpy_function(stateful=True)``. So
``tape.gradient`` and ``tf.gradients`` (``optimizer.get_gradients``) return DP-averaged gradients,
per microbatch, eagerly and inside a ``tf.function``. (A stage function pruned from the traced
``call()`` reads its variables inside; pruned with the ``ReadVariableOp`` outputs among its feeds,
it takes the reads as arguments, and the engine passes ``average_many([v, ...])`` for them: the
tape then records the reads outside, through the wrapper.)::

    rank (dp 0)   read v -> identity -> ... loss_0     backward: g_0 --allreduce_mean--> (g_0 + g_1) / 2
    rank (dp 1)   read v -> identity -> ... loss_1     backward: g_1 --allreduce_mean--> (g_0 + g_1) / 2

Every replica of a DP group runs the same program on the same pipeline stage, so the allreduces
are created in the same order on every member and match; in a ``tf.function`` stateful
py-functions run in program order (TF's automatic control dependencies). 16-bit gradients are
averaged in float32 and cast back. Sparse upstream gradients (``tf.IndexedSlices`` from a
``tf.gather`` of an embedding) are densified: the average of two sparse gradients is dense anyway.

Cost, measured at 2 ranks (dp2) on the 2-core dev box while it was shared (load average 7-8, so
+-50 %): median ms of one traced forward+backward, 30-40 calls interleaved across the variants
(the dp2 case of ``tests/tensorflow/test_data_parallel.py``, run with ``-s``)::

    model                          no averaging   average_over_dp per read   average_many (one bucket)
    8 x Dense(256): 16 vars, 2.1 MB    7-10             36-37                      27-36
    32 x Dense(16): 64 vars, 35 KB     1.8-2.2          30-47                      12-15

Each allreduce costs ~0.5-0.7 ms here whatever its size up to a few hundred KB (the failure-aware
wait polls the request), so bucket the reads of a partition call when it has many variables.

Example (inside a Keras layer's ``call``, as the engine does it for every variable read)::

    kernel = average_over_dp(self.kernel, "dense/kernel")
    return tf.matmul(x, kernel)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

import smp.state as smp_state
from smp.runtime.ranks import dp_size
from smp.topology import GroupKind

__all__ = ["average_many", "average_over_dp", "dp_enabled"]

_SMALL_FLOATS = (np.float16, tf.bfloat16.as_numpy_dtype)


def dp_enabled() -> bool:
    """True when gradients are averaged over the DP group: ``horovod`` or ``ddp`` is on and dp_size > 1.

    Example:
        >>> dp_enabled()   # before smp.init
        False
    """
    cfg = smp_state.current().cfg
    if cfg is None:
        return False
    return bool(cfg.horovod or cfg.ddp) and dp_size() > 1


def _allreduce_mean(array: np.ndarray) -> np.ndarray:
    """The mean of ``array`` over this rank's DP group (16-bit floats reduced in float32)."""
    from .runtime.init import runtime

    a = np.asarray(array, order="C")
    if a.dtype in _SMALL_FLOATS:
        out = runtime().transport.allreduce_mean(a.astype(np.float32), GroupKind.DP)
        return np.asarray(out).astype(a.dtype)
    return np.asarray(runtime().transport.allreduce_mean(a, GroupKind.DP), dtype=a.dtype)


def _dense(grad: Any, like: tf.Tensor) -> tf.Tensor:
    """``grad`` as a dense tensor shaped like ``like`` (None, as TF gives unconnected outputs, is zeros)."""
    if grad is None:
        return tf.zeros_like(like)
    return tf.convert_to_tensor(grad)


def _mean_op(grad: tf.Tensor, what: str) -> tf.Tensor:
    """A graph/eager op whose value is the DP-group mean of ``grad`` (same shape and dtype)."""
    out = tf.numpy_function(_allreduce_mean, [grad], grad.dtype, stateful=True,
                            name=f"smp_dp_mean_{_op_name(what)}")
    out.set_shape(grad.shape)
    return out


def _op_name(what: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "_." else "_" for c in what)
    return cleaned.strip("_.")[:60] or "tensor"


def average_over_dp(t: Any, what: str) -> tf.Tensor:
    """``t`` in the forward; in the backward, the upstream gradient averaged over the DP group.

    The identity (no op at all) when `dp_enabled` is False. Works eagerly, under a
    ``tf.GradientTape`` and inside a ``tf.function`` (also with ``tf.gradients``).

    Args:
        t: a tensor or a variable (``keras.Variable`` / ``tf.Variable``: its value is read).
        what: names the tensor in op names and error messages, e.g. ``"dense/kernel"``.

    Returns:
        A tensor equal to ``t``.

    Example:
        >>> import tensorflow as tf
        >>> v = tf.Variable([1.0, 2.0])
        >>> with tf.GradientTape() as tape:
        ...     loss = tf.reduce_sum(average_over_dp(v, "v") * 3.0)
        >>> tape.gradient(loss, v).numpy()   # one replica: unchanged
        array([3., 3.], dtype=float32)
    """
    x = tf.convert_to_tensor(t)
    if not dp_enabled():
        return x

    @tf.custom_gradient
    def identity(value: tf.Tensor) -> Any:
        def grad(upstream: Any) -> tf.Tensor:
            return _mean_op(_dense(upstream, value), what)

        return tf.identity(value), grad

    return identity(x)


def _mean_many(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The DP-group means of several arrays with one allreduce per dtype (flattened and joined)."""
    out: list[np.ndarray | None] = [None] * len(arrays)
    by_dtype: dict[np.dtype[Any], list[int]] = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(np.asarray(a).dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        flat = np.concatenate([np.ravel(arrays[i]) for i in idx])
        mean = _allreduce_mean(flat.astype(dtype, copy=False))
        offset = 0
        for i in idx:
            a = np.asarray(arrays[i])
            out[i] = mean[offset:offset + a.size].reshape(a.shape)
            offset += a.size
    return [o for o in out if o is not None]


def average_many(tensors: Sequence[Any], what: str = "tensors") -> list[tf.Tensor]:
    """`average_over_dp` for a list: the same values forward, one bucketed allreduce backward.

    The upstream gradients of all of ``tensors`` are flattened, joined (one buffer per dtype),
    averaged over the DP group in one allreduce and split again. The backward runs once every
    output's gradient is known, so use it for reads that are consumed together (the reads of
    one partition's call), not across microbatches.

    Args:
        tensors: tensors or variables.
        what: names the bucket in op names and error messages.

    Returns:
        A list of tensors equal to ``tensors``.

    Example:
        >>> import tensorflow as tf
        >>> a, b = tf.Variable([1.0]), tf.Variable([[2.0, 3.0]])
        >>> with tf.GradientTape() as tape:
        ...     x, y = average_many([a, b])
        ...     loss = tf.reduce_sum(x) + tf.reduce_sum(y * 2.0)
        >>> [g.numpy().tolist() for g in tape.gradient(loss, [a, b])]
        [[1.0], [[2.0, 2.0]]]
    """
    xs = [tf.convert_to_tensor(t) for t in tensors]
    if not dp_enabled() or not xs:
        return xs

    @tf.custom_gradient
    def identity(*values: tf.Tensor) -> Any:
        def grad(*upstream: Any) -> list[tf.Tensor]:
            dense = [_dense(u, v) for u, v in zip(upstream, values)]
            means = tf.numpy_function(lambda *arrays: _mean_many(arrays), dense, [d.dtype for d in dense],
                                      stateful=True, name=f"smp_dp_mean_many_{_op_name(what)}")
            means = means if isinstance(means, (list, tuple)) else [means]  # one output comes back bare when eager
            for m, d in zip(means, dense):
                m.set_shape(d.shape)
            return list(means)

        return [tf.identity(v) for v in values], grad

    return list(identity(*xs))
