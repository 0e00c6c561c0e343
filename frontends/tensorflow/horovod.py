"""Horovod's TensorFlow verbs over smp's DP group: the drop-in for SMP v1 Horovod scripts.

The one-line change in an SMP v1 hybrid (``"horovod": True``) script::

    import horovod.tensorflow as hvd          # before
    import smp.tensorflow.horovod as hvd      # after

Horovod 0.28.1 does not build against TensorFlow 2.21, so by default these functions are smp's
own, over the data-parallel group of ``smp.init`` (the ranks that hold the same pipeline stage),
as SMP v1 initialised Horovod: ``size()``/``rank()`` are ``smp.dp_size()``/``smp.dp_rank()``, and
``allreduce`` is a real allreduce over that group through smp's MPI transport, eagerly and inside
a ``tf.function``. When ``horovod.tensorflow`` imports (``REAL_HOROVOD`` is True), the collectives
go to it instead, initialised once over the same DP group's MPI communicator (that path is not
exercised by smp's tests: Horovod cannot be installed next to TF 2.21).

What an SMP v1 script does with it, unchanged (reference section 4)::

    hvd.init()                                    # accepted, a no-op after smp.init (SMP v1: never needed)
    gradients = [hvd.allreduce(g.accumulate()) for g in gradients]
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(optimizer.variables, root_rank=0)

With ``horovod: True`` smp already averages the gradients a step returns over the DP group
(smp.tensorflow.data_parallel), so the ``allreduce`` above averages equal tensors and gives them
back unchanged; a script that drops it trains the same. Differences from Horovod:

- ``tf.IndexedSlices`` are densified before the allreduce (Horovod allgathers them); the result
  is a dense tensor, which ``apply_gradients`` takes as well.
- ops: ``Average`` and ``Sum`` (``Min``/``Max``/``Product``/``Adasum`` raise, naming these two);
  ``compression``: ``Compression.none`` and ``Compression.fp16`` (values rounded to float16);
  devices and ``process_set`` arguments other than the default are not supported.
- ``DistributedOptimizer`` and ``DistributedGradientTape`` raise: they would allreduce inside
  ``smp.step`` (SMP v1: "Avoid hvd.DistributedOptimizer"); allreduce the accumulated gradients
  after the step instead.
- ``local_rank()``/``local_size()`` count the DP group's members on this host, assuming ranks are
  placed host by host (``mpiexec``'s and SageMaker's default): world rank r is on host
  ``r // smp.local_size()``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import numpy as np
import tensorflow as tf

import smp.state as smp_state
from smp.errors import NotInitializedError, SMPError
from smp.runtime import ranks
from smp.topology import GroupKind

from .residency import is_released

__all__ = [
    "REAL_HOROVOD", "Adasum", "Average", "Compression", "DistributedGradientTape", "DistributedOptimizer",
    "HorovodAPIError", "Max", "Min", "Product", "Sum", "allreduce", "broadcast", "broadcast_object",
    "broadcast_variables", "init", "is_initialized", "local_rank", "local_size", "rank", "shutdown", "size",
]

try:  # pragma: no cover - Horovod does not build against TF 2.21 (see the module docstring)
    import horovod.tensorflow as _real_hvd

    REAL_HOROVOD = True
except ImportError:
    _real_hvd = None
    REAL_HOROVOD = False

# Horovod's ReduceOp values.
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}


class HorovodAPIError(SMPError, NotImplementedError):
    """A Horovod call that smp.tensorflow.horovod does not provide; the message says what to do instead."""


class Compression:
    """Horovod's gradient compression choices: ``none`` (default) and ``fp16`` (round to float16)."""

    none = "none"
    fp16 = "fp16"


# --- initialisation and ranks ---------------------------------------------------------------------


def _require_init(what: str) -> None:
    if not smp_state.current().initialized:
        raise NotInitializedError(
            f"smp.tensorflow.horovod.{what}() before smp.init: the Horovod group is smp's data-parallel group. "
            "Fix: call smp.init({..., 'horovod': True}) first (SMP v1: smp initialises Horovod)")


