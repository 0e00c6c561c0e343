"""Exchange ops: where a boundary tensor crosses ranks, as one differentiable op per crossing point.

Each exchange op sends and receives through the transport inside ``tf.numpy_function(stateful=True)``
and is a ``tf.custom_gradient`` function, so backward crosses the same cut in the other direction:

- forward: send each tensor of ``sends`` to its destination ranks (non-blocking), receive each
  tensor of ``recvs`` (blocking, failure-aware, with a timeout); a tensor whose static shape is
  partly unknown (a step with an ``input_signature`` of batch None) sends its shape first;
- backward: send the upstream gradient of each received differentiable tensor back to its source,
  then receive (and sum over destinations) the gradient of each sent tensor.

All exchange ops of a rank are chained through a scalar *chain* tensor (in and out), the last one
produces the model outputs, and the first one also takes the *anchors*: ``tf.identity`` reads of
the trainable variables this rank does not own, whose gradient is zero (of size zero: this rank
released their storage, `residency`). So on every rank every
exchange op lies on the path from ``model.trainable_variables`` to the loss: a tape or
``tf.gradients`` runs every exchange's backward (in reverse order, the order the peers expect)
and returns a tensor for every variable, never None. In a ``tf.function`` the stateful
numpy_functions run in creation order (automatic control dependencies), which is the same global
stage order on every rank, hence no deadlock: sends never block, and a receive waits only for a
tensor an earlier stage produces. With overlap (`engine.schedule`, ``keep`` given) the transfers
are `independent`: data edges alone order them, and the step's gate orders the work around them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from ..residency import empty_shape

__all__ = ["Recv", "Send", "exchange", "independent", "is_unowned_gradient", "recv_op", "send_op"]

UNOWNED_GRADIENT = "smp_unowned_gradient"


def _unowned_gradients(anchors: Sequence[tf.Tensor], released: Sequence[bool],
                       after: tf.Tensor | None = None) -> list[tf.Tensor]:
    """The zero gradients of the anchors, named so `is_unowned_gradient` finds them.

    A released variable (`residency`: another rank owns it, this rank holds no storage for it)
    gets an empty zero (no rows, `residency.empty_shape`), so a step's gradient list holds an entry for every variable without a
    full-size tensor for the ones this rank does not own. One ``numpy_function`` makes them all: its
    outputs have no static shape, so the graph's gradient checks accept them and Grappler cannot
    fold them into full-size constants (it would a ``zeros_like`` of the variable's read, whose
    static shape is the full one). A held anchor (the one owned variable of a rank that owns them
    all) gets a zero of its shape, which joins its real gradient. ``after``: a tensor the zeros wait
    for (with no input they would run at the step's start, ahead of its first action).
    """
    out = [tf.zeros_like(a, name=UNOWNED_GRADIENT) if not gone else None for a, gone in zip(anchors, released)]
    empty = [i for i, gone in enumerate(released) if gone]
    if empty:
        dtypes = [anchors[i].dtype for i in empty]
        shapes = [empty_shape(anchors[i].shape) for i in empty]
        with tf.control_dependencies([after] if after is not None else []):
            zeros = tf.numpy_function(lambda: [np.zeros(s, d.as_numpy_dtype) for s, d in zip(shapes, dtypes)], [],
                                      dtypes, stateful=True, name=UNOWNED_GRADIENT)
        for i, z in zip(empty, zeros):
            out[i] = z
    return out  # type: ignore[return-value]


def is_unowned_gradient(tensor: Any) -> bool:
    """Whether ``tensor`` is (an identity of) the zero gradient of a variable this rank does not own.

    A step's gradient of such a variable is that zero in every microbatch; `StepOutput` reduces
    them to one zero instead of adding and scaling the zeros once per microbatch. False for an
    eager tensor or anything else.
    """
    try:
        op = tensor.op
        while op.type == "Identity":
            op = op.inputs[0].op
    except (AttributeError, IndexError):
        return False
    return op.name.rsplit("/", 1)[-1].startswith(UNOWNED_GRADIENT)


def independent(tensor: tf.Tensor, keep: list[Any]) -> tf.Tensor:
    """Take a stateful op out of the ``tf.function``'s program-order chain (and note it in ``keep``).

    Automatic control dependencies run the stateful ops of a function in creation order; an op
    marked with the tracing graph's ``experimental_acd_manager.run_independently`` still runs
    (before the function returns) but is ordered by its data and control edges only. A *stateless*
    ``numpy_function`` would not do: Grappler drops control edges from stateless ops (measured:
    a marker before a matmul never ran) and prunes what no output needs.
    """
    manager = getattr(tf.compat.v1.get_default_graph(), "experimental_acd_manager", None)
    if manager is None:
        raise RuntimeError("overlapped transfers need a tf.function trace (no automatic control dependencies here)")
    manager.run_independently(tensor.op)
    keep.append(tensor)
    return tensor


@dataclass(frozen=True)
class Send:
    """One destination of a sent tensor: global rank, forward tag, backward tag, and what it is.

    ``shape_tag``: when the tensor's static shape is partly unknown (a batch dimension of None),
    its runtime shape goes first with this tag.
    """

    dest: int
    tag: int
    grad_tag: int | None
    what: str
    shape_tag: int | None = None
    stream: Any = None  # with overlap: the gradient receives of one stream wait for each other


@dataclass(frozen=True)
class Recv:
    """One received tensor: its static shape (None for unknown dims) and dtype, source rank, tags.

    ``grad_tag`` None: no gradient goes back. ``shape_tag``: the runtime shape comes first (when
    the static shape is partly unknown).
    """

    shape: tuple[int | None, ...]
    dtype: tf.DType
    src: int
    tag: int
    grad_tag: int | None
    what: str
    shape_tag: int | None = None
    stream: Any = None  # with overlap: the receives of one stream (a message over microbatches) in order


def send_op(transport: Any, tensor: tf.Tensor, dest: int, tag: int, what: str,
            shape_tag: int | None = None, keep: list[Any] | None = None) -> tf.Tensor:
    """A non-blocking send of ``tensor`` (after its shape, with ``shape_tag``); returns an int32 token.

    ``keep``: None for an op in program order (lockstep); a list for an `independent` one
    (overlap: ordered by its data and control edges only), which is appended to it.
    """

    def send(array: np.ndarray) -> np.int32:
        if shape_tag is not None:
            transport.isend(np.asarray(array.shape, dtype=np.int64), dest, shape_tag, f"shape of {what}")
        transport.isend(np.ascontiguousarray(array), dest, tag, what)
        return np.int32(0)

    token = tf.numpy_function(send, [tensor], tf.int32, stateful=True, name="smp_send")
    return token if keep is None else independent(token, keep)


def recv_op(transport: Any, shape: tuple[int | None, ...], dtype: tf.DType, src: int, tag: int, what: str,
            deps: Sequence[tf.Tensor], *, shape_tag: int | None = None, like: tf.Tensor | None = None,
            keep: list[Any] | None = None, after: tf.Tensor | None = None) -> tf.Tensor:
    """A blocking receive (after ``deps``) of a tensor of ``shape`` and ``dtype``; ``keep`` as in `send_op`.

    A partly unknown ``shape`` is completed by a shape message (``shape_tag``) or, for a gradient,
    by the runtime shape of ``like`` (the tensor it is the gradient of).
    """
    np_dtype = dtype.as_numpy_dtype
    rank = len(shape)
    static = all(d is not None for d in shape)

    def recv(*inputs: Any) -> np.ndarray:
        if static:
            dims: tuple[int, ...] = tuple(int(d) for d in shape)  # type: ignore[arg-type]
        elif like is not None:
            dims = tuple(int(d) for d in inputs[-1])
        else:
            dims = tuple(int(d) for d in transport.recv((rank,), np.int64, src, shape_tag, f"shape of {what}"))
        return np.asarray(transport.recv(dims, np_dtype, src, tag, what), dtype=np_dtype).reshape(dims)

    inputs = list(deps) + ([tf.shape(like, out_type=tf.int64)] if like is not None and not static else [])
    with tf.control_dependencies([after] if after is not None else []):
        out = tf.numpy_function(recv, inputs, dtype, stateful=True, name="smp_recv")
    out.set_shape(shape)
    if keep is not None:
        independent(out, keep)
    return out


def _after(streams: dict[Any, tf.Tensor] | None, key: tuple[str, Any]) -> tf.Tensor | None:
    return None if streams is None or key[1] is None else streams.get(key)


def _follow(streams: dict[Any, tf.Tensor] | None, key: tuple[str, Any], got: tf.Tensor) -> None:
    if streams is not None and key[1] is not None:
        streams[key] = got


def _differentiable(dtype: tf.DType) -> bool:
    return bool(dtype.is_floating or dtype.is_complex)


def exchange(transport: Any, chain: tf.Tensor, sends: Sequence[tuple[tf.Tensor, Sequence[Send]]],
             recvs: Sequence[Recv], passthrough: Sequence[tf.Tensor] = (),
             anchors: Sequence[tf.Tensor] = (), keep: list[Any] | None = None,
             streams: dict[Any, tf.Tensor] | None = None, released: Sequence[bool] = ()
             ) -> tuple[tf.Tensor, list[tf.Tensor], list[tf.Tensor]]:
    """One crossing point on this rank.

    Args:
        transport: ``isend(array, dest, tag, what)`` / ``recv(shape, dtype, src, tag, what)``.
        chain: the previous exchange's chain output (or a zero scalar for the first).
        sends: each tensor to send with its destinations.
        recvs: the tensors to receive.
        passthrough: local tensors returned unchanged (the model outputs this rank computed);
            their gradient passes through.
        anchors: variable reads to connect to the loss; their gradient is zero.
        released: per anchor, whether its variable's storage is released on this rank (its zero
            gradient then has size zero); all False when not given.
        keep: None for transfers in program order (lockstep); a list that collects the
            `independent` transfer ops, forward and backward (overlap: `engine.schedule`).
        streams: with ``keep``: the last receive of each stream (``Recv.stream`` / ``Send.stream``);
            a receive starts after the previous one of its stream, so one thread per stream waits
            (each waiting receive polls MPI and takes the GIL: measured, 8-16 of them at once cost
            more than the overlap gained).

    Returns:
        (chain out, received tensors, passthrough tensors).
    """
    n_send, n_recv, n_pass = len(sends), len(recvs), len(passthrough)
    dests = [d for _, d in sends]
    released = list(released) or [False] * len(anchors)

    @tf.custom_gradient
    def op(*args: tf.Tensor) -> Any:
        chain_in = args[0]
        sent = args[1:1 + n_send]
        tokens = [send_op(transport, t, d.dest, d.tag, d.what, d.shape_tag, keep)
                  for t, ds in zip(sent, dests) for d in ds]
        received = []
        for r in recvs:
            got = recv_op(transport, r.shape, r.dtype, r.src, r.tag, r.what, [chain_in, *tokens],
                          shape_tag=r.shape_tag, keep=keep, after=_after(streams, ("f", r.stream)))
            _follow(streams, ("f", r.stream), got)
            received.append(got)
        with tf.control_dependencies([*tokens, *received]):
            chain_out = tf.identity(chain_in)
        passed = [tf.identity(t) for t in args[1 + n_send:1 + n_send + n_pass]]

        def grad(*ups: tf.Tensor | None) -> list[tf.Tensor | None]:
            d_chain = ups[0] if ups[0] is not None else tf.zeros((), chain_in.dtype)
            back = []
            for r, got, u in zip(recvs, received, ups[1:1 + n_recv]):
                if r.grad_tag is None or not _differentiable(r.dtype):
                    continue
                u = tf.zeros_like(got) if u is None else u
                back.append(send_op(transport, u, r.src, r.grad_tag, f"gradient of {r.what}", keep=keep))
            d_sent: list[tf.Tensor | None] = []
            for t, ds in zip(sent, dests):
                if not _differentiable(t.dtype):
                    d_sent.append(None)
                    continue
                # With overlap, chain_in keeps the op off Grappler's constants (d_chain may be a zero).
                deps = [d_chain, *back] if keep is None else [d_chain, chain_in, *back]
                parts = []
                for d in ds:
                    if d.grad_tag is None:
                        continue
                    part = recv_op(transport, tuple(t.shape.as_list()), t.dtype, d.dest, d.grad_tag,
                                   f"gradient of {d.what}", deps, like=t, keep=keep,
                                   after=_after(streams, ("g", d.stream)))
                    _follow(streams, ("g", d.stream), part)
                    parts.append(part)
                d_sent.append(tf.add_n(parts) if parts else tf.zeros_like(t))
            with tf.control_dependencies([*back, *[g for g in d_sent if g is not None]]):
                d_chain_in = tf.zeros_like(chain_in)
            d_pass = list(ups[1 + n_recv:1 + n_recv + n_pass])
            d_anchor = _unowned_gradients(args[1 + n_send + n_pass:], released, d_chain_in)
            return [d_chain_in, *d_sent, *d_pass, *d_anchor]

        return [chain_out, *received, *passed], grad

    outs = op(chain, *[t for t, _ in sends], *passthrough, *anchors)
    return outs[0], list(outs[1:1 + n_recv]), list(outs[1 + n_recv:])
