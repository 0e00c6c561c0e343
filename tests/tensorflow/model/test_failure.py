"""A failure on a follower during pipelined training ends every rank within seconds, naming it.

Rank 1 raises between two steps of a pp2 DistributedModel while rank 0 is inside the next step,
waiting in the engine's exchange op (a ``tf.numpy_function`` receive) for rank 1's activations'
gradient or output: rank 0 must stop with rank 1's error (TensorFlow wraps it in its own
``UnknownError``; the exit guard names what is behind it), and the job must end.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import pytest

from tests.helpers.mpi_spawn import run_mpi_ranks

pytestmark = pytest.mark.mpi


def train_then_fail(stamp_dir: str, faulty: int = 1, mode: str = "raise", **config: Any) -> None:
    """pp2 MLP training (``config`` added: ``ddp`` for pp2 x dp2); rank ``faulty`` raises (or freezes:
    ``mode="freeze"``) between steps 1 and 2 while the others are inside step 2."""
    import signal

    import keras
    import numpy as np
    import smp.tensorflow as smp
    import tensorflow as tf

    from .models import mlp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False,
              "default_partition": 0, "comm_timeout": 60, **config})
    keras.utils.set_random_seed(0)
    model = mlp(smp.DistributedModel, 2)()
    opt = keras.optimizers.Adam(1e-2)
    loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @smp.step
    def get_grads(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_obj(y, model(x))
        return tape.gradient(loss, model.trainable_variables), loss

    @tf.function
    def train_step(x: Any, y: Any) -> Any:
        grads, loss = get_grads(x, y)
        opt.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
        return loss.reduce_mean()

    rng = np.random.default_rng(smp.dp_rank())
    x = tf.constant(rng.standard_normal((8, 6)).astype(np.float32))
    y = tf.constant(rng.integers(0, 4, (8,)).astype(np.int32))
    for step in range(3):
        if step == 2 and smp.rank() == faulty:
            time.sleep(0.5)  # the others are inside step 2, waiting on this rank
            with open(os.path.join(stamp_dir, "fault"), "w") as f:
                f.write(repr(time.time()))
            if mode == "freeze":
                os.kill(os.getpid(), signal.SIGSTOP)
            raise ValueError(f"rank {faulty} fails between steps on purpose")
        float(train_step(x, y))


def test_exception_on_a_follower_mid_training_ends_every_rank_naming_it(tmp_path: Any) -> None:
    run = run_mpi_ranks(train_then_fail, 2, args=(str(tmp_path),), timeout=180, expect_failure=True)
    with open(os.path.join(str(tmp_path), "fault")) as f:
        took = time.time() - float(f.read())
    rank0, rank1 = run.outcomes
    assert rank1.status == "error" and "ValueError: rank 1 fails between steps on purpose" in rank1.traceback
    assert rank0.status == "error", rank0
    assert re.search(r"RemoteRankError: rank 1 \(pp_rank 1, rdp_rank 0; pid \d+ on host .+\) failed:",
                     rank0.traceback), rank0.traceback
    assert "rank 1 fails between steps on purpose" in rank0.traceback  # with rank 1's traceback
    assert "[smp rank 0] ERROR stopping: rank 1 failed (RemoteRankError)" in run.output, run.tail()
    assert not run.killed and run.returncode != 0, (run.returncode, run.tail())
    assert took < 15, f"the job ended {took:.1f} s after rank 1 raised"
