"""save_model at 2 ranks: each variable from its owner stage; plain TensorFlow / Keras load the result without smp.

The two ranks hold different values for every variable (as a partitioned model's stages do) and
an owner map gives the first layer to stage 0 and the second to stage 1. The SavedModel and the
``.keras`` archive are loaded in a fresh process that imports only TensorFlow and Keras; its
outputs must equal the numpy forward of the owners' values.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from tests.helpers.mpi_spawn import run_mpi_ranks

OWNERS = [0, 0, 1, 1]  # Dense(8).kernel, .bias -> stage 0; Dense(3).kernel, .bias -> stage 1


def _tree_digest(path: str) -> str:
    h = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(root, f)
            h.update(os.path.relpath(p, path).encode())
            with open(p, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares the messages
        return f"{type(e).__name__}: {e}"
    return "no error"


def save_launch(directory: str) -> dict[str, Any]:
    import keras
    import smp.tensorflow as smp
    from smp.tensorflow.checkpointing.saving import save_model

    smp.init({"partitions": 2})
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    model(np.zeros((1, 4), np.float32))
    for v in model.variables:  # every rank holds its own values
        v.assign(v.numpy() + 0.1 * (smp.rank() + 1))
    mine = [v.numpy().tolist() for v in model.variables]
    sm, archive = os.path.join(directory, "model"), os.path.join(directory, "model.keras")
    save_model(model, sm, owner_of=lambda i: OWNERS[i])
    save_model(model, archive, owner_of=lambda i: OWNERS[i])
    out: dict[str, Any] = {"mine": mine, "after": [v.numpy().tolist() for v in model.variables]}
    digest = _tree_digest(sm)

    def bad_export(m: Any, staging: str) -> None:
        os.makedirs(staging)
        with open(os.path.join(staging, "saved_model.pb"), "wb") as f:
            f.write(b"half a model")
        raise OSError(28, "No space left on device (test)")

    out["failed"] = _error(lambda: save_model(model, sm, owner_of=lambda i: OWNERS[i], export=bad_export))
    out["unchanged"] = _tree_digest(sm) == digest
    out["leftovers"] = sorted(f for f in os.listdir(directory) if f.startswith("."))
    out["bad_owner"] = _error(lambda: save_model(model, sm, owner_of=lambda i: 5))
    # a model that refuses calls outside a step (as DistributedModel does) saves under whole_model=
    restricted = _restricted(keras)
    restricted.set_weights(model.get_weights())
    restricted_path = os.path.join(directory, "restricted")
    out["restricted_refused"] = _error(lambda: save_model(restricted, restricted_path, owner_of=lambda i: OWNERS[i]))
    save_model(restricted, restricted_path, owner_of=lambda i: OWNERS[i], whole_model=restricted.whole)
    out["restricted_after"] = [v.numpy().tolist() for v in restricted.variables]
    return out


def _restricted(keras: Any) -> Any:
    import contextlib

    class OnlyInStep(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.d1, self.d2 = keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)
            self.allowed = False

        def call(self, x: Any) -> Any:
            return self.d2(self.d1(x))

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            if not self.allowed:
                raise RuntimeError("OnlyInStep(...) called outside a step")
            return super().__call__(*args, **kwargs)

        @contextlib.contextmanager
        def whole(self) -> Any:
            self.allowed = True
            try:
                yield
            finally:
                self.allowed = False

    m = OnlyInStep()
    with m.whole():
        m(np.zeros((1, 4), np.float32))
    return m


LOADER = r"""
import json, sys
import numpy as np, tensorflow as tf, keras
x = np.asarray(json.loads(sys.argv[3]), np.float32)
loaded = tf.saved_model.load(sys.argv[1])  # kept referenced: its variables live as long as it does
served = loaded.serve(tf.constant(x)).numpy()
archived = keras.models.load_model(sys.argv[2])(x).numpy()
restricted = tf.saved_model.load(sys.argv[4])
restricted_served = restricted.serve(tf.constant(x)).numpy()
smp_loaded = sorted(m for m in sys.modules if m == "smp" or m.startswith("smp."))
print(json.dumps({"served": served.tolist(), "archived": archived.tolist(), "restricted": restricted_served.tolist(),
                  "smp": smp_loaded}))
"""


@pytest.mark.mpi
def test_save_model_gathers_owners_and_loads_without_smp(tmp_path: Any) -> None:
    directory = str(tmp_path)
    got = run_mpi_ranks(save_launch, 2, args=(directory,), timeout=180)
    assert got[0]["mine"] != got[1]["mine"]
    for out in got:
        assert out["after"] == out["mine"]  # rank 0 put its own values back after saving
        assert out["failed"].startswith("SMPCheckpointError") and "rank(s) [0]" in out["failed"]
        assert "No space left on device (test)" in out["failed"]
        assert out["unchanged"], "a failed save damaged the previous SavedModel"
        assert out["leftovers"] == []
        assert out["bad_owner"].startswith("SMPCheckpointError") and "owner_of(0)" in out["bad_owner"]
        assert "called outside a step" in out["restricted_refused"]
        assert out["restricted_after"] == out["mine"]
    weights = [np.asarray(got[OWNERS[i]]["mine"][i], np.float32) for i in range(4)]
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    want = np.tanh(x @ weights[0] + weights[1]) @ weights[2] + weights[3]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMP_")}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", LOADER, os.path.join(directory, "model"),
                           os.path.join(directory, "model.keras"), json.dumps(x.tolist()),
                           os.path.join(directory, "restricted")],
                          capture_output=True, text=True, timeout=120, env=env, cwd=directory)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded["smp"] == []
    np.testing.assert_allclose(loaded["served"], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(loaded["archived"], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(loaded["restricted"], want, rtol=1e-6, atol=1e-6)
