"""``smp.CheckpointManager``: SMP v1's per-stage TensorFlow checkpoints, committed atomically across ranks.

A ``tf.train.CheckpointManager`` subclass with SMP v1's signature and directory layout: each
pipeline stage writes its own ``tf.train.Checkpoint`` under ``<directory>/mp_rank_<pp_rank>/``
(SMP v1's names), written by the stage's DP rank 0 only (its replicas hold the same values). smp adds
one file, ``newest``, the list of committed checkpoints that the torch frontend's save_checkpoint
layout also uses (smp/checkpoint/layout.py), so that every rank restores the same number::

    <directory>/
      newest                          committed checkpoints, oldest first: "ckpt-1\\nckpt-2\\n" (rank 0)
      mp_rank_0/                      pipeline stage 0 (SMP v1 layout)
        checkpoint                    TensorFlow's CheckpointState: tf.train.latest_checkpoint() works
        ckpt-2.index
        ckpt-2.data-00000-of-00001
      mp_rank_1/
        ...

Each stage holds only its own variables (the others' storage is released after partitioning,
`residency`), and a released variable writes and restores nothing: a stage's checkpoint holds its
own variables and their optimizer slots, as SMP v1's did, and each stage restores its own directory.

Note [TF checkpoint commit]: a save of ``ckpt-N`` never damages a committed checkpoint::

    every rank   N = save_counter + 1 (the same on every rank: checked), save id from rank 0
    writers      write ckpt-N into mp_rank_k/.ckpt-N.<id>.smp-staging/   (temp files stay in there)
    -- every rank learns every writer's outcome; any failure: staging removed, nothing changes,
       every rank raises SMPCheckpointError naming the rank --
    rank 0       only when ckpt-N is already listed (saved again): drop it from newest first
    writers      move ckpt-N.data-*, then ckpt-N.index, into mp_rank_k/
    -- outcomes again --
    rank 0       newest = ... + [ckpt-N], beyond max_to_keep dropped, written atomically (the commit)
    -- outcomes again --
    writers      delete the dropped checkpoints' files, update mp_rank_k/checkpoint

A rank killed (or a write that raises) anywhere before the commit leaves ``newest`` and every
checkpoint it lists exactly as they were; files of an uncommitted save are overwritten by the
next save of that number, and staging directories are removed by the next save of that stage.
The directory must be one file system that every rank sees (one host, or a shared mount).

Restores before the first step are deferred (as SMP v1 did it, through its post-partition hook):
the variables of a Keras model exist only once it has been called, so `CheckpointManager.restore`
before the first step returns a `DeferredRestore` and the restore runs once, when the first
``DistributedModel`` is partitioned (inside the first step's trace, before its first forward; Keras
optimizers in the checkpoint are built first, so their slots are restored too). After the first step
it restores at once. Before the first step with no DistributedModel constructed (a plain Keras model
in the step) it raises: nothing would run the deferred restore; restore after the first step.

Example (every rank runs the same lines)::

    ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer)
    manager = smp.CheckpointManager(ckpt, "/opt/ml/checkpoints", max_to_keep=3)
    manager.restore()                    # the newest committed checkpoint, if any: runs at partitioning
    for step, (x, y) in enumerate(data):
        train_step(x, y)
        if step % 100 == 0:
            manager.save()
"""

from __future__ import annotations

import collections
import glob
import logging
import os
import shutil
import time
import traceback
from collections.abc import Callable
from typing import Any

import tensorflow as tf

import smp.state as smp_state
from smp.checkpoint.atomic import atomic_write_text, fsync_dir, makedirs
from smp.checkpoint.layout import NEWEST, read_newest
from smp.checkpoint.manifest import clean_leftovers, new_save_id, staging_directory
from smp.errors import SMPCheckpointError
from smp.runtime import ranks

from ..state import tf_state

__all__ = ["CheckpointManager", "DeferredRestore", "rank_directory"]

logger = logging.getLogger("smp.checkpoint")


