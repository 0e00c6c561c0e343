"""``save_model``: the unpartitioned model, as plain TensorFlow / Keras load it without smp.

Each variable lives on the pipeline stage that owns it (the others released its storage,
`model.residency`). `save_model` gathers each variable from its owner (the stages of DP rank 0's
pipeline; their replicas hold the same values) onto world rank 0, which gives them storage for the
export only, saves, and releases them again (a plain Keras model's own values are put back)::

    pp 1 (world 1)   owned values {2: ..., 3: ...} --send--> rank 0
    rank 0           hold 2, 3; save -> <save_path>; release 2, 3 again
    every rank       learns rank 0's outcome (a failure raises on every rank)

Formats: a path ending in ``.keras`` gets ``model.save`` (a Keras archive: ``keras.models.load_model``
loads it; a subclassed model's class must be registered with
``keras.saving.register_keras_serializable`` and importable where it is loaded); any other path a
SavedModel directory via ``model.export`` (endpoint ``serve``: ``tf.saved_model.load(path).serve(x)``
or ``keras.layers.TFSMLayer(path, call_endpoint="serve")``), which is what SMP v1's
``save_model`` wrote (reference section 4). ``export=`` replaces the SavedModel writer. Both formats
trace ``model(x)`` (Keras adds a ``serving_default`` function that calls the model); a model that
refuses calls outside a step (``DistributedModel``) passes ``whole_model=``, a context manager under
which ``model(x)`` runs the whole ``call()`` on this rank.

Writes are atomic: the model is written into ``.<name>.<id>.smp-staging`` next to ``save_path`` and
swapped in whole (smp/checkpoint/manifest.py, Note [save directory commit]); a process killed
while saving leaves the previous ``save_path`` as it was.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from smp.checkpoint.atomic import fsync_dir, makedirs
from smp.checkpoint.manifest import commit_directory, find_leftovers, new_save_id, staging_directory
from smp.errors import SMPCheckpointError
from smp.runtime import ranks

from ..residency import materialized
from .manager import _allgather, _outcome, _raise_failures

__all__ = ["save_model"]


def _signature(variables: Sequence[Any]) -> list[tuple[tuple[int, ...], str]]:
    return [(tuple(int(d) for d in v.shape), str(np.dtype(_numpy_dtype(v)))) for v in variables]


def _numpy_dtype(v: Any) -> Any:
    import tensorflow as tf

    return tf.as_dtype(v.dtype).as_numpy_dtype


def _owners(variables: Sequence[Any], owner_of: Callable[[int], int]) -> list[int]:
    n = ranks.pp_size()
    owners = []
    for i in range(len(variables)):
        o = owner_of(i)
        if isinstance(o, bool) or not isinstance(o, (int, np.integer)) or not 0 <= int(o) < n:
            raise SMPCheckpointError(
                f"save_model: owner_of({i}) (variable {getattr(variables[i], 'path', variables[i].name)!r}) returned "
                f"{o!r}; it must be a pipeline rank 0..{n - 1}. Fix: pass the partition's owner map")
        owners.append(int(o))
    return owners


def _write(model: Any, save_path: str, export: Callable[[Any, str], Any] | None,
           whole_model: Callable[[], AbstractContextManager[Any]] | None) -> None:
    """Rank 0: write ``model`` to ``save_path`` through a staging directory next to it."""
    save_path = os.path.abspath(save_path)
    parent, name = os.path.dirname(save_path), os.path.basename(save_path)
    if not name:
        raise SMPCheckpointError(f"save_model(save_path={save_path!r}): needs a file or directory name. "
                                 f"Fix: e.g. '/opt/ml/model' or 'model.keras'")
    makedirs(parent)
    for lo in find_leftovers(parent):
        if lo.final == name and lo.kind == "staging":
            shutil.rmtree(lo.path, ignore_errors=True)
    save_id = new_save_id()
    staging = staging_directory(parent, name, save_id)
    try:
        with whole_model() if whole_model is not None else contextlib.nullcontext():
            _write_staged(model, save_path, staging, save_id, export)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _write_staged(model: Any, save_path: str, staging: str, save_id: str,
                  export: Callable[[Any, str], Any] | None) -> None:
    """Write into ``staging``, then put it in place: a file renamed over ``save_path``, or the directory swapped in."""
    parent, name = os.path.dirname(save_path), os.path.basename(save_path)
    if name.endswith(".keras"):
        if os.path.isdir(save_path):
            raise SMPCheckpointError(f"save_model({save_path!r}): a directory of that name exists. Fix: remove it "
                                     f"or save to another path")
        makedirs(staging)
        inner = os.path.join(staging, name)
        model.save(inner)
        with open(inner, "rb") as f:
            os.fsync(f.fileno())
        os.replace(inner, save_path)
        fsync_dir(parent)
        shutil.rmtree(staging, ignore_errors=True)
        return
    if os.path.lexists(save_path) and not os.path.isdir(save_path):
        raise SMPCheckpointError(f"save_model({save_path!r}): a file of that name exists. Fix: remove it or "
                                 f"save to another path")
    if export is not None:
        export(model, staging)
    else:
        model.export(staging, verbose=False)
    old = commit_directory(parent, name, staging, save_id)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_model(model: Any, save_path: str = "/opt/ml/model", owner_of: Callable[[int], int] | None = None, *,
               export: Callable[[Any, str], Any] | None = None,
               whole_model: Callable[[], AbstractContextManager[Any]] | None = None) -> None:
    """Save the unpartitioned ``model`` to ``save_path`` (collective: call it on every rank).

    Args:
        model: a built Keras model, the same on every rank (same ``model.variables``, same order).
        save_path: ``*.keras`` for a Keras archive, anything else for a SavedModel directory.
        owner_of: ``owner_of(i)`` is the pipeline rank that owns ``model.variables[i]``; None: every
            variable is up to date on every rank (one stage).
        export: ``export(model, directory)`` writes the SavedModel instead of ``model.export``.
        whole_model: ``with whole_model():`` is entered on rank 0 around the save, so that
            ``model(x)`` runs the whole model there (a ``DistributedModel``'s export mode).

    Raises:
        SMPCheckpointError: the ranks hold different variables, ``owner_of`` gives no pipeline
            rank, or rank 0 could not save (on every rank, naming the cause).

    Example (every rank)::

        save_model(model, "/opt/ml/model", owner_of=lambda i: owners[i])
        loaded = tf.saved_model.load("/opt/ml/model")      # any process, no smp
        y = loaded.serve(x)
    """
    variables = list(model.variables)
    owners, err = _outcome(lambda: _owners(variables, owner_of) if owner_of is not None else [0] * len(variables))
    sig = _signature(variables)
    got = _allgather((sig, err), "save_model: the variables of every rank")
    _raise_failures([e for _, e in got], "save_model: reading the owner map", "nothing was saved")
    differ = [r for r, (s, _) in enumerate(got) if s != got[0][0]]
    if differ:
        first = next(i for i, (a, b) in enumerate(zip(got[0][0] + [None], got[differ[0]][0] + [None])) if a != b)
        raise SMPCheckpointError(
            f"save_model: ranks {differ} hold other variables than rank 0 ({len(got[differ[0]][0])} vs "
            f"{len(got[0][0])}; the first difference is variable {first}). Fix: build the same model on every rank "
            f"and call save_model after the first step")
    assert owners is not None
    from ..runtime import comm

    me, sources = ranks.rank(), ranks.get_pp_group(dp_rank=0)
    err = ""
    if me in sources and me != 0:
        mine = {i: np.asarray(variables[i].numpy()) for i, o in enumerate(owners) if o == ranks.pp_rank()}
        comm.send(mine, 0, comm.RankType.WORLD_RANK)
    elif me == 0:
        values: dict[int, np.ndarray] = {}
        for r in sources:
            if r != 0:
                values.update(comm.recv_from(r, comm.RankType.WORLD_RANK))

        def save() -> None:
            chosen = sorted(values)
            with materialized([variables[i] for i in chosen], [values[i] for i in chosen]):
                _write(model, save_path, export, whole_model)

        _, err = _outcome(save)
    done = _allgather((None, err), f"save_model: rank 0 saving {save_path}")
    _raise_failures([e for _, e in done], f"save_model({save_path!r})", "the previous model at that path is unchanged")
