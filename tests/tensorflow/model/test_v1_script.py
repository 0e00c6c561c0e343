"""An SMP v1-style TF script end to end: get_gradients without setup, data parallelism inside the
partitioned call, ``model.save_model``, and ``CheckpointManager.restore()`` before the first step.

Two launches (`cases_v1`): pp2 x dp2 (``horovod: True`` then ``ddp: True``) against one process
trained on the combined batch, and a fresh pp2 job that restores the first one's checkpoint before
its first step. The saved model is loaded in a third, plain TensorFlow process (no smp import).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from tests.helpers.mpi_spawn import run_mpi_ranks

from . import cases_v1

pytestmark = pytest.mark.mpi

LOSS_RTOL = 1e-6
VAR_ATOL, VAR_RTOL = 2e-6, 1e-6  # as test_model.py: Adam after 3 steps


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = str(tmp_path_factory.mktemp("v1"))
    first = run_mpi_ranks(cases_v1.dp_launch, 4, args=(directory,), timeout=420)
    second = run_mpi_ranks(cases_v1.restore_launch, 2, args=(directory,), timeout=300)
    return {"dir": directory, "first": first, "second": second}


def _check_replicas(results: list[dict[str, Any]], ref: dict[str, Any], key: str) -> None:
    seen = set()
    for r in results:
        dp = r["dp_rank"]
        seen.add((r["pp_rank"], dp))
        want = [step[dp] for step in ref["losses"]][: len(r["losses"])]
        np.testing.assert_allclose(r["losses"], want, rtol=LOSS_RTOL,
                                   err_msg=f"{key}: losses of pp {r['pp_rank']} dp {dp} vs its replica in one process")
        assert max(r["hvd_changed"]) == 0.0, f"{key}: hvd.allreduce changed the returned gradients: {r['hvd_changed']}"
    assert seen == {(p, d) for p in range(2) for d in range(2)}
    for dp in range(2):
        owned: dict[int, np.ndarray] = {}
        for r in results:
            if r["dp_rank"] == dp:
                owned.update(r["owned"])
        assert sorted(owned) == list(range(len(ref["vars"]))), f"{key}: replica {dp} lacks owners"
        for i, value in owned.items():
            np.testing.assert_allclose(value, ref["vars"][i], rtol=VAR_RTOL, atol=VAR_ATOL,
                                       err_msg=f"{key}: replica {dp}, variable {i} after {cases_v1.SAVE_AFTER} steps")


@pytest.mark.parametrize("key", ["horovod", "ddp"])
def test_dp_inside_the_partitioned_call_matches_one_process(runs: dict[str, Any], key: str) -> None:
    """Gradients come back DP-averaged (hvd.allreduce leaves them as they are); each loss is its replica's."""
    first = runs["first"]
    _check_replicas([r[key] for r in first], first[0]["horovod"]["ref"], key)
    # The two replicas really saw different data (else the check above proves nothing about averaging).
    losses = {r[key]["dp_rank"]: r[key]["losses"][0] for r in first}
    assert abs(losses[0] - losses[1]) > 1e-3, losses


def test_get_gradients_needs_no_setup(runs: dict[str, Any]) -> None:
    """Installed by smp.init when Keras was imported first, by the first DistributedModel otherwise; reset undoes it."""
    for r in runs["first"]:
        assert r["installed_at_init"] and r["uninstalled_at_reset"]
    for r in runs["second"]:
        assert not r["keras_before_model"], "smp.init imported Keras"
        assert r["installed_by_model"]


def test_restore_before_the_first_step_continues_the_losses(runs: dict[str, Any]) -> None:
    """Deferred to partitioning: the fresh job's first loss is the first job's step 4 (replica 0), optimizer included."""
    first = {(r["horovod"]["pp_rank"], r["horovod"]["dp_rank"]): r["horovod"] for r in runs["first"]}
    assert first[(0, 0)]["saved_ckpt"].endswith(os.path.join("mp_rank_0", "ckpt-1"))
    for r in runs["second"]:
        assert r["status_before"] == "DeferredRestore(done=False, prefix=None)"
        assert r["status_after"].startswith("DeferredRestore(done=True, prefix=") and "ckpt-1" in r["status_after"]
        assert r["iterations"] == cases_v1.SAVE_AFTER + 1, "the optimizer's step count was not restored"
        np.testing.assert_allclose(r["losses"][0], first[(0, 0)]["losses"][cases_v1.SAVE_AFTER], rtol=LOSS_RTOL)


_LOAD = """
import json, sys
import numpy as np, tensorflow as tf
x = np.asarray(json.loads(sys.argv[2]), np.int32)
loaded = tf.saved_model.load(sys.argv[1])  # kept: serve's variables belong to it
out = loaded.serve(tf.constant(x))
np.save(sys.argv[3], np.asarray(out))
print("smp" in sys.modules, "keras" in sys.modules)
"""


def test_save_model_loads_without_smp(runs: dict[str, Any], tmp_path: Any) -> None:
    """model.save_model at pp2 x dp2; a plain TF process loads it; outputs equal the one-process model's."""
    out_file = str(tmp_path / "out.npy")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": "0", "OMP_NUM_THREADS": "1"}
    import json

    proc = subprocess.run([sys.executable, "-c", _LOAD, os.path.join(runs["dir"], "saved"),
                           json.dumps(cases_v1.probe().tolist()), out_file],
                          capture_output=True, text=True, timeout=180, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[0] == "False", "the loading process imported smp"
    np.testing.assert_allclose(np.load(out_file), runs["first"][0]["horovod"]["ref"]["probe_out"],
                               rtol=1e-5, atol=1e-6)
