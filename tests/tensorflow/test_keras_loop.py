"""Keras fit / evaluate / predict on a DistributedModel through `smp.tensorflow.keras_loop` (real MPI ranks).

Each launch builds one model class twice: a plain ``keras.Model`` trained by Keras' own ``fit`` in
this process (the reference, full batches), and the same class on `DistributedModel`, whose
``compile`` / ``fit`` / ``train_step`` / ``test_step`` / ``predict_step`` go through `keras_loop`, with
the reference's initial values (a post-partition hook copies them in). Same data, batch size,
epochs, ``shuffle=False``, SGD and Adam. Compared on every rank: ``fit`` history (loss, accuracy
per epoch), ``evaluate``'s loss and accuracy, ``predict``'s full array, and every variable on its
owner. The loss is Keras' batch-size-weighted mean over the epoch's batches of each batch's mean
loss; smp's batch loss is the mean of 4 equal microbatch means, so they agree to float rounding
(rtol 1e-6); accuracy counts must be equal.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.helpers.mpi_spawn import run_mpi_ranks

pytestmark = pytest.mark.mpi

N, BATCH, MICROBATCHES, EPOCHS = 64, 16, 4, 2
_PENDING: list[Any] = []


def _model_class(base: type, pp: int) -> type:
    import keras
    import smp.tensorflow as smp

    class MLP(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.d1 = keras.layers.Dense(16, activation="relu")
            self.d2 = keras.layers.Dense(12, activation="tanh")
            self.d3 = keras.layers.Dense(4)

        def call(self, x: Any, training: bool = False) -> Any:
            with smp.partition(0):
                h = self.d1(x)
            with smp.partition(min(1, pp - 1)):
                return self.d3(self.d2(h))

    return MLP


def _distributed_class(pp: int) -> type:
    import smp.tensorflow as smp

    return _model_class(smp.DistributedModel, pp)


def _copy_initial_values() -> None:
    _copy_initial_values_into(*_PENDING.pop())


def _copy_initial_values_into(model: Any, values: list[np.ndarray]) -> None:
    for v, a in zip(model.variables, values):
        v.assign(a)


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def launch(pp: int) -> dict[str, Any]:
    """``smp.init`` at ``pp``, then the reference and the DistributedModel for SGD and Adam."""
    import keras
    import smp.tensorflow as smp

    smp.init({"pipeline_parallel_degree": pp, "microbatches": MICROBATCHES, "auto_partition": False,
              "default_partition": 0})
    smp.register_post_partition_hook(_copy_initial_values)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((N, 6)).astype(np.float32)
    y = rng.integers(0, 4, (N,)).astype(np.int32)
    out: dict[str, Any] = {"pp_rank": smp.pp_rank()}
    for name, make_opt in (("sgd", lambda: keras.optimizers.SGD(0.2)), ("adam", lambda: keras.optimizers.Adam(1e-2))):
        results = {}
        for kind in ("ref", "smp"):
            model = _model_class(keras.Model, pp)() if kind == "ref" else _distributed_class(pp)()
            if kind == "ref":
                model(x[:2])
                # The same values on every rank (Keras' initializers are not seeded alike across processes).
                init = np.random.default_rng(11)
                values = [(init.standard_normal(v.shape) * 0.4).astype(np.float32) for v in model.variables]
                _copy_initial_values_into(model, values)
            else:
                _PENDING.append((model, values))
            model.compile(optimizer=make_opt(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"])
            history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history
            ev = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
            pred = model.predict(x, batch_size=BATCH, verbose=0)
            if kind == "smp":
                owned = {i: v.numpy() for i, v in enumerate(model.variables) if model.is_local_variable(v)}
                bad_kwarg = _error(lambda m=model: m.fit(x, y, batch_size=BATCH, workers=2, verbose=0))
                uneven = _error(lambda m=model: m.evaluate(x[:18], y[:18], batch_size=BATCH, verbose=0))
                jit = _error(lambda m=model: m.compile(optimizer="sgd", loss="mse", jit_compile=True))
                results[kind] = {"history": history, "evaluate": ev, "predict": pred, "owned": owned,
                                 "bad_kwarg": bad_kwarg, "uneven": uneven, "jit": jit}
            else:
                results[kind] = {"history": history, "evaluate": ev, "predict": pred,
                                 "vars": [v.numpy() for v in model.variables]}
        out[name] = results
    return out


def _check(results: list[dict[str, Any]], pp: int) -> None:
    assert sorted(r["pp_rank"] for r in results) == list(range(pp))
    for opt in ("sgd", "adam"):
        owned: dict[int, np.ndarray] = {}
        for r in results:
            ref, got = r[opt]["ref"], r[opt]["smp"]
            for key in ("loss", "accuracy"):
                assert len(got["history"][key]) == EPOCHS, got["history"]
                np.testing.assert_allclose(got["history"][key], ref["history"][key], rtol=1e-6,
                                           err_msg=f"{opt}: fit history {key!r} on pp rank {r['pp_rank']}")
            assert got["history"]["loss"][-1] < got["history"]["loss"][0], got["history"]
            assert all(v > 0 for v in got["history"]["loss"]), "history shows 0.0: metric trackers not returned"
            assert set(got["evaluate"]) == set(ref["evaluate"]) == {"loss", "accuracy"}
            for key in ("loss", "accuracy"):
                np.testing.assert_allclose(got["evaluate"][key], ref["evaluate"][key], rtol=1e-6,
                                           err_msg=f"{opt}: evaluate {key!r} on pp rank {r['pp_rank']}")
            assert got["predict"].shape == (N, 4)
            np.testing.assert_allclose(got["predict"], ref["predict"], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{opt}: predict on pp rank {r['pp_rank']}")
            for i, value in got["owned"].items():
                assert i not in owned, f"{opt}: variable {i} owned twice"
                owned[i] = value
                np.testing.assert_allclose(value, ref["vars"][i], rtol=1e-5, atol=1e-6,
                                           err_msg=f"{opt}: variable {i} after fit on its owner")
            assert got["bad_kwarg"].startswith("SMPError: DistributedModel.fit() does not take 'workers'"), \
                got["bad_kwarg"]
            assert "cannot split" in got["uneven"], got["uneven"]
            assert got["jit"].startswith("SMPError: DistributedModel.compile(jit_compile=True)"), got["jit"]
        assert sorted(owned) == list(range(len(results[0][opt]["ref"]["vars"]))), f"{opt}: variables without owner"


@pytest.mark.parametrize("pp", [1, 2])
def test_fit_evaluate_predict_match_one_keras_process(pp: int) -> None:
    _check(run_mpi_ranks(launch, pp, args=(pp,), timeout=300), pp)