@functools.cache
def _real_init_for(world_rank: int, group: tuple[int, ...]) -> None:  # pragma: no cover - needs real Horovod
    from .runtime.init import runtime

    _real_hvd.init(comm=runtime().groups[GroupKind.DP])


def _real() -> Any:  # pragma: no cover - needs real Horovod
    _real_init_for(ranks.rank(), tuple(ranks.get_dp_group()))
    return _real_hvd


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Accepted for Horovod scripts: a no-op after ``smp.init`` (which set up the DP group).

    Raises:
        NotInitializedError: ``smp.init`` was not called yet.
        HorovodAPIError: ``comm`` or ``process_sets`` is given (the group is always smp's DP group).
    """
    _require_init("init")
    if comm is not None or process_sets is not None:
        raise HorovodAPIError(
            "hvd.init(comm=..., process_sets=...): under smp the Horovod group is always the data-parallel group "
            "of smp.init. Fix: call hvd.init() without arguments (or not at all)")


def is_initialized() -> bool:
    """True once ``smp.init`` ran."""
    return smp_state.current().initialized


def shutdown() -> None:
    """Accepted for Horovod scripts; a no-op (``smp.reset()`` ends smp)."""


def size() -> int:
    """The number of replicas: ``smp.dp_size()``."""
    _require_init("size")
    return ranks.dp_size()


def rank() -> int:
    """This process's rank among the replicas: ``smp.dp_rank()``."""
    _require_init("rank")
    return ranks.dp_rank()


def _local_members() -> list[int]:
    per_host = max(1, ranks.local_size())
    host = ranks.rank() // per_host
    return [r for r in ranks.get_dp_group() if r // per_host == host]


def local_rank() -> int:
    """This process's index among the DP group's members on its host (see the module docstring)."""
    _require_init("local_rank")
    return _local_members().index(ranks.rank())


def local_size() -> int:
    """How many members of this process's DP group run on its host."""
    _require_init("local_size")
    return len(_local_members())


# --- collectives ------------------------------------------------------------------------------------


def _check_op(average: bool | None, op: int | None) -> int:
    if average is not None and op is not None:
        raise ValueError(f"hvd.allreduce(average={average!r}, op={op!r}): give one of them. Fix: op=hvd.Average "
                         "or op=hvd.Sum (average= is Horovod's deprecated spelling)")
    if op is None:
        op = Sum if average is False else Average
    if op not in (Average, Sum):
        name = _OP_NAMES.get(op, repr(op))
        raise HorovodAPIError(f"hvd.allreduce(op={name}) is not supported by smp.tensorflow.horovod. "
                              "Fix: use op=hvd.Average (the default) or op=hvd.Sum")
    return op


def _reduce_numpy(array: np.ndarray, op: int) -> np.ndarray:
    from .runtime.init import runtime

    a = np.asarray(array, order="C")
    work = a.astype(np.float32) if a.dtype in (np.float16, tf.bfloat16.as_numpy_dtype) else a
    transport = runtime().transport
    out = (transport.allreduce_mean if op == Average else transport.allreduce_sum)(work, GroupKind.DP)
    return np.asarray(out).astype(a.dtype, copy=False)


def _allreduce_dense(t: tf.Tensor, op: int, label: str) -> tf.Tensor:
    out = tf.numpy_function(lambda a: _reduce_numpy(a, op), [t], t.dtype, stateful=True, name=label)
    out.set_shape(t.shape)
    return out


def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "", device_sparse: str = "",
              compression: Any = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: str | None = None, process_set: Any = None,
              ignore_name_scope: bool = False) -> tf.Tensor:
    """Horovod's ``allreduce`` over smp's DP group: the average (default) or the sum of ``tensor``.

    Eager and inside a ``tf.function``; differentiable (the gradient is the same allreduce of the
    upstream gradient, as in Horovod). A gradient smp already averaged comes back unchanged.

    Args:
        tensor: a tensor, a variable or a ``tf.IndexedSlices`` (densified first).
        average: Horovod's deprecated spelling: True = ``op=Average``, False = ``op=Sum``.
        op: ``Average`` (default) or ``Sum``.
        compression: ``Compression.none`` or ``Compression.fp16``.
        prescale_factor, postscale_factor: multiply before / after the reduction.
        name: the op name (optional).
        device_dense, device_sparse, ignore_name_scope: accepted and ignored.
        process_set: only the default (None) is supported.

    Returns:
        A dense tensor with ``tensor``'s shape and dtype.

    Example:
        >>> import smp.tensorflow.horovod as hvd   # doctest: +SKIP
        >>> grads = [hvd.allreduce(g.accumulate()) for g in grads]   # doctest: +SKIP
    """
    _require_init("allreduce")
    op = _check_op(average, op)
    if process_set is not None:
        raise HorovodAPIError("hvd.allreduce(process_set=...): only the default process set (smp's DP group) "
                              "exists. Fix: drop the argument")
    if compression not in (Compression.none, Compression.fp16):
        raise HorovodAPIError(f"hvd.allreduce(compression={compression!r}): use hvd.Compression.none or "
                              "hvd.Compression.fp16")
    if REAL_HOROVOD:  # pragma: no cover - needs real Horovod
        return _real().allreduce(tensor, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                 name=name)
    x = tf.convert_to_tensor(tensor)
    label = name or "smp_hvd_allreduce"

    @tf.custom_gradient
    def reduce(value: tf.Tensor) -> Any:
        def body(v: tf.Tensor) -> tf.Tensor:
            if prescale_factor != 1.0:
                v = v * tf.cast(prescale_factor, v.dtype)
            if compression == Compression.fp16 and v.dtype.is_floating:
                v = tf.cast(tf.cast(v, tf.float16), v.dtype)
            if ranks.dp_size() > 1:
                v = _allreduce_dense(v, op, label)
            if postscale_factor != 1.0:
                v = v * tf.cast(postscale_factor, v.dtype)
            return v

        def grad(upstream: Any) -> tf.Tensor:
            return body(tf.convert_to_tensor(upstream))

        return body(value), grad

    return reduce(x)


def _root_check(root_rank: int, what: str) -> int:
    n = ranks.dp_size()
    if not isinstance(root_rank, (int, np.integer)) or not 0 <= int(root_rank) < n:
        raise ValueError(f"hvd.{what}(root_rank={root_rank!r}): must be a rank of the DP group, 0..{n - 1} "
                         f"(hvd.size() is {n}). Fix: root_rank=0")
    return int(root_rank)


def _broadcast_numpy(arrays: list[np.ndarray], root_rank: int) -> list[np.ndarray]:
    """The root's arrays on every member of the DP group (one pickled message)."""
    from .runtime import comm

    if ranks.dp_size() == 1:
        return arrays
    if ranks.dp_rank() == root_rank:
        comm.broadcast([np.asarray(a, order="C") for a in arrays], comm.DP_GROUP)
        return arrays
    got = comm.recv_from(root_rank, comm.RankType.DP_RANK)
    if len(got) != len(arrays) or any(np.shape(g) != np.shape(a) for g, a in zip(got, arrays)):
        raise ValueError(
            f"hvd.broadcast: DP rank {root_rank} sent {len(got)} tensors shaped {[np.shape(g) for g in got]}, this "
            f"rank ({ranks.dp_rank()}) has {len(arrays)} shaped {[np.shape(a) for a in arrays]}. Fix: every rank "
            "broadcasts the same variables (same model, built on every rank, same order)")
    return [np.asarray(g, dtype=a.dtype) for g, a in zip(got, arrays)]


def _broadcast_tensors(tensors: list[tf.Tensor], root_rank: int, label: str) -> list[tf.Tensor]:
    if not tensors:
        return []
    out = tf.numpy_function(lambda *a: _broadcast_numpy(list(a), root_rank), tensors, [t.dtype for t in tensors],
                            stateful=True, name=label)
    out = out if isinstance(out, (list, tuple)) else [out]  # one output comes back bare when eager
    for o, t in zip(out, tensors):
        o.set_shape(t.shape)
    return list(out)


def broadcast(tensor: Any, root_rank: int, name: str | None = None, ignore_name_scope: bool = False,
              process_set: Any = None) -> tf.Tensor:
    """The value of ``tensor`` on DP rank ``root_rank``, on every member of the DP group.

    Example:
        >>> w = hvd.broadcast(w, root_rank=0)   # doctest: +SKIP
    """
    _require_init("broadcast")
    root_rank = _root_check(root_rank, "broadcast")
    if REAL_HOROVOD:  # pragma: no cover - needs real Horovod
        return _real().broadcast(tensor, root_rank, name=name)
    return _broadcast_tensors([tf.convert_to_tensor(tensor)], root_rank, name or "smp_hvd_broadcast")[0]


def broadcast_variables(variables: Iterable[Any], root_rank: int) -> Any:
    """Assign every variable the value it has on DP rank ``root_rank`` (one message for all); the
    variables another pipeline rank owns (released here) are skipped.

    SMP v1 scripts call it after the first step for ``model.variables`` and ``optimizer.variables``.
    Eager: assigns and returns None. In a ``tf.function``: returns the group of assign ops.

    Example:
        >>> hvd.broadcast_variables(model.variables, root_rank=0)   # doctest: +SKIP
    """
    _require_init("broadcast_variables")
    root_rank = _root_check(root_rank, "broadcast_variables")
    # A variable another pipeline rank owns has no storage here (nor on this stage's other replicas).
    variables = [v for v in (variables() if callable(variables) else variables) if not is_released(v)]
    if REAL_HOROVOD:  # pragma: no cover - needs real Horovod
        return _real().broadcast_variables(variables, root_rank)
    values = _broadcast_tensors([tf.convert_to_tensor(v) for v in variables], root_rank, "smp_hvd_broadcast_variables")
    assigns = [v.assign(x) for v, x in zip(variables, values)]
    if tf.executing_eagerly():
        return None
    return tf.group(*[a for a in assigns if a is not None])


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None,
                     process_set: Any = None) -> Any:
    """Horovod's ``broadcast_object``: a picklable Python object from DP rank ``root_rank`` (eager only)."""
    _require_init("broadcast_object")
    root_rank = _root_check(root_rank, "broadcast_object")
    from .runtime import comm

    if ranks.dp_size() == 1:
        return obj
    if ranks.dp_rank() == root_rank:
        comm.broadcast(obj, comm.DP_GROUP)
        return obj
    return comm.recv_from(root_rank, comm.RankType.DP_RANK)


# --- what smp replaces ------------------------------------------------------------------------------


def DistributedOptimizer(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 - Horovod's name
    """Raises `HorovodAPIError`: under smp, allreduce the accumulated gradients after ``smp.step``."""
    raise HorovodAPIError(
        "hvd.DistributedOptimizer is not supported with smp (SMP v1: 'Avoid hvd.DistributedOptimizer'): it would "
        "allreduce inside smp.step. Fix: use the plain optimizer; with horovod: True the gradients a step returns "
        "are already averaged over the DP group, or write grads = [hvd.allreduce(g.accumulate()) for g in grads] "
        "after the step, then optimizer.apply_gradients(...)")


def DistributedGradientTape(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 - Horovod's name
    """Raises `HorovodAPIError`: use a plain ``tf.GradientTape`` inside ``smp.step``."""
    raise HorovodAPIError(
        "hvd.DistributedGradientTape is not supported with smp: it would allreduce inside smp.step. Fix: use a "
        "plain tf.GradientTape inside @smp.step; with horovod: True the gradients it returns are already averaged "
        "over the DP group (or allreduce g.accumulate() after the step with hvd.allreduce)")
