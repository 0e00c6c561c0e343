"""smp.tensorflow's pipeline on 2 CPU ranks against one Keras process, and against the compute-only bound.

The model is written as Keras users write one: a list of ``BLOCKS`` Dense(``WIDTH``, tanh) blocks
looped in ``call()``, then a Dense(10) head; loss = sparse categorical cross-entropy. One step =
``M`` microbatches of ``MB`` rows (forward, backward, the mean of the gradients, one SGD update),
the same data everywhere. Rows:

- ``one process`` (before and after the others): plain Keras (``keras.Model``), one ``tf.function`` looping the microbatches;
- ``smp pp2 (manual)``: a `DistributedModel` with ``smp.partition(0)`` around blocks 0-3 and
  ``smp.partition(1)`` around blocks 4-7 and the head, in the SMP v1 script shape (``@smp.step``
  returning tape gradients, ``@tf.function`` applying ``g.accumulate()``);
- ``smp pp2 (manual, plan-ordered overlap)``: the same with ``SMP_TF_OVERLAP=1`` (experimental: the
  transfers leave the step's program order and each stage's work takes the shared scheduler's baton,
  ``interleaved``, so the ranks overlap microbatches; engine/schedule.py);
- ``smp pp2 (auto)``: the same model without scopes, ``auto_partition`` with optimize "speed";
- ``compute only``: in the manual launch, after the smp steps, each rank runs only its own half
  of the same layers (rank 0: blocks 0-3 forward and backward against a ones gradient; rank 1:
  blocks 4-7, head and loss from a fixed input), ``M`` microbatches, both ranks at once, no
  communication. A 2-stage pipeline cannot beat it; a schedule that overlaps the stages perfectly
  takes ``(M + 1) / M`` times it (the fill and drain of one microbatch).

Per row: the median over steps of the slower rank's step time (after a barrier), and ratios. The
one-process run is launched before and after the others (on a shared box the load drifts between
launches); the faster of the two is the "/ one process" reference. The compute-only bound comes
from the same launch as the manual pipeline, so that ratio is the one least affected by load.
Every process runs with the project's test settings for TensorFlow (set by the MPI launcher,
``tests/helpers/mpi_spawn.py``): ``OMP_NUM_THREADS=1``, oneDNN off, TF's default thread pools.

    .venv/bin/python benchmarks/tf_pipeline.py [--steps 10] [--warmup 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from tests.helpers.mpi_spawn import run_mpi_ranks  # noqa: E402

M, MB, WIDTH, BLOCKS, CLASSES = 8, 16, 768, 8, 10
CUT = BLOCKS // 2  # the first block on rank 1


def _data(steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((M * MB, WIDTH)).astype(np.float32),
             rng.integers(0, CLASSES, (M * MB,)).astype(np.int32)) for _ in range(steps)]


def _model(base: type, manual: bool) -> Any:
    """The benchmark model on ``base`` (keras.Model or smp.DistributedModel); ``manual``: the 4 | 4 scopes."""
    import contextlib

    import keras

    class Blocks(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.blocks = [keras.layers.Dense(WIDTH, activation="tanh") for _ in range(BLOCKS)]
            self.head = keras.layers.Dense(CLASSES)

        def call(self, x: Any) -> Any:
            for i, block in enumerate(self.blocks):
                with _scope(0 if i < CUT else 1):
                    x = block(x)
            with _scope(1):
                return self.head(x)

    def _scope(p: int) -> Any:
        if not manual:
            return contextlib.nullcontext()
        import smp.tensorflow as smp

        return smp.partition(p)

    return Blocks()


def _timed(fn: Any, data: list[tuple[np.ndarray, np.ndarray]], barrier: Any = None) -> list[float]:
    times = []
    for x, y in data:
        if barrier is not None:
            barrier()
        start = time.perf_counter()
        fn(x, y)
        times.append(time.perf_counter() - start)
    return times


def single(steps: int, warmup: int) -> dict[str, Any]:
    """Plain Keras in one process: the microbatch loop in one tf.function."""
    import keras
    import tensorflow as tf

    model = _model(keras.Model, manual=False)
    opt = keras.optimizers.SGD(1e-3)
    loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model(np.zeros((MB, WIDTH), np.float32))

    @tf.function
    def train_step(x: Any, y: Any) -> Any:
        acc = [tf.zeros_like(v) for v in model.trainable_variables]
        total = 0.0
        for m in range(M):
            with tf.GradientTape() as tape:
                loss = loss_obj(y[m * MB:(m + 1) * MB], model(x[m * MB:(m + 1) * MB]))
            acc = [a + g for a, g in zip(acc, tape.gradient(loss, model.trainable_variables))]
            total += loss
        opt.apply_gradients(zip([a / M for a in acc], model.trainable_variables))
        return total / M

    times = _timed(lambda x, y: float(train_step(x, y)), _data(steps + warmup))
    return {"times": times[warmup:]}


def ours(cut: str, steps: int, warmup: int) -> dict[str, Any]:
    """smp pp2: the SMP v1 script shape; with ``cut == "manual"`` also each rank's half alone."""
    import keras
    import smp.tensorflow as smp
    import tensorflow as tf

    cfg: dict[str, Any] = {"pipeline_parallel_degree": 2, "microbatches": M, "auto_partition": cut == "auto",
                           "optimize": "speed"}
    if cut == "manual":
        cfg["default_partition"] = 0
    smp.init(cfg)
    model = _model(smp.DistributedModel, manual=cut == "manual")
    opt = keras.optimizers.SGD(1e-3)
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

    data = _data(steps + warmup)
    times = _timed(lambda x, y: float(train_step(x, y)), data, smp.barrier)
    layers = [(f"block {i}", b) for i, b in enumerate(model.blocks)] + [("head", model.head)]
    rank1 = [name for name, layer in layers if model.variable_owner(layer.kernel) == 1]
    out: dict[str, Any] = {"times": times[warmup:], "rank1": rank1}
    if cut == "manual":
        out["half"] = _half_alone(model, loss_obj, data, smp)[warmup:]
    return out


