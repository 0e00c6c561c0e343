"""examples/tensorflow/train_keras.py, the TF demo: the Keras char transformer under mpiexec on 2 ranks.

The script runs as users run it (``mpiexec -bind-to core -n 2 python examples/tensorflow/train_keras.py``, the
command ``scripts/demo.sh --tensorflow`` execs) with tiny settings; at the same time its
``--reference`` mode trains the same model, data and seed in one plain Keras process. Checked:
the automatic partition report (smp logs it on rank 0) puts the embeddings on rank 0, the head on
rank 1 and the blocks on both; the output files exist; the pipelined losses equal the one-process
ones (rtol 1e-5: the microbatch mean of the gradients against the full-batch gradient, float32
summation order) and fall.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.mpi

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join("examples", "tensorflow", "train_keras.py")
SMALL = {"steps": 5, "microbatches": 2, "microbatch-size": 2, "seq": 16, "layers": 2, "width": 32, "heads": 2}
TIMEOUT_S = 240
REPORT_ROW = re.compile(r"^(embedding(?:_\d+)?|block(?:_\d+)?|dense_\d+)\s+(\d)\s", re.M)


def _start(cmd: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": "0"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen[str], what: str) -> str:
    """``proc``'s output once it exits 0; a timeout kills its process group and fails naming ``what``."""
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{what} did not finish within {TIMEOUT_S} s; its output:\n{out[-4000:]}")
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{out[-6000:]}"
    return out


def test_demo_partitions_the_keras_transformer_between_blocks_and_matches_one_process(tmp_path: Any) -> None:
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        pytest.skip(f"mpiexec not found next to {sys.executable} (install mpich: requirements/dev.txt)")
    flags = [a for key, value in SMALL.items() for a in (f"--{key}", str(value))]
    demo = _start([mpiexec, "-bind-to", "core", "-n", "2", sys.executable, SCRIPT, "--out", str(tmp_path / "smp"),
                   *flags])
    ref = _start([sys.executable, SCRIPT, "--reference", "--out", str(tmp_path / "ref"), *flags])
    log = _finish(demo, "the 2-rank demo")
    _finish(ref, "the one-process reference")

    ranks = {m.group(1): int(m.group(2)) for m in REPORT_ROW.finditer(log)}
    heads = sorted((name for name in ranks if name.startswith("dense_")), key=lambda n: int(n.split("_")[1]))
    assert ranks.get("embedding") == 0 and heads and ranks[heads[-1]] == 1, log
    assert {r for name, r in ranks.items() if name.startswith("block")} == {0, 1}, log
    assert f"step {SMALL['steps']}/{SMALL['steps']}" in log and "samples/s" in log, log
    assert sorted(os.listdir(tmp_path / "smp")) == ["loss.svg", "losses.json", "timeline.svg", "timeline.trace.json"]
    with open(tmp_path / "smp" / "timeline.svg") as f:
        assert "<svg" in f.read()
    with open(tmp_path / "smp" / "losses.json") as f:
        losses = json.load(f)
    with open(tmp_path / "ref" / "losses.json") as f:
        reference = json.load(f)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    assert losses[-1] < losses[0], losses