class DeferredRestore:
    """What `CheckpointManager.restore` returns before the first step: the restore, pending until partitioning.

    Attributes:
        done: whether the restore has run (at the first DistributedModel's partitioning).
        prefix: then, this stage's restored prefix (None: there was no checkpoint).
    """

    def __init__(self) -> None:
        self.done = False
        self.prefix: str | None = None

    def result(self) -> str | None:
        """This stage's restored prefix.

        Raises:
            SMPCheckpointError: the restore has not run yet (no step has partitioned a DistributedModel).
        """
        if not self.done:
            raise SMPCheckpointError("the deferred smp.CheckpointManager.restore() has not run yet: it runs when the "
                                     "first smp.step partitions the DistributedModel. Fix: run a step first")
        return self.prefix

    def __repr__(self) -> str:
        return f"DeferredRestore(done={self.done}, prefix={self.prefix!r})"


def _build_optimizers(checkpoint: tf.train.Checkpoint) -> None:
    """Build the unbuilt Keras optimizers among ``checkpoint``'s attributes on the partitioned model's variables.

    A deferred restore runs before the first ``apply_gradients``, when a Keras optimizer has no slot
    variables yet; built here (eagerly, as ``apply_gradients`` would build them), they are restored now.
    """
    import keras

    model = tf_state().model
    if model is None:
        return
    held = [v for v in model.trainable_variables if model.is_local_variable(v)]  # slots for this rank's only
    for obj in list(vars(checkpoint).values()):
        if isinstance(obj, keras.optimizers.Optimizer) and not obj.built:
            obj.build(held)


def rank_directory(directory: str, pp_rank: int) -> str:
    """``<directory>/mp_rank_<pp_rank>``: where pipeline stage ``pp_rank`` writes (SMP v1's name).

    Example:
        >>> rank_directory("/opt/ml/checkpoints", 1)
        '/opt/ml/checkpoints/mp_rank_1'
    """
    return os.path.join(directory, f"mp_rank_{pp_rank}")


# Waits for another rank's write or save (a large model's checkpoint can take longer than the usual
# comm_timeout); a peer that dies is still named at once (heartbeat), only a stalled one waits this long.
SAVE_TIMEOUT_S = 1800.0


def _allgather(obj: Any, what: str = "checkpoint agreement") -> list[Any]:
    """``obj`` of every world rank, by rank: failure-aware, waiting up to max(comm_timeout, `SAVE_TIMEOUT_S`)."""
    from smp.topology import GroupKind

    from ..runtime.init import runtime
    from ..runtime.mpi import allgather_objects

    rt = runtime()
    cfg = smp_state.current().cfg
    timeout = max(float(cfg.comm_timeout) if cfg is not None else 0.0, SAVE_TIMEOUT_S)
    return list(allgather_objects(rt.groups[GroupKind.WORLD], obj, f"smp checkpoint: {what}",
                                  rt.group_ranks[GroupKind.WORLD], timeout_s=timeout))


def _outcome(fn: Callable[[], Any]) -> tuple[Any, str]:
    """``(fn(), "")``, or ``(None, the formatted exception)`` when it raises."""
    try:
        return fn(), ""
    except Exception as e:  # noqa: BLE001 - every rank learns of the failure and raises together
        return None, "".join(traceback.format_exception_only(type(e), e)).strip() + "\n" + traceback.format_exc()


def _raise_failures(outcomes: list[str], what: str, committed: str) -> None:
    failed = [(r, err) for r, err in enumerate(outcomes) if err]
    if not failed:
        return
    first = failed[0][1].splitlines()[0]
    detail = "".join(f"\n--- rank {r}:\n{err}" for r, err in failed)
    raise SMPCheckpointError(
        f"{what} failed on rank(s) {[r for r, _ in failed]} ({first}); {committed}. Fix: see the error of each "
        f"rank below (disk full, permissions, a directory not shared by every rank){detail}")


def _data_files(prefix: str) -> list[str]:
    return sorted(glob.glob(glob.escape(prefix) + ".data-?????-of-?????"))


