"""smp.CheckpointManager at 2 ranks (pp2) and 4 ranks (pp2 x dp2): save, prune, a failing write, SIGKILL mid-save, restore.

Each rank trains a plain Keras model with ``@smp.step`` on data of its own pipeline stage (so the
stages hold different values, as a partitioned model's stages do) and checkpoints it. Launch 1
saves, prunes, survives a write that raises on rank 1, records the values of checkpoint 3 and the
losses that follow it, then rank 1 SIGKILLs itself in the middle of writing checkpoint 5. Launch 2
(a fresh job) restores: the newest committed checkpoint is 3 on every rank, the variables are
checkpoint 3's exactly and the next losses equal launch 1's bit for bit.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest

from tests.helpers.mpi_spawn import run_mpi_ranks

pytestmark = pytest.mark.mpi

BATCH = 8


def _setup(config: dict[str, Any]) -> Any:
    import keras
    import smp.tensorflow as smp
    import tensorflow as tf
    from smp.tensorflow.step import step

    smp.init(config)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    model(np.zeros((1, 4), np.float32))
    opt = keras.optimizers.Adam(0.05)
    loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @step
    def grads_fn(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_obj(y, model(x))
        return tape.gradient(loss, model.trainable_variables), loss

    @tf.function
    def train(x: Any, y: Any) -> Any:
        grads, loss = grads_fn(x, y)
        opt.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
        return loss.reduce_mean()

    def run(step_no: int) -> float:
        # data of this stage and replica: the stages (and replicas) hold different values
        rng = np.random.default_rng(1000 * step_no + 10 * smp.pp_rank() + smp.dp_rank())
        x = rng.standard_normal((BATCH, 4)).astype(np.float32)
        y = rng.integers(0, 3, BATCH).astype(np.int32)
        return float(train(tf.constant(x), tf.constant(y)))

    ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
    return smp, model, opt, ckpt, run


def _values(model: Any, opt: Any) -> list[list[float]]:
    return [np.asarray(v.numpy(), np.float64).ravel().tolist() for v in model.variables + opt.variables]


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares the messages
        return f"{type(e).__name__}: {e}"
    return "no error"


def first_launch(directory: str) -> None:
    import signal

    import tensorflow as tf

    smp, model, opt, ckpt, run = _setup({"partitions": 2, "microbatches": 2})
    r = smp.rank()
    out: dict[str, Any] = {}
    manager = smp.CheckpointManager(ckpt, directory, max_to_keep=2)
    out["early_restore"] = _error(manager.restore)
    run(1)
    out["restore_nothing"] = manager.restore()
    saved = [manager.save()]
    run(2)
    run(3)
    saved.append(manager.save())
    run(4)
    saved.append(manager.save())
    own = os.path.join(directory, f"mp_rank_{smp.pp_rank()}")
    out["saved"] = saved
    out["newest"] = open(os.path.join(directory, "newest")).read().split()
    out["files"] = sorted(f for f in os.listdir(own))
    out["tf_latest"] = tf.train.latest_checkpoint(own)
    out["checkpoints"] = manager.checkpoints
    out["values_ckpt3"] = _values(model, opt)
    # a write that raises on rank 1: every rank raises, nothing committed changes
    real_write = ckpt.write
    if r == 1:
        def broken(*args: Any, **kwargs: Any) -> Any:
            raise OSError(28, "No space left on device (test)")
        ckpt.write = broken
    out["failed_save"] = _error(manager.save)
    ckpt.write = real_write
    out["newest_after_failure"] = open(os.path.join(directory, "newest")).read().split()
    out["leftovers_after_failure"] = sorted(f for f in os.listdir(own) if f.startswith("."))
    # the losses that follow checkpoint 3 (the failed save changed no variable; save_counter is not compared)
    out["losses_after_ckpt3"] = [run(5), run(6)]
    with open(os.path.join(directory, f"record_rank{r}.json"), "w") as f:
        json.dump(out, f)
    smp.barrier()
    # rank 1 dies in the middle of writing checkpoint 5: its data file is on disk, its index is not
    if r == 1:
        def killed(prefix: str, options: Any = None) -> Any:
            path = real_write(prefix, options=options)
            os.unlink(path + ".index")
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.write = killed
    manager.save()
    raise AssertionError("save() returned although rank 1 was killed in the middle of it")


def second_launch(directory: str) -> dict[str, Any]:
    import tensorflow as tf

    smp, model, opt, ckpt, run = _setup({"partitions": 2, "microbatches": 2})
    own = os.path.join(directory, f"mp_rank_{smp.pp_rank()}")
    out: dict[str, Any] = {"leftovers_before": sorted(f for f in os.listdir(own) if f.startswith("."))}
    manager = smp.CheckpointManager(ckpt, directory, max_to_keep=2)
    out["latest_before_restore"] = manager.latest_checkpoint
    run(1)  # the first step; restore replaces its updates
    out["restored"] = manager.restore()
    out["values"] = _values(model, opt)
    out["losses"] = [run(5), run(6)]
    out["bad_prefix"] = _error(lambda: manager.restore(restore_prefix="ckpt-1"))
    out["resaved"] = manager.save()
    out["newest_after_resave"] = open(os.path.join(directory, "newest")).read().split()
    out["leftovers_after_resave"] = sorted(f for f in os.listdir(own) if f.startswith("."))
    out["files_after_resave"] = sorted(f for f in os.listdir(own) if not f.startswith("."))
    # an explicit older committed checkpoint
    out["restored_prefix"] = manager.restore(restore_prefix="ckpt-3")
    # a directory SMP v1 wrote (plain tf.train.CheckpointManager per mp_rank_<k>, no newest file)
    v1 = directory + "_v1"
    tf.train.CheckpointManager(ckpt, os.path.join(v1, f"mp_rank_{smp.pp_rank()}"), max_to_keep=None).save()
    v1_values = _values(model, opt)
    run(7)
    out["v1_restored"] = manager.restore(restore_path=v1)
    out["v1_values_back"] = _values(model, opt) == v1_values
    return out


def test_save_prune_failure_kill_and_restore(tmp_path: Any) -> None:
    directory = str(tmp_path / "ckpt")
    run1 = run_mpi_ranks(first_launch, 2, args=(directory,), timeout=180, expect_failure=True)
    assert run1.returncode != 0, run1.tail()
    assert all(o.status != "ok" for o in run1.outcomes), run1.tail()
    records = []
    for r in range(2):
        assert os.path.exists(os.path.join(directory, f"record_rank{r}.json")), (
            f"rank {r} did not get to the kill: {[o.traceback for o in run1.outcomes]}\n{run1.tail()}")
        with open(os.path.join(directory, f"record_rank{r}.json")) as f:
            records.append(json.load(f))
    for r, rec in enumerate(records):
        own = os.path.join(directory, f"mp_rank_{r}")
        assert rec["early_restore"].startswith("SMPCheckpointError") and "after the first step" in rec["early_restore"]
        assert rec["restore_nothing"] is None
        assert rec["saved"] == [os.path.join(own, f"ckpt-{n}") for n in (1, 2, 3)]
        assert rec["newest"] == ["ckpt-2", "ckpt-3"]  # max_to_keep=2 pruned ckpt-1 ...
        assert rec["files"] == ["checkpoint", "ckpt-2.data-00000-of-00001", "ckpt-2.index",
                                "ckpt-3.data-00000-of-00001", "ckpt-3.index"]  # ... and its files
        assert rec["tf_latest"] == os.path.join(own, "ckpt-3")
        assert rec["checkpoints"] == [os.path.join(own, "ckpt-2"), os.path.join(own, "ckpt-3")]
        assert rec["failed_save"].startswith("SMPCheckpointError") and "rank(s) [1]" in rec["failed_save"]
        assert "No space left on device (test)" in rec["failed_save"]
        assert rec["newest_after_failure"] == ["ckpt-2", "ckpt-3"]
        assert rec["leftovers_after_failure"] == []
    # the stages hold different values (each trained on its own data)
    assert records[0]["values_ckpt3"] != records[1]["values_ckpt3"]
    # the kill left checkpoint 5 uncommitted: newest unchanged, its files only in staging
    assert open(os.path.join(directory, "newest")).read().split() == ["ckpt-2", "ckpt-3"]
    assert not os.path.exists(os.path.join(directory, "mp_rank_1", "ckpt-5.index"))
    assert any(f.startswith(".ckpt-5.") for f in os.listdir(os.path.join(directory, "mp_rank_1")))

    run2 = run_mpi_ranks(second_launch, 2, args=(directory,), timeout=180)
    for r, (rec, out) in enumerate(zip(records, run2)):
        own = os.path.join(directory, f"mp_rank_{r}")
        assert out["leftovers_before"], "the killed save left its staging directory"
        assert out["latest_before_restore"] == os.path.join(own, "ckpt-3")
        assert out["restored"] == os.path.join(own, "ckpt-3")
        assert out["values"] == rec["values_ckpt3"]  # bit for bit, optimizer state included
        assert out["losses"] == rec["losses_after_ckpt3"]
        assert out["bad_prefix"].startswith("SMPCheckpointError") and "['ckpt-2', 'ckpt-3']" in out["bad_prefix"]
        assert out["resaved"] == os.path.join(own, "ckpt-4")  # save_counter came back with checkpoint 3
        assert out["newest_after_resave"] == ["ckpt-3", "ckpt-4"]
        assert out["leftovers_after_resave"] == []  # the killed save's staging directory is gone
        assert out["files_after_resave"] == ["checkpoint", "ckpt-3.data-00000-of-00001", "ckpt-3.index",
                                             "ckpt-4.data-00000-of-00001", "ckpt-4.index"]
        assert out["restored_prefix"] == os.path.join(own, "ckpt-3")
        assert out["v1_restored"] == os.path.join(directory + "_v1", f"mp_rank_{r}", "ckpt-4")
        assert out["v1_values_back"]


def dp_launch(directory: str) -> dict[str, Any]:
    smp, model, opt, ckpt, run = _setup({"partitions": 2, "microbatches": 1, "horovod": True})
    manager = smp.CheckpointManager(ckpt, directory)
    run(1)
    before = _values(model, opt)
    manager.save()
    run(2)  # replicas drift apart (each trains on its own data, no averaging in this plain model)
    manager.restore()
    return {"pp": smp.pp_rank(), "dp": smp.dp_rank(), "before": before, "after": _values(model, opt),
            "listing": sorted(os.listdir(directory))}


def test_pp2_dp2_only_dp_rank_0_writes_and_every_replica_restores_it(tmp_path: Any) -> None:
    directory = str(tmp_path / "ckpt")
    got = run_mpi_ranks(dp_launch, 4, args=(directory,), timeout=240)
    for out in got:
        writer = next(o for o in got if o["pp"] == out["pp"] and o["dp"] == 0)
        assert out["after"] == writer["before"]  # the stage's DP rank 0 values, on every replica
        if out["dp"] != 0:
            assert out["before"] != writer["before"]  # its own values were different: not what was saved
        assert out["listing"] == ["mp_rank_0", "mp_rank_1", "newest"]
