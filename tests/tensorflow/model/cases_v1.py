"""What each rank runs in the SMP v1-script tests (module level, so ``run_mpi_ranks`` finds it by name).

`dp_launch` (pp2 x dp2): an SMP v1-style script (``optimizer.get_gradients``, never
``optimizers.install()``) trains the tied LM with ``horovod: True``, different data per replica,
saves a checkpoint and ``model.save_model`` after step 3, trains steps 4-5; then ``smp.reset()`` and
the same 3 steps with ``ddp: True``. World rank 0 also trains the same model in one process on the
combined batch (the reference). `restore_launch` (pp2, a fresh job): ``restore()`` before the
first step, then steps 4-5. This module imports no TensorFlow or Keras at import time, so
`restore_launch` can check that ``smp.init`` ran before Keras was imported.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

STEPS, SAVE_AFTER, MB_BATCH, MICROBATCHES, REPLICAS = 5, 3, 4, 2, 2
NAME = "tied_lm"


def config(pp: int, **extra: Any) -> dict[str, Any]:
    return {"pipeline_parallel_degree": pp, "microbatches": MICROBATCHES, "auto_partition": False,
            "default_partition": 0, **extra}


def data(step: int, replica: int) -> tuple[np.ndarray, np.ndarray]:
    """Replica ``replica``'s batch of step ``step`` (MICROBATCHES x MB_BATCH sequences)."""
    from .models import SEQ, VOCAB

    rng = np.random.default_rng(1000 * replica + step)
    shape = (MICROBATCHES * MB_BATCH, SEQ)
    return rng.integers(0, VOCAB, shape).astype(np.int32), rng.integers(0, VOCAB, shape).astype(np.int32)


def probe() -> np.ndarray:
    """The input the saved model is evaluated on."""
    return data(99, 0)[0][:MB_BATCH]


def _reference(ref: Any, steps: int) -> dict[str, Any]:
    """One process on the combined batch: the mean of every replica's microbatch gradients, Adam."""
    import keras
    import tensorflow as tf

    opt = keras.optimizers.Adam(1e-2)
    loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    losses, out = [], {}
    for s in range(steps):
        grads, replica_losses = None, []
        for r in range(REPLICAS):
            x, y = data(s, r)
            total = 0.0
            for m in range(MICROBATCHES):
                sl = slice(m * MB_BATCH, (m + 1) * MB_BATCH)
                with tf.GradientTape() as tape:
                    loss = loss_obj(y[sl], ref(x[sl]))
                g = [tf.convert_to_tensor(t) for t in tape.gradient(loss, ref.trainable_variables)]
                grads = g if grads is None else [a + b for a, b in zip(grads, g)]
                total += float(loss)
            replica_losses.append(total / MICROBATCHES)
        opt.apply_gradients(zip([g / (REPLICAS * MICROBATCHES) for g in grads], ref.trainable_variables))
        losses.append(replica_losses)
        if s + 1 == SAVE_AFTER:
            out["vars"] = [v.numpy() for v in ref.variables]
            out["probe_out"] = ref(probe()).numpy()
    out["losses"] = losses  # [step][replica]
    return out


