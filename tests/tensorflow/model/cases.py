"""What each rank runs in the DistributedModel tests (module level, so ``run_mpi_ranks`` finds it by name).

`train` builds one model of `models.MODELS` twice: as a DistributedModel trained through
``@smp.step`` inside an outer ``@tf.function`` that calls ``optimizer.apply_gradients``, and (on
pp rank 0) as a plain Keras model trained in one process on the same microbatches, from the same
initial values (a post-partition hook copies them in). It returns plain numbers and numpy arrays;
the test compares them.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

STEPS, BATCH, MICROBATCHES = 3, 16, 4
_PENDING: dict[str, Any] = {}
_HOOK_RUNS: list[int] = []


def _hook() -> None:
    """The post-partition hook: the reference's initial values into the model being partitioned (if `train` set one)."""
    if "model" not in _PENDING:
        return
    _HOOK_RUNS.append(1)
    model, values = _PENDING.pop("model"), _PENDING.pop("values")
    for v, a in zip(model.variables, values):
        v.assign(a)


def _data(name: str, step: int) -> tuple[np.ndarray, np.ndarray]:
    from .models import SEQ, VOCAB

    rng = np.random.default_rng(100 + step)
    if name == "tied_lm":
        return (rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32),
                rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32))
    if name == "cnn":  # MNIST-shaped, smaller: (batch, 12, 12, 1) images, 4 classes
        return rng.standard_normal((BATCH, 12, 12, 1)).astype(np.float32), rng.integers(0, 4, (BATCH,)).astype(np.int32)
    return rng.standard_normal((BATCH, 6)).astype(np.float32), rng.integers(0, 4, (BATCH,)).astype(np.int32)


def _reference(ref: Any, name: str, kwargs: dict[str, Any]) -> tuple[list[float], list[np.ndarray], float]:
    """Plain Keras in this process: per microbatch forward + tape, mean of the gradients, Adam."""
    import keras
    import tensorflow as tf

    opt = keras.optimizers.Adam(1e-2)
    loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    mb = BATCH // MICROBATCHES
    losses, t0 = [], 0.0
    for s in range(STEPS):
        if s == 1:
            t0 = time.perf_counter()
        x, y = _data(name, s)
        acc, total = None, 0.0
        for m in range(MICROBATCHES):
            with tf.GradientTape() as tape:
                loss = loss_obj(y[m * mb:(m + 1) * mb], ref(x[m * mb:(m + 1) * mb], **kwargs))
            g = [tf.convert_to_tensor(t) for t in tape.gradient(loss, ref.trainable_variables)]
            acc = g if acc is None else [a + b for a, b in zip(acc, g)]
            total += float(loss)
        opt.apply_gradients(zip([a / MICROBATCHES for a in acc], ref.trainable_variables))
        losses.append(total / MICROBATCHES)
    ms = 1000 * (time.perf_counter() - t0) / (STEPS - 1)
    return losses, [v.numpy() for v in ref.variables], ms


