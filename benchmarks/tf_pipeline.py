"""smp.tensorflow's pipeline on 2 CPU ranks against one Keras process, and against the compute-only bound.

The model is written as Keras users write one: a list of ``BLOCKS`` Dense(``WIDTH``, tanh) blocks
looped in ``call()``, then a Dense(10) head; loss = sparse categorical cross-entropy. One step =
``M`` microbatches of ``MB`` rows (forward, backward, the mean of the gradients, one SGD update),
the same data everywhere. One table per microbatch size (``--rows``, default 16 and 64 rows).

A rank is a device here, as in ``benchmarks/bench_pipeline.py`` (one thread per rank): the runs
marked *bound* start under ``mpiexec -bind-to core``, one core per process, and the one-process
reference bound to one core is what 2 ranks are measured against. Rows:

- ``one process`` (bound, before and after the others; the faster is the reference): plain Keras
  (``keras.Model``), one ``tf.function`` looping the microbatches;
- ``smp pp2 manual``: a `DistributedModel` with ``smp.partition(0)`` around blocks 0-3 and
  ``smp.partition(1)`` around blocks 4-7 and the head, in the SMP v1 script shape (``@smp.step``
  returning tape gradients, ``@tf.function`` applying ``g.accumulate()``); bound, the default
  mode is the plan-ordered overlap (engine/schedule.py), ``SMP_TF_OVERLAP=0`` lockstep;
  ``SMP_TF_MATMUL_GRADIENT=tensorflow`` differentiates the Dense layers with TensorFlow's own MatMul
  gradient instead of smp's small-batch one (engine/matmul_grad.py), as one process and the
  compute-only bound do;
- ``compute only``: in the first manual launch, after the smp steps, each rank runs only its own
  half of the same layers as one function with smp's MatMul gradient (rank 0: blocks 0-3 forward
  and backward against a ones gradient; rank 1: blocks 4-7, head and loss from a fixed input, and
  the gradient of that input), ``M`` microbatches, both ranks at once, no communication. A 2-stage pipeline cannot beat it; a perfect overlap takes ``(M + 1) / M``
  times it;
- ``smp pp2 auto``: the same model without scopes, ``auto_partition`` with optimize "speed";
- ``unbound`` rows: plain ``mpiexec``, every process free to use both cores (TensorFlow's default
  thread pools), for smp (default mode: lockstep there) and for one process.

Per row: the median over steps of the slower rank's step time (after a barrier), then the median
over ``--rounds`` rounds (each round launches every row once, in table order): on the shared box
the load drifts between launches by +-30 %, so one launch per row can rank two rows either way.
Every process runs with the project's test settings for TensorFlow (set by the MPI launcher,
``tests/helpers/mpi_spawn.py``): ``OMP_NUM_THREADS=1``, oneDNN off.

    .venv/bin/python benchmarks/tf_pipeline.py [--steps 10] [--warmup 3] [--rows 16 64]
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


def _data(steps: int, mb: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((M * mb, WIDTH)).astype(np.float32),
             rng.integers(0, CLASSES, (M * mb,)).astype(np.int32)) for _ in range(steps)]


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


def single(steps: int, warmup: int, mb: int = MB) -> dict[str, Any]:
    """Plain Keras in one process: the microbatch loop in one tf.function."""
    import keras
    import tensorflow as tf

    model = _model(keras.Model, manual=False)
    opt = keras.optimizers.SGD(1e-3)
    loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model(np.zeros((mb, WIDTH), np.float32))

    @tf.function
    def train_step(x: Any, y: Any) -> Any:
        acc = [tf.zeros_like(v) for v in model.trainable_variables]
        total = 0.0
        for m in range(M):
            with tf.GradientTape() as tape:
                loss = loss_obj(y[m * mb:(m + 1) * mb], model(x[m * mb:(m + 1) * mb]))
            acc = [a + g for a, g in zip(acc, tape.gradient(loss, model.trainable_variables))]
            total += loss
        opt.apply_gradients(zip([a / M for a in acc], model.trainable_variables))
        return total / M

    times = _timed(lambda x, y: float(train_step(x, y)), _data(steps + warmup, mb))
    return {"times": times[warmup:]}


def ours(cut: str, steps: int, warmup: int, mb: int = MB) -> dict[str, Any]:
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

    data = _data(steps + warmup, mb)
    times = _timed(lambda x, y: float(train_step(x, y)), data, smp.barrier)
    layers = [(f"block {i}", b) for i, b in enumerate(model.blocks)] + [("head", model.head)]
    rank1 = [name for name, layer in layers if model.variable_owner(layer.kernel) == 1]
    from smp.tensorflow.runtime.init import runtime

    out: dict[str, Any] = {"times": times[warmup:], "rank1": rank1, "overlap": runtime().overlap}
    if cut == "manual":
        out["half"] = _half_alone(model, loss_obj, data, smp, mb)[warmup:]
    return out


def _half_alone(model: Any, loss_obj: Any, data: list[tuple[np.ndarray, np.ndarray]], smp: Any,
                mb: int) -> list[float]:
    """This rank's half of the layers, forward + backward of every microbatch, no communication.

    What the rank computes in the pipeline: its layers as one function, differentiated with the
    MatMul gradient smp's stage functions use (engine/matmul_grad.py, or TensorFlow's under
    ``SMP_TF_MATMUL_GRADIENT=tensorflow``), and on rank 1 also the gradient of its input (sent back).
    """
    import tensorflow as tf
    from smp.tensorflow.engine.matmul_grad import use_small_batch_gradient

    rank = smp.pp_rank()
    mine = model.blocks[:CUT] if rank == 0 else [*model.blocks[CUT:], model.head]
    variables = [v for layer in mine for v in layer.trainable_variables]
    h_in = tf.constant(np.random.default_rng(1).standard_normal((mb, WIDTH)).astype(np.float32))

    def layers(h: Any) -> Any:
        for layer in mine:
            h = layer(h)
        return h

    stage = tf.compat.v1.wrap_function(layers, [tf.TensorSpec((mb, WIDTH), tf.float32)])
    use_small_batch_gradient(stage.graph)

    @tf.function
    def half(x: Any, y: Any) -> Any:
        acc = [tf.zeros_like(v) for v in variables]
        for m in range(M):
            with tf.GradientTape() as tape:
                h = x[m * mb:(m + 1) * mb] if rank == 0 else h_in
                tape.watch(h)
                out = stage(h)
                target = tf.reduce_sum(out) if rank == 0 else loss_obj(y[m * mb:(m + 1) * mb], out)
            grads = tape.gradient(target, variables if rank == 0 else [*variables, h])
            acc = [a + g for a, g in zip(acc, grads)]
            if rank:
                acc[0] += tf.reduce_sum(grads[-1])  # the input gradient is computed, as the pipeline must
        return tf.add_n([tf.reduce_sum(a) for a in acc])

    return _timed(lambda x, y: float(half(x, y)), data, smp.barrier)


BIND = ("-bind-to", "core")  # Hydra's spelling; Open MPI: --bind-to core (its default for 1-2 ranks)


def _rows(mb: int, steps: int, warmup: int) -> list[tuple[str, float, str, str]]:
    """The table rows for microbatches of ``mb`` rows: (run, ms per step, mode, on rank 1)."""
    import importlib

    me = importlib.import_module("benchmarks.tf_pipeline")  # the ranks import the functions by module name

    def one_process(bind: bool) -> float:
        out = run_mpi_ranks(me.single, 1, args=(steps, warmup, mb), timeout=600, mpiexec_args=BIND if bind else ())
        return statistics.median(out[0]["times"])

    def pipelined(cut: str, bind: bool, env: dict[str, str] | None = None) -> tuple[float, list[dict[str, Any]]]:
        out = run_mpi_ranks(me.ours, 2, args=(cut, steps, warmup, mb), timeout=600, env=env,
                            mpiexec_args=BIND if bind else ())
        return statistics.median(max(ts) for ts in zip(*(o["times"] for o in out))), out

    def mode(out: list[dict[str, Any]]) -> str:
        return "plan-ordered overlap" if out[0]["overlap"] else "lockstep"

    rows: list[tuple[str, float, str, str]] = [("one process, bound to 1 core, before", one_process(True), "-", "-")]
    t, out = pipelined("manual", True)
    rows.append(("smp pp2 manual, bound (the default)", t, mode(out), ", ".join(out[0]["rank1"])))
    bound = statistics.median(max(ts) for ts in zip(*(o["half"] for o in out)))
    rows.append(("compute only: each rank its half, no communication", bound, "-", f"blocks {CUT}-{BLOCKS - 1} + head"))
    t, out = pipelined("manual", True, {"SMP_TF_MATMUL_GRADIENT": "tensorflow"})
    rows.append(("smp pp2 manual, bound, SMP_TF_MATMUL_GRADIENT=tensorflow", t, mode(out), ", ".join(out[0]["rank1"])))
    t, out = pipelined("manual", True, {"SMP_TF_OVERLAP": "0"})
    rows.append(("smp pp2 manual, bound, SMP_TF_OVERLAP=0", t, mode(out), ", ".join(out[0]["rank1"])))
    t, out = pipelined("auto", True)
    rows.append(("smp pp2 auto (optimize speed), bound", t, mode(out), ", ".join(out[0]["rank1"])))
    t, out = pipelined("manual", False)
    rows.append(("smp pp2 manual, unbound (the default)", t, mode(out), ", ".join(out[0]["rank1"])))
    t, out = pipelined("manual", False, {"SMP_TF_OVERLAP": "1"})
    rows.append(("smp pp2 manual, unbound, SMP_TF_OVERLAP=1", t, mode(out), ", ".join(out[0]["rank1"])))
    rows.append(("one process, unbound (TF's threads on both cores)", one_process(False), "-", "-"))
    rows.append(("one process, bound to 1 core, after", one_process(True), "-", "-"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rows", type=int, nargs="+", default=[MB, 4 * MB], help="rows per microbatch, one table each")
    parser.add_argument("--rounds", type=int, default=3,
                        help="every row is launched once per round; a row's figure is its median over the rounds")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from records import Table, write_record

    tables, records, headline = [], [], []
    for mb in args.rows:
        rounds = [_rows(mb, args.steps, args.warmup) for _ in range(args.rounds)]
        rows = [(label, statistics.median(r[i][1] for r in rounds), how, rank1)
                for i, (label, _, how, rank1) in enumerate(rounds[0])]
        one = min(t for label, t, _, _ in rows if label.startswith("one process, bound"))
        bound_row = next(i for i, row in enumerate(rows) if row[0].startswith("compute only"))
        bound = rows[bound_row][1]
        load = os.getloadavg()
        table = Table(f"{BLOCKS} x Dense({WIDTH}, tanh) + Dense({CLASSES}), {M} microbatches of {mb} rows, SGD; "
                      f"median of {args.steps} steps after {args.warmup} warm-up, median over {args.rounds} rounds; "
                      f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs",
                      ["run", "mode", "ms/step (median)", "/ one process (1 core)", "/ compute-only bound", "on rank 1"])
        print(f"\n{table.title}\n")
        print(table.markdown())
        for i, (label, t, how, rank1) in enumerate(rows):
            table.add(label, how, f"{t * 1e3:.1f}", f"{t / one:.3f}", f"{t / bound:.3f}", rank1)
            print("| " + " | ".join(table.rows[-1]) + " |", flush=True)
            records.append({"rows_per_microbatch": mb, "run": label, "mode": how, "on_rank1": rank1,
                            "median_ms": t * 1e3, "round_ms": [r[i][1] * 1e3 for r in rounds],
                            "per_one_process": t / one, "per_compute_bound": t / bound, "load_average": list(load)})
        tables.append(table)
        # smp's default (manual scopes, bound), per round against the faster one-process run of that round
        default = next(i for i, row in enumerate(rows) if row[0] == "smp pp2 manual, bound (the default)")
        ratios = [r[default][1] / min(t for label, t, _, _ in r if label.startswith("one process, bound"))
                  for r in rounds]
        headline.append({"what": f"Keras {BLOCKS} x Dense({WIDTH}) step time, smp pp2 (manual scopes, 2 ranks bound "
                                 f"to 1 core each) / one Keras process on 1 core, {M} microbatches of {mb} rows",
                         "value": f"{rows[default][1] / one:.2f}x ({min(ratios):.2f}-{max(ratios):.2f}, "
                                  f"{args.rounds} rounds)"})
        # Paired: each round's default step over the compute-only bound timed by the same processes right
        # after it (the two halves of one launch see the same load; separate medians do not).
        paired = [r[default][1] / r[bound_row][1] for r in rounds]
        table.add("smp pp2 (the default) / compute only, paired by launch", "-", "-", "-",
                  f"{statistics.median(paired):.3f} ({min(paired):.2f}-{max(paired):.2f})", "-")
        print("| " + " | ".join(table.rows[-1]) + " |", flush=True)  # the table's last row, as the rows above
        records.append({"rows_per_microbatch": mb, "run": "paired: default / compute-only bound of the same launch",
                        "median": statistics.median(paired), "rounds": paired})
        if mb == max(args.rows):
            headline.append({"what": f"Keras {BLOCKS} x Dense({WIDTH}) step time, smp pp2 (2 ranks bound to 1 core "
                                     f"each) / its compute-only bound (each rank its half alone, paired by "
                                     f"launch), {M} microbatches of {mb} rows",
                             "value": f"{statistics.median(paired):.2f}x ({min(paired):.2f}-{max(paired):.2f}, "
                                      f"{args.rounds} rounds)"})
    path = write_record("tf_pipeline", records,
                        settings={**vars(args), "microbatches": M, "width": WIDTH, "blocks": BLOCKS, "classes": CLASSES,
                                  "cut": CUT, "bind": list(BIND)},
                        tables=tables, headline=headline)
    print(f"\nrecord: {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    main()