def _train(smp: Any, directory: str | None, steps: int) -> dict[str, Any]:
    """Build the tied LM as a DistributedModel and train it SMP v1 style (see the module docstring)."""
    import keras
    import smp.tensorflow.horovod as hvd
    import tensorflow as tf

    from . import cases
    from .models import MODELS

    pp = smp.pp_size()
    keras.utils.set_random_seed(0)
    ref = MODELS[NAME](keras.Model, pp)()
    ref.compute_output_spec(keras.KerasTensor((MB_BATCH, data(0, 0)[0].shape[1]), "int32"))
    cases._PENDING.update(model=None, values=[v.numpy() for v in ref.variables])
    model = MODELS[NAME](smp.DistributedModel, pp)()
    cases._PENDING["model"] = model
    if cases._hook not in cases._registered:
        smp.register_post_partition_hook(cases._hook)
        cases._registered.append(cases._hook)
    opt = keras.optimizers.Adam(1e-2)
    loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    manager = None
    if directory is not None:
        manager = smp.CheckpointManager(tf.train.Checkpoint(model=model, optimizer=opt),
                                        os.path.join(directory, "ckpts"))

    @smp.step
    def get_grads(x: Any, y: Any) -> Any:
        loss = loss_obj(y, model(x))
        return opt.get_gradients(loss, model.trainable_variables), loss

    @tf.function
    def train_step(x: Any, y: Any) -> Any:
        grads, loss = get_grads(x, y)
        grads = [g.accumulate() for g in grads]
        again = [hvd.allreduce(g) for g in grads]
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss.reduce_mean(), tf.reduce_max([tf.reduce_max(tf.abs(a - g)) for a, g in zip(again, grads)])

    out: dict[str, Any] = {"losses": [], "hvd_changed": [], "pp_rank": smp.pp_rank(), "dp_rank": smp.dp_rank()}
    for s in range(steps):
        loss, changed = train_step(*[tf.constant(a) for a in data(s, smp.dp_rank())])
        out["losses"].append(float(loss))
        out["hvd_changed"].append(float(changed))
        if s + 1 == SAVE_AFTER:
            out["owned"] = {i: v.numpy() for i, v in enumerate(model.variables) if model.is_local_variable(v)}
            if directory is not None:
                out["saved_ckpt"] = manager.save()
                model.save_model(os.path.join(directory, "saved"))
    out["stages"] = model.stage_plan().describe()
    if smp.rank() == 0:
        out["ref"] = _reference(ref, steps)
    return out


def dp_launch(directory: str) -> dict[str, Any]:
    """pp2 x dp2: ``horovod: True`` (with checkpoint and save_model), then ``ddp: True`` (see the module docstring)."""
    import keras  # noqa: F401 - imported before smp.init: init installs get_gradients
    import smp.tensorflow as smp
    from smp.tensorflow import optimizers

    smp.init(config(2, horovod=True))
    out: dict[str, Any] = {"installed_at_init": optimizers.installed()}
    out["horovod"] = _train(smp, directory, STEPS)
    smp.reset()
    out["uninstalled_at_reset"] = not optimizers.installed()
    smp.init(config(2, ddp=True))
    out["ddp"] = _train(smp, None, SAVE_AFTER)
    return out


def restore_launch(directory: str) -> dict[str, Any]:
    """A fresh pp2 job: ``restore()`` before the first step (deferred), then steps 4 and 5 of `dp_launch`."""
    import smp.tensorflow as smp

    smp.init(config(2))
    out: dict[str, Any] = {"keras_before_model": "keras" in sys.modules}
    import keras
    import tensorflow as tf
    from smp.tensorflow import optimizers

    from .models import MODELS

    keras.utils.set_random_seed(1)  # other initial values than dp_launch's: the restore must replace them
    model = MODELS[NAME](smp.DistributedModel, 2)()
    out["installed_by_model"] = optimizers.installed()
    opt = keras.optimizers.Adam(1e-2)
    loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    manager = smp.CheckpointManager(tf.train.Checkpoint(model=model, optimizer=opt), os.path.join(directory, "ckpts"))
    status = manager.restore()
    out["status_before"] = repr(status)

    @smp.step
    def get_grads(x: Any, y: Any) -> Any:
        loss = loss_obj(y, model(x))
        return opt.get_gradients(loss, model.trainable_variables), loss

    @tf.function
    def train_step(x: Any, y: Any) -> Any:
        grads, loss = get_grads(x, y)
        opt.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
        return loss.reduce_mean()

    out["losses"] = []
    for s in range(SAVE_AFTER, STEPS):
        out["losses"].append(float(train_step(*[tf.constant(a) for a in data(s, 0)])))
        if s == SAVE_AFTER:
            out["status_after"] = repr(status)
            out["iterations"] = int(opt.iterations.numpy())
    return out