def train(name: str, spelling: str, outer: bool = True) -> dict[str, Any]:
    """Train model ``name`` for `STEPS` steps; ``spelling`` is "tape" or "get_gradients".

    A "+none_batch" suffix gives the step an ``input_signature`` whose batch dimension is None,
    so every boundary tensor has an unknown batch size when ``call()`` is traced; the step is then
    called from Python (inside an outer ``tf.function`` the step sees the outer static shapes).

    ``outer=False`` calls the step and ``apply_gradients`` from Python (the step is still its own
    ``tf.function``) instead of inside one outer ``@tf.function``.
    """
    import keras
    import smp.tensorflow as smp
    import tensorflow as tf
    from smp.tensorflow import optimizers
    from smp.tensorflow.engine.exchange import is_unowned_gradient
    from smp.tensorflow.step import step

    from .models import MODELS

    optimizers.install()
    pp = smp.pp_size()
    kwargs = {"training": True} if name == "bn_dropout" else {}
    keras.utils.set_random_seed(0)
    ref = MODELS[name](keras.Model, pp)()
    x0, _ = _data(name, 0)
    ref.compute_output_spec(keras.KerasTensor((BATCH // MICROBATCHES, *x0.shape[1:]), x0.dtype.name))
    init = [v.numpy() for v in ref.variables]

    model = MODELS[name](smp.DistributedModel, pp)()
    _PENDING.update(model=model, values=init)
    if _hook not in _registered:
        smp.register_post_partition_hook(_hook)
        _registered.append(_hook)
    opt = keras.optimizers.Adam(1e-2)
    loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    none_grads: list[int] = []
    unowned_grads: list[int] = []

    signature = None
    if spelling.endswith("+none_batch"):
        outer = False
        x0, y0 = _data(name, 0)
        signature = [tf.TensorSpec((None, *x0.shape[1:]), x0.dtype), tf.TensorSpec((None, *y0.shape[1:]), y0.dtype)]

    @step(input_signature=signature)
    def get_grads(x: Any, y: Any) -> Any:
        if spelling.startswith("tape"):
            with tf.GradientTape() as tape:
                loss = loss_obj(y, model(x, **kwargs))
            grads = tape.gradient(loss, model.trainable_variables)
        else:
            loss = loss_obj(y, model(x, **kwargs))
            grads = opt.get_gradients(loss, model.trainable_variables)
        none_grads.append(sum(g is None for g in grads))
        unowned_grads.append(sum(is_unowned_gradient(g) for g in grads))
        return grads, loss

    def train_step(x: Any, y: Any) -> Any:
        grads, loss = get_grads(x, y)
        grads = [g.accumulate() for g in grads]
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss.reduce_mean(), [tf.reduce_sum(tf.abs(g)) for g in grads]

    run = tf.function(train_step) if outer else train_step
    losses, grad_sums, times, seeds = [], [], [], []
    seed_var = getattr(getattr(model, "drop", None), "seed_generator", None)
    for s in range(STEPS):
        x, y = _data(name, s)
        t0 = time.perf_counter()
        loss, sums = run(tf.constant(x), tf.constant(y))
        losses.append(float(loss))
        times.append(1000 * (time.perf_counter() - t0))
        grad_sums.append([float(g) for g in sums])
        if seed_var is not None:
            seeds.append(seed_var.state.numpy().tolist())
    out: dict[str, Any] = {
        "losses": losses, "times_ms": times, "none_grads": none_grads, "unowned_grads": unowned_grads, "grad_sums": grad_sums, "seeds": seeds,
        "owned": {i: v.numpy() for i, v in enumerate(model.variables) if model.is_local_variable(v)},
        "owner_of_trainable": [model.variable_owner(v) for v in model.trainable_variables],
        "pp_rank": smp.pp_rank(), "actions": model.step_actions[-1], "stages": model.stage_plan().describe(),
        "hook_runs": len(_HOOK_RUNS), "paths": [v.path for v in model.variables],
    }
    if smp.pp_rank() == 0:
        out["ref_losses"], out["ref_vars"], out["ref_ms"] = _reference(ref, name, kwargs)
    _HOOK_RUNS.clear()
    return out


_registered: list[Any] = []


def launch(cases: list[tuple[str, str]], config: dict[str, Any]) -> dict[str, Any]:
    """``smp.init(config)``, then `train` each (model, spelling) case; results by case name."""
    import smp.tensorflow as smp

    smp.init(config)
    return {f"{name}/{spelling}": train(name, spelling) for name, spelling in cases}


def launch_sessions(sessions: dict[str, tuple[list[tuple[str, str]], dict[str, Any]]]) -> dict[str, Any]:
    """Several `launch` sessions in one job (``smp.reset()`` between them): one TF start-up for all."""
    import smp.tensorflow as smp

    out = {}
    for name, (todo, config) in sessions.items():
        out[name] = launch(todo, config)
        smp.reset()
    return out


def _error_text(fn: Any) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def single() -> dict[str, Any]:
    """pp=1 in one process: training (outer tf.function and not), then the misuse errors."""
    import keras
    import smp.tensorflow as smp
    import tensorflow as tf
    from smp.tensorflow import optimizers
    from smp.tensorflow.step import step

    from .models import MODELS

    smp.init({"pipeline_parallel_degree": 1, "microbatches": MICROBATCHES, "auto_partition": False,
              "default_partition": 0})
    out: dict[str, Any] = {"mlp/tape": train("mlp", "tape"), "bn_dropout/get_gradients": train("bn_dropout", "get_gradients"),
                           "mlp/tape/no_outer": train("mlp", "tape", outer=False)}
    model = MODELS["mlp"](smp.DistributedModel, 1)()
    x = tf.zeros((4, 6))
    out["call_outside_step"] = _error_text(lambda: model(x))
    opt = keras.optimizers.SGD()
    out["get_gradients_eager"] = _error_text(lambda: opt.get_gradients(tf.constant(1.0), []))

    class Wrong(smp.DistributedModel):
        def __init__(self) -> None:
            super().__init__()
            self.d = keras.layers.Dense(2)

        def call(self, x: Any) -> Any:
            with smp.partition(1):
                return self.d(x)

    wrong = Wrong()

    @step
    def bad(x: Any) -> Any:
        return wrong(x)

    out["partition_out_of_range"] = _error_text(lambda: bad(tf.zeros((8, 3))))

    # SMP v1 scripts call model(x, training=True) on a call(self, x): dropped, as Keras does.
    plain = MODELS["mlp"](smp.DistributedModel, 1)()

    @step
    def forward(x: Any) -> Any:
        return plain(x, training=True), plain(x)

    with_flag, without = forward(tf.ones((8, 6)))
    out["training_dropped"] = [with_flag.concat().numpy(), without.concat().numpy(), len(plain._smp.programs)]
    optimizers.install()
    optimizers.install()
    out["installed"] = optimizers.installed() and hasattr(opt, "get_gradients")
    optimizers.uninstall()
    out["uninstalled"] = not optimizers.installed() and not hasattr(keras.optimizers.Adam(), "get_gradients")
    optimizers.install()
    return out
