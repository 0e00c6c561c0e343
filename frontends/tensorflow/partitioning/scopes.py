"""``with smp.partition(i):`` inside ``call()``: a marked ``tf.name_scope`` the partitioner reads back.

Every op created in the block carries ``smp_partition_<i>`` in its name; `scope_partition` finds
the innermost (last) marker of an op name. The index is checked against the pipeline size with the
core's rules (`smp.partition.PartitionScopes`); under ``auto_partition`` the block opens no scope
and the model's scopes object logs once that it is ignored.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import tensorflow as tf

import smp.state as smp_state
from smp.partition import PartitionScopes

from ..state import tf_state

__all__ = ["partition"]

MARKER = "smp_partition_"
_MARKER_RE = re.compile(r"(?:^|/)" + MARKER + r"(\d+)(?:_\d+)?(?=/)")


def _scopes() -> PartitionScopes | None:
    """The scopes object of the model being traced (it logs the auto rule once), else a fresh one."""
    model = tf_state().model
    scopes = getattr(model, "_smp_scopes", None)
    if isinstance(scopes, PartitionScopes):
        return scopes
    cfg = smp_state.current().cfg
    return None if cfg is None else PartitionScopes.from_settings(cfg.partition_section())


@contextlib.contextmanager
def partition(index: int) -> Iterator[None]:
    """Place the ops created inside the block on pipeline rank ``index`` (SMP v1 TF semantics).

    Use it inside ``DistributedModel.call``. Nested blocks: the innermost wins; ops outside every
    block go to ``default_partition``. Ignored (one log line) when ``auto_partition`` is True.

    Args:
        index: the partition, an int in ``[0, pipeline_parallel_degree)``.

    Raises:
        InvalidPartitionIDError: ``index`` is out of range or not an int.

    Example:
        >>> class Model(smp.DistributedModel):
        ...     def call(self, x):
        ...         with smp.partition(0):
        ...             h = self.d1(x)
        ...         with smp.partition(1):
        ...             return self.d2(h)
    """
    scopes = _scopes()
    if scopes is None:
        # Before smp.init the only check possible is the type; call() runs inside a step anyway.
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise TypeError(f"smp.partition index must be an int >= 0, got {index!r}")
        with tf.name_scope(f"{MARKER}{index}"):
            yield
        return
    with scopes.partition(index):
        if scopes.auto_partition:
            yield
            return
        with tf.name_scope(f"{MARKER}{index}"):
            yield


def scope_partition(op_name: str) -> int | None:
    """The innermost ``smp.partition`` index in an op name, or None when the op is in no block.

    Example:
        >>> scope_partition("m_1/smp_partition_0/blk/smp_partition_1/dense/MatMul")
        1
        >>> scope_partition("m_1/dense/MatMul") is None
        True
    """
    found = _MARKER_RE.findall(op_name)
    return int(found[-1]) if found else None
