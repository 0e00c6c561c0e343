"""The TF2 MNIST examples, run unchanged on real MPI ranks: tf2_mnist.py at pp2, tf2_mnist_hvd.py at pp2 x dp2.

Each rank runs the script with ``runpy`` (as ``python script.py`` would), with flags for a short
run (2 epochs of 6 batches of 32 synthetic digits); its stdout comes back per rank. Checked: the
loss goes down (rank 0's per-step lines: the mean of the last epoch's last 3 steps is below the
first 3 steps'), only rank 0 prints the AWS lines, and for the Horovod variant that the two
replicas of each stage hold equal variables after every epoch (the printed checksum), that the
ranks of one pipeline report the same loss, and that each replica's loss goes down.

The AWS script calls ``model(images, training=True)`` on a ``call(self, x)`` without ``training``:
``DistributedModel`` drops the keyword as Keras does.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import sys
from typing import Any

import pytest

from tests.helpers.mpi_spawn import run_mpi_ranks

pytestmark = pytest.mark.mpi

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tensorflow")
SHORT_RUN = ["--epochs", "2", "--steps", "6", "--batch-size", "32", "--train-samples", "512",
             "--test-samples", "64", "--log-every", "1"]
STEP_LINE = re.compile(r"^epoch (\d+) step (\d+) loss ([0-9.]+) accuracy")
RANK_LINE = re.compile(r"^rank (\d+) pp_rank (\d+) dp_rank (\d+) epoch (\d+) loss ([0-9.]+) checksum (\S+)$")


def run_example(name: str, argv: list[str]) -> str:
    """Run ``examples/tensorflow/<name>`` as ``__main__`` in this rank; returns what it printed."""
    path = os.path.abspath(os.path.join(EXAMPLES, name))
    out = io.StringIO()
    saved = sys.argv
    sys.argv = [path, *argv]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv = saved
    return out.getvalue()


def _launch(name: str, n: int, config: dict[str, Any]) -> list[str]:
    import json

    return run_mpi_ranks(run_example, n, args=(name, [*SHORT_RUN, "--config", json.dumps(config)]), timeout=240)


def _losses_go_down(rank0: str) -> None:
    steps = [(int(e), int(s), float(v)) for e, s, v in (m.groups() for m in map(STEP_LINE.match, rank0.splitlines())
                                                           if m)]
    assert len(steps) == 12, rank0
    first, last = [v for _, _, v in steps[:3]], [v for _, _, v in steps[-3:]]
    assert sum(last) / 3 < 0.8 * sum(first) / 3, f"the loss did not go down:\n{rank0}"
    assert "Epoch 2, Loss: " in rank0 and "Test Accuracy: " in rank0, rank0


def test_tf2_mnist_pp2() -> None:
    outputs = _launch("tf2_mnist.py", 2, {"partitions": 2, "microbatches": 2, "pipeline": "interleaved",
                                          "optimize": "memory"})
    _losses_go_down(outputs[0])
    assert not any(STEP_LINE.match(line) or line.startswith("Epoch ") for line in outputs[1].splitlines()), \
        f"rank 1 printed the training lines:\n{outputs[1]}"


def test_tf2_mnist_hvd_pp2_dp2() -> None:
    outputs = _launch("tf2_mnist_hvd.py", 4, {"partitions": 2, "microbatches": 2, "pipeline": "interleaved",
                                              "optimize": "memory", "horovod": True})
    _losses_go_down(outputs[0])
    rows = [m.groups() for text in outputs for m in map(RANK_LINE.match, text.splitlines()) if m]
    by = {(int(pp), int(dp), int(ep)): (float(loss), float(cs)) for _, pp, dp, ep, loss, cs in rows}
    assert sorted(by) == [(pp, dp, ep) for pp in (0, 1) for dp in (0, 1) for ep in (1, 2)], rows
    for ep in (1, 2):
        for pp in (0, 1):
            a, b = by[(pp, 0, ep)][1], by[(pp, 1, ep)][1]
            assert a == pytest.approx(b, rel=1e-9), f"epoch {ep}: the two replicas of stage {pp} differ: {a} vs {b}"
        for dp in (0, 1):
            assert by[(0, dp, ep)][0] == by[(1, dp, ep)][0], f"epoch {ep}: pipeline {dp}'s ranks report other losses"
    for dp in (0, 1):
        assert by[(0, dp, 2)][0] < by[(0, dp, 1)][0], f"replica {dp}'s loss did not go down: {rows}"
    assert by[(0, 0, 1)][0] != by[(0, 1, 1)][0], "both replicas saw the same data (shuffle(seed=smp.dp_rank()))"