def _half_alone(model: Any, loss_obj: Any, data: list[tuple[np.ndarray, np.ndarray]], smp: Any) -> list[float]:
    """This rank's half of the layers, forward + backward of every microbatch, no communication."""
    import tensorflow as tf

    mine = model.blocks[:CUT] if smp.pp_rank() == 0 else [*model.blocks[CUT:], model.head]
    variables = [v for layer in mine for v in layer.trainable_variables]
    h_in = tf.constant(np.random.default_rng(1).standard_normal((MB, WIDTH)).astype(np.float32))

    @tf.function
    def half(x: Any, y: Any) -> Any:
        acc = [tf.zeros_like(v) for v in variables]
        for m in range(M):
            with tf.GradientTape() as tape:
                h = x[m * MB:(m + 1) * MB] if smp.pp_rank() == 0 else h_in
                tape.watch(h)
                for layer in mine:
                    h = layer(h)
                target = tf.reduce_sum(h) if smp.pp_rank() == 0 else loss_obj(y[m * MB:(m + 1) * MB], h)
            acc = [a + g for a, g in zip(acc, tape.gradient(target, [*variables, h])[:-1])]
        return tf.add_n([tf.reduce_sum(a) for a in acc])

    return _timed(lambda x, y: float(half(x, y)), data, smp.barrier)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    # The ranks import the functions by module name, which __main__ is not.
    import importlib

    me = importlib.import_module("benchmarks.tf_pipeline")
    single, ours = me.single, me.ours
    def one_process() -> float:
        return statistics.median(run_mpi_ranks(single, 1, args=(args.steps, args.warmup), timeout=600)[0]["times"])

    before = one_process()
    rows: list[tuple[str, float, str]] = [("one process (plain Keras), before", before, "-")]
    bound = None
    for cut, overlap in (("manual", False), ("manual", True), ("auto", False)):
        env = {"SMP_TF_OVERLAP": "1"} if overlap else None
        out = run_mpi_ranks(ours, 2, args=(cut, args.steps, args.warmup), timeout=600, env=env)
        t = statistics.median(max(ts) for ts in zip(*(o["times"] for o in out)))
        label = f"smp pp2 ({cut}, plan-ordered overlap: SMP_TF_OVERLAP=1)" if overlap else f"smp pp2 ({cut}, lockstep)"
        rows.append((label, t, ", ".join(out[0]["rank1"])))
        if cut == "manual" and not overlap:
            bound = statistics.median(max(ts) for ts in zip(*(o["half"] for o in out)))
            rows.append(("compute only (each rank its half, no communication)", bound,
                         f"blocks {CUT}-{BLOCKS - 1} + head"))
    after = one_process()
    rows.append(("one process (plain Keras), after", after, "-"))
    one = min(before, after)  # the load of a shared box drifts between launches: the faster run is the reference
    load = os.getloadavg()
    print(f"\n{BLOCKS} x Dense({WIDTH}, tanh) + Dense({CLASSES}), {M} microbatches of {MB} rows, SGD; "
          f"median of {args.steps} steps after {args.warmup} warm-up; load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f} on {os.cpu_count()} CPUs\n")
    print("| run | ms/step (median) | / one process | / compute-only bound | / (M+1)/M x bound | on rank 1 |")
    print("|---|---|---|---|---|---|")
    assert bound is not None
    for label, t, rank1 in rows:
        print(f"| {label} | {t * 1e3:.1f} | {t / one:.3f} | {t / bound:.3f} | {t / (bound * (M + 1) / M):.3f} "
              f"| {rank1} |", flush=True)


if __name__ == "__main__":
    main()
