"""What each rank runs in the TensorFlow memory-share test (module level, for ``run_mpi_ranks``)."""

from __future__ import annotations

from typing import Any

import numpy as np

WIDTH, DEPTH, BATCH, MICROBATCHES = 64, 6, 8, 2


def held_share(pp: int, replicas: int, api: str, auto: bool, budget: int | None = None) -> dict[str, Any]:
    """One Adam step of a deep MLP; what this rank holds, counted from the variables' storage. With
    ``budget`` (``memory_per_rank``) too small: the error this rank raised, and whether any variable
    had a value by then."""
    import keras
    import smp.tensorflow as smp
    import tensorflow as tf
    from smp.tensorflow.residency import held_bytes, is_released

    from smp.errors import PartitionMemoryError

    smp.init({"pipeline_parallel_degree": pp, "microbatches": MICROBATCHES, "horovod": replicas > 1,
              "auto_partition": auto, "default_partition": 0,
              **({"memory_per_rank": budget} if budget is not None else {})})

    class Deep(smp.DistributedModel):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = [keras.layers.Dense(WIDTH, activation="tanh") for _ in range(DEPTH)]

        def call(self, x: Any) -> Any:
            for i, block in enumerate(self.blocks):
                with smp.partition(i * pp // DEPTH):
                    x = block(x)
            return x

    model = Deep()
    opt = keras.optimizers.Adam(1e-3)

    @smp.step
    def get_grads(x: Any) -> Any:
        if api == "tape":
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x)))
            grads = tape.gradient(loss, model.trainable_variables)
        else:
            loss = tf.reduce_mean(tf.square(model(x)))
            grads = opt.get_gradients(loss, model.trainable_variables)
        return grads, loss

    @tf.function
    def train_step(x: Any) -> Any:
        grads, loss = get_grads(x)
        grads = [g.accumulate() for g in grads]
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss.reduce_mean(), grads  # their sizes are read eagerly (tf.size would fold static shapes)

    x = np.random.default_rng(smp.dp_rank()).standard_normal((BATCH, WIDTH)).astype(np.float32)
    losses, sizes = [], []
    if budget is not None:
        try:
            train_step(x)
        except PartitionMemoryError as e:
            return {"error": str(e), "held": held_bytes(model.variables)}
        return {"error": None}
    for _ in range(2):
        loss, grad_sizes = train_step(x)
        losses.append(float(loss))
        sizes = [int(np.prod(g.shape)) for g in grad_sizes]
    full = [int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in model.variables]
    owned = [model.is_local_variable(v) for v in model.variables]
    slots = [v for v in opt.variables if len(v.shape) > 0]
    trainable_owned = [model.is_local_variable(v) for v in model.trainable_variables]
    return {
        "pp_rank": smp.pp_rank(), "losses": losses,
        "held": held_bytes(model.variables), "owned": sum(b for b, o in zip(full, owned) if o),
        "whole": sum(full), "released": [is_released(v) for v in model.variables], "owned_mask": owned,
        "slots": held_bytes(slots), "slot_count": len(slots),
        "trainable_owned_bytes": sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size
                                     for v, o in zip(model.trainable_variables, trainable_owned) if o),
        "check": model.memory_check(opt), "grad_sizes": sizes, "trainable_owned": trainable_owned,
        "trainable_sizes": [int(np.prod(v.shape)) for v in model.trainable_variables],
    }