class CheckpointManager(tf.train.CheckpointManager):
    """SMP v1's ``smp.CheckpointManager``: save and restore a ``tf.train.Checkpoint`` on every rank.

    Call ``save()`` and ``restore()`` on every rank (they are collective). The layout and the
    commit protocol are in the module docstring (Note [TF checkpoint commit]).

    Args:
        checkpoint: the ``tf.train.Checkpoint`` to save (e.g. of the model and the optimizer).
        directory: the checkpoint directory, shared by every rank; stage k writes ``mp_rank_<k>/``.
        max_to_keep: keep the newest this many committed checkpoints (None: all).
        checkpoint_name: the file prefix (``ckpt`` -> ``ckpt-3.index``).

    Raises:
        NotInitializedError: before ``smp.init``.
        ValueError: ``max_to_keep`` is not a positive int or None.
    """

    def __init__(self, checkpoint: tf.train.Checkpoint, directory: str = "/opt/ml/checkpoints",
                 max_to_keep: int | None = None, checkpoint_name: str = "ckpt") -> None:
        pp = ranks.pp_rank()  # raises NotInitializedError before smp.init
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or isinstance(max_to_keep, bool)
                                        or max_to_keep <= 0):
            raise ValueError(f"smp.CheckpointManager(max_to_keep={max_to_keep!r}): must be a positive int or None "
                             f"(keep every checkpoint). Fix: e.g. max_to_keep=3")
        if not isinstance(checkpoint_name, str) or not checkpoint_name or "/" in checkpoint_name:
            raise ValueError(f"smp.CheckpointManager(checkpoint_name={checkpoint_name!r}): must be a non-empty file "
                             f"name prefix without '/'. Fix: e.g. checkpoint_name='ckpt'")
        directory = os.fspath(directory)
        # TF's own sweep stays off (max_to_keep=None): pruning happens only after the commit.
        super().__init__(checkpoint=checkpoint, directory=rank_directory(directory, pp), max_to_keep=None,
                         checkpoint_name=checkpoint_name)
        self._base_directory = directory
        self._keep = max_to_keep
        self._checkpoint_name = checkpoint_name
        self._load_committed(directory)

    # -- state -------------------------------------------------------------------------------------

    @property
    def base_directory(self) -> str:
        """The ``directory`` given; `directory` is this stage's ``mp_rank_<k>`` inside it (as in SMP v1)."""
        return self._base_directory

    def _load_committed(self, base: str) -> None:
        """Point `latest_checkpoint` / `checkpoints` at the committed list of ``base`` (``newest``)."""
        names = read_newest(base)
        if names:
            now = time.time()
            self._maybe_delete = collections.OrderedDict((os.path.join(self.directory, n), now) for n in names)
            self._latest_checkpoint = os.path.join(self.directory, names[-1])

    def _writer(self) -> bool:
        return ranks.dp_rank() == 0

    # -- save --------------------------------------------------------------------------------------

    def save(self, checkpoint_number: Any = None, check_interval: bool = True, options: Any = None) -> str | None:
        """Write checkpoint ``<checkpoint_name>-N`` of every stage and commit it (collective).

        ``N`` is ``checkpoint_number`` or ``checkpoint.save_counter`` after its increment (it is
        incremented either way, as in TensorFlow); it must be the same on every rank.

        Returns:
            This stage's checkpoint prefix, ``<directory>/mp_rank_<k>/ckpt-N``, on every rank.

        Raises:
            SMPCheckpointError: a rank failed to write or commit; nothing committed is changed
                (Note [TF checkpoint commit]); every rank raises it, naming the failed ranks.
        """
        if self._checkpoint_interval is not None:
            raise SMPCheckpointError("smp.CheckpointManager does not take checkpoint_interval (SMP v1's signature "
                                     "has none). Fix: call save() every N steps yourself")
        self._checkpoint.save_counter.assign_add(1)
        number = int(self._checkpoint.save_counter.numpy() if checkpoint_number is None
                     else (checkpoint_number.numpy() if hasattr(checkpoint_number, "numpy") else checkpoint_number))
        name = f"{self._checkpoint_name}-{number}"
        base, rank_dir, writer = self._base_directory, self.directory, self._writer()
        listed = read_newest(base) if ranks.rank() == 0 else []
        first = _allgather((number, new_save_id() if ranks.rank() == 0 else "", name in listed,
                            os.path.abspath(base)), f"starting the save of {name}")
        numbers, bases = [f[0] for f in first], [f[3] for f in first]
        if len(set(numbers)) != 1:
            raise SMPCheckpointError(
                f"smp.CheckpointManager.save(): the ranks would save different checkpoint numbers {numbers} (by "
                f"rank). Fix: call save() on every rank the same number of times, with the same checkpoint_number")
        if len(set(bases)) != 1:
            raise SMPCheckpointError(
                f"smp.CheckpointManager.save(): the ranks use different directories {bases} (by rank). Fix: pass "
                f"the same directory on every rank, on a file system every rank shares")
        save_id, relisted = first[0][1], first[0][2]
        staging = staging_directory(rank_dir, name, save_id)
        not_committed = f"nothing was committed ({os.path.join(base, NEWEST)} lists {listed or 'no checkpoint'})"

        def stage() -> None:
            makedirs(rank_dir)
            clean_leftovers(rank_dir)
            makedirs(staging)
            self._checkpoint.write(os.path.join(staging, name), options=options)

        _, err = _outcome(stage) if writer else (None, "")
        errors = [e for _, e in _allgather((None, err), f"writing {name}")]
        if any(errors):
            if writer:
                shutil.rmtree(staging, ignore_errors=True)
            _raise_failures(errors, f"writing checkpoint {name}", not_committed)
        if relisted:
            # ckpt-N is listed and about to be replaced file by file: unlist it first (the older ones stay).
            _, err = _outcome(lambda: self._write_newest(base, [n for n in listed if n != name])) \
                if ranks.rank() == 0 else (None, "")
            _raise_failures([e for _, e in _allgather((None, err), f"unlisting {name}")],
                            f"unlisting {name} before saving it again",
                            not_committed)

        def move() -> None:
            prefix = os.path.join(staging, name)
            for f in _data_files(prefix) + [prefix + ".index"]:  # the index last: it names the data files
                os.replace(f, os.path.join(rank_dir, os.path.basename(f)))
            fsync_dir(rank_dir)
            shutil.rmtree(staging)

        _, err = _outcome(move) if writer else (None, "")
        _raise_failures([e for _, e in _allgather((None, err), f"moving {name} into place")],
                        f"moving checkpoint {name} into place",
                        f"{name} was not committed")

        def commit() -> tuple[list[str], list[str]]:
            names = [n for n in listed if n != name] + [name]
            pruned: list[str] = []
            if self._keep is not None and len(names) > self._keep:
                pruned, names = names[:-self._keep], names[-self._keep:]
            self._write_newest(base, names)
            return names, pruned

        (names, pruned), err = _outcome(commit) if ranks.rank() == 0 else ((None, None), "")
        last = _allgather(((names, pruned), err), f"committing {name}")
        _raise_failures([e for _, e in last], f"committing checkpoint {name} to {os.path.join(base, NEWEST)}",
                        f"{name} was not committed")
        names, pruned = last[0][0]
        if writer:
            self._after_commit(names, pruned)
        self._load_committed(base)
        return os.path.join(rank_dir, name)

    @staticmethod
    def _write_newest(base: str, names: list[str]) -> None:
        atomic_write_text("".join(f"{n}\n" for n in names), os.path.join(base, NEWEST))

    def _after_commit(self, names: list[str], pruned: list[str]) -> None:
        """Delete the pruned checkpoints' files and point TensorFlow's CheckpointState at the committed list."""
        for n in pruned:
            prefix = os.path.join(self.directory, n)
            for f in [prefix + ".index"] + _data_files(prefix):
                try:
                    os.unlink(f)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    logger.warning("could not delete %s of dropped checkpoint %s (max_to_keep=%s): %s", f, n,
                                   self._keep, e)
        self._load_committed(self._base_directory)
        try:
            self._record_state()  # tf.train.CheckpointManager's own writer of the CheckpointState (atomic)
        except Exception as e:  # noqa: BLE001 - the save is committed; only TF's index of it is stale
            logger.warning("checkpoint %s is committed, but %s could not be updated (%s): "
                           "tf.train.latest_checkpoint(%r) may name an older one", names[-1],
                           os.path.join(self.directory, "checkpoint"), e, self.directory)

    # -- restore -----------------------------------------------------------------------------------

    def restore(self, restore_path: str | None = None,
                restore_prefix: str | None = None) -> str | DeferredRestore | None:
        """Restore the newest committed checkpoint (or ``restore_prefix``) into every rank (collective).

        Each stage reads its own ``mp_rank_<k>/``; every rank restores the same number, the one rank
        0 read from ``newest``. A directory without ``newest`` (written by SMP v1) restores the
        latest checkpoint of ``mp_rank_0`` (TensorFlow's CheckpointState) if every stage has it.

        Args:
            restore_path: a checkpoint directory other than this manager's.
            restore_prefix: a checkpoint name such as ``"ckpt-5"`` instead of the newest.

        Before the first step the restore is deferred to the first DistributedModel's partitioning
        (module docstring); its errors are then raised by that step.

        Returns:
            This stage's restored prefix; None (on every rank, with a warning) when there is no
            checkpoint; before the first step a `DeferredRestore` that holds it once it has run.

        Raises:
            SMPCheckpointError: before the first step with no DistributedModel constructed;
                ``restore_prefix`` is not committed; a stage lacks its files or cannot read them
                (every rank raises, naming the ranks).
        """
        if tf_state().step_traces <= 0:
            from ..model.hooks import model_constructed, run_after_partitioning

            if not model_constructed():
                raise SMPCheckpointError(
                    "smp.CheckpointManager.restore() before the first step, with no smp.DistributedModel built: a "
                    "restore before the first step is deferred until a DistributedModel is partitioned, so without one "
                    "it would never run. Fix: build the DistributedModel first, or restore after the first step "
                    "(the step's updates are then replaced by the checkpoint's values)")
            pending = DeferredRestore()

            def deferred() -> None:
                _build_optimizers(self._checkpoint)
                pending.prefix = self.restore(restore_path, restore_prefix)  # type: ignore[assignment]
                pending.done = True

            run_after_partitioning(deferred)
            logger.info("smp.CheckpointManager.restore() before the first step: deferred until the model is "
                        "partitioned (first step, before its first forward)")
            return pending
        base = os.fspath(restore_path) if restore_path is not None else self._base_directory
        own = rank_directory(base, ranks.pp_rank())

        def choose() -> str | None:
            names = read_newest(base)
            if restore_prefix is not None:
                if names and restore_prefix not in names:
                    raise SMPCheckpointError(f"restore_prefix={restore_prefix!r} is not a committed checkpoint of "
                                             f"{base}: {os.path.join(base, NEWEST)} lists {names}. Fix: pass one of them")
                return restore_prefix
            if names:
                return names[-1]
            latest = tf.train.latest_checkpoint(rank_directory(base, 0))
            return os.path.basename(latest) if latest else None

        chosen, err = _outcome(choose) if ranks.rank() == 0 else (None, "")
        got = _allgather((chosen, err), "choosing the checkpoint to restore")
        _raise_failures([e for _, e in got], f"choosing the checkpoint to restore from {base}", "nothing was restored")
        name = got[0][0]
        if name is None:
            logger.warning("smp.CheckpointManager.restore(): no checkpoint in %s (no %s); nothing restored", base,
                           NEWEST)
            return None
        prefix = os.path.join(own, name)

        def load() -> None:
            if not os.path.isfile(prefix + ".index"):
                have = sorted(f[:-len(".index")] for f in os.listdir(own) if f.endswith(".index")) \
                    if os.path.isdir(own) else []
                raise SMPCheckpointError(
                    f"checkpoint {name} of pipeline stage {ranks.pp_rank()} is missing: {prefix}.index does not exist "
                    f"({own} has {have}). Fix: restore with the pipeline degree the checkpoint was saved with, from "
                    f"the directory every rank shares")
            # Partial on purpose (SMP v1 did the same): optimizer slots made after a save are not in it.
            self._checkpoint.restore(prefix).assert_nontrivial_match().expect_partial()

        _, err = _outcome(load)
        _raise_failures([e for _, e in _allgather((None, err), f"restoring {name}")],
                        f"restoring checkpoint {name} from {base}",
                        "the ranks may now hold different checkpoints' values: restore again")
        logger.info("restored checkpoint %s", prefix)
        return prefix
