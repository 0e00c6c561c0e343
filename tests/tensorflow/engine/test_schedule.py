"""Overlapped microbatches (``SMP_TF_OVERLAP=1``, or unset with ranks bound to cores): the scheduler's order.

Real MPI ranks, real Keras models (`tests.tensorflow.model.cases`: the DistributedModel through
``@smp.step`` in an outer ``@tf.function``, against the same model in one Keras process). Checked:

- the recorded order of (kind, microbatch) on every rank equals `smp.pipeline.choose.rank_plan`
  for the config's ``pipeline`` (``simple``: GPipe; ``interleaved``: 1F1B) and the stages' chain;
- the ranks overlapped, by order alone (no timing): on pp rank 0, microbatch 1's forward started
  before microbatch 0's backward, which cannot start before the last rank has done microbatch 0's
  backward (lockstep runs F0 B0 F1 ...);
- losses of every step and every variable after 3 Adam steps equal one process (the tolerances
  of the lockstep tests), with skip connections, a tied embedding, BatchNorm and dropout;
- the measured timeline has one event per action and renders with the torch renderers;
- in the traced graph, nothing of the step waits for the end-of-step barrier, and the backward end
  markers read only gradients something else reads (no gradient computed for the marker alone).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.helpers.mpi_spawn import run_mpi_ranks

pytestmark = pytest.mark.mpi

LOSS_RTOL = 1e-6
VAR_ATOL, VAR_RTOL = 2e-6, 1e-6


def launch(cases_: list[tuple[str, str]], config: dict[str, Any], overlap_env: str | None = "1") -> dict[str, Any]:
    """One rank: ``SMP_TF_OVERLAP=overlap_env`` (None: unset), ``smp.init``, then each case of `cases.train`.

    The inter-op pool is the one ``smp.init`` sizes (`runtime.init.INTER_OP_POOL`), so a need
    above it (`engine.schedule.min_inter_op_threads`) would show here as a lockstep run.
    """
    import os

    if overlap_env is None:
        os.environ.pop("SMP_TF_OVERLAP", None)
    else:
        os.environ["SMP_TF_OVERLAP"] = overlap_env
    import smp.tensorflow as smp
    from smp.tensorflow.runtime.init import runtime
    from smp.tensorflow.state import tf_state

    import smp.state as smp_state
    from smp.pipeline import render_ascii, render_svg
    from smp.pipeline.choose import rank_plan
    from tests.tensorflow.model import cases

    cases.MICROBATCHES = int(config["microbatches"])
    smp.init(config)
    out: dict[str, Any] = {"overlap": runtime().overlap, "cpus": sorted(os.sched_getaffinity(0))}
    for name, spelling in cases_:
        result = cases.train(name, spelling)
        model = tf_state().model
        cfg = smp_state.current().cfg
        chain = [int(line.split("partition ")[1].split(",")[0]) for line in result["stages"].splitlines()]
        plan = rank_plan(cfg.pipeline_section(), chain, True, smp.pp_rank(), light=set(),
                         forward_active=int(cfg.active_microbatches))
        timeline = model.step_timeline()
        result.update(plan=plan.baton, chain=chain, events=len(timeline.events), ranks=timeline.num_ranks,
                      svg=render_svg(timeline)[:5], ascii=render_ascii(timeline),
                      all_steps=[list(a) for a in model.step_actions])
        out[f"{name}/{spelling}"] = result
    return out


def _check(results: list[dict[str, Any]], key: str, pp: int, microbatches: int) -> None:
    assert all(r["overlap"] for r in results), [(r["overlap"], r["cpus"]) for r in results]
    ranks = [r[key] for r in results]
    ref = next(r for r in ranks if "ref_losses" in r)
    for r in ranks:
        np.testing.assert_allclose(r["losses"], ref["ref_losses"], rtol=LOSS_RTOL,
                                   err_msg=f"{key}: losses of pp rank {r['pp_rank']}")
        assert r["none_grads"] and not any(r["none_grads"]), f"{key}: None gradients on pp rank {r['pp_rank']}"
    owned: dict[int, np.ndarray] = {}
    for r in ranks:
        owned.update(r["owned"])
    assert sorted(owned) == list(range(len(ref["ref_vars"]))), f"{key}: variables without an owner"
    for i, value in owned.items():
        np.testing.assert_allclose(value, ref["ref_vars"][i], rtol=VAR_RTOL, atol=VAR_ATOL,
                                   err_msg=f"{key}: variable {i} ({ref['paths'][i]})")
    for r in ranks:
        # Every step, not just the last, follows the plan (a fresh baton per run of the step).
        for step, actions in enumerate(r["all_steps"]):
            order = [(kind, m) for m, kind, _ in actions]
            assert order == [tuple(a) for a in r["plan"]], (
                f"{key}: pp rank {r['pp_rank']} step {step} ran\n  {order}\nthe plan for chain {r['chain']} is\n"
                f"  {r['plan']}")
        assert r["events"] == sum(len(x["actions"]) for x in ranks), f"{key}: timeline events"
        assert r["ranks"] == pp, f"{key}: timeline lanes {r['ranks']}"
        assert r["svg"].startswith(("<svg", "<?xml")), f"{key}: render_svg gave {r['svg']!r}"
        assert all(f"rank {p}" in r["ascii"] for p in range(pp)), r["ascii"]
    first = next(r for r in ranks if r["pp_rank"] == 0)["actions"]
    order = [(kind, m) for m, kind, _ in first]
    assert order.index(("F", 1)) < order.index(("B", 0)), f"{key}: pp rank 0 did not overlap microbatches: {order}"
    assert len(first) == 2 * microbatches * len([p for p in ranks[0]["chain"] if p == 0])


@pytest.fixture(scope="module")
def pp2_simple() -> list[dict[str, Any]]:
    config = {"pipeline_parallel_degree": 2, "microbatches": 8, "pipeline": "simple", "auto_partition": False,
              "default_partition": 0}
    return run_mpi_ranks(launch, 2, args=([("mlp", "tape"), ("tied_lm", "get_gradients"), ("bn_dropout", "tape")],
                                          config), timeout=300)


@pytest.fixture(scope="module")
def pp2_interleaved() -> list[dict[str, Any]]:
    """No SMP_TF_OVERLAP: ranks bound to a core each (``-bind-to core``) overlap by default."""
    config = {"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": "interleaved", "auto_partition": False,
              "default_partition": 0}
    return run_mpi_ranks(launch, 2, args=([("tied_lm", "tape"), ("bn_dropout", "tape")], config, None), timeout=300,
                         mpiexec_args=("-bind-to", "core"))


@pytest.fixture(scope="module")
def pp3_interleaved() -> list[dict[str, Any]]:
    config = {"pipeline_parallel_degree": 3, "microbatches": 4, "pipeline": "interleaved", "auto_partition": False,
              "default_partition": 0}
    return run_mpi_ranks(launch, 3, args=([("tied_lm", "tape")], config), timeout=300)


@pytest.mark.parametrize("key", ["mlp/tape", "tied_lm/get_gradients", "bn_dropout/tape"])
def test_pp2_simple_follows_the_plan_and_matches_one_process(pp2_simple: list[dict[str, Any]], key: str) -> None:
    _check(pp2_simple, key, 2, 8)


@pytest.mark.parametrize("key", ["tied_lm/tape", "bn_dropout/tape"])
def test_pp2_interleaved_follows_the_plan_and_matches_one_process(pp2_interleaved: list[dict[str, Any]],
                                                                   key: str) -> None:
    _check(pp2_interleaved, key, 2, 4)


def test_pp3_interleaved_tied_lm(pp3_interleaved: list[dict[str, Any]]) -> None:
    """Chain 0 -> 1 -> 2 -> 0 (the tied head on rank 0): rank 0 has two stages per microbatch."""
    _check(pp3_interleaved, "tied_lm/tape", 3, 4)


def test_overlap_mode_from_the_environment_and_the_cpu_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from smp.tensorflow.runtime.init import OVERLAP_ENV, overlap_requested

    from smp.errors import LaunchError

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.delenv(OVERLAP_ENV, raising=False)
    assert not overlap_requested()  # unbound: the ranks share every core, lockstep
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2})
    assert overlap_requested()  # bound to a core
    for value, want in (("0", False), ("off", False), ("1", True), ("Yes", True)):
        monkeypatch.setenv(OVERLAP_ENV, value)
        assert overlap_requested() is want, value
    monkeypatch.setenv(OVERLAP_ENV, "sometimes")
    with pytest.raises(LaunchError, match=r"SMP_TF_OVERLAP='sometimes'.*Fix: SMP_TF_OVERLAP=1"):
        overlap_requested()


def graph_of_a_step() -> dict[str, Any]:
    """One rank of a 2-layer model at pp2 with overlap: what the traced step's graph does at the gate.

    Returns, for the outer ``tf.function``: the ops that wait for the end-of-step barrier, and per
    backward end marker whether each tensor it probes has a reader besides that probe.
    """
    import os

    os.environ["SMP_TF_OVERLAP"] = "1"
    import keras
    import smp.tensorflow as smp
    import tensorflow as tf

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4, "auto_partition": False, "default_partition": 0})

    class TwoLayers(smp.DistributedModel):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.first = keras.layers.Dense(16, activation="tanh")
            self.second = keras.layers.Dense(16, activation="tanh")

        def call(self, x: Any) -> Any:
            with smp.partition(0):
                x = self.first(x)
            with smp.partition(1):
                return self.second(x)

    model = TwoLayers()
    opt = keras.optimizers.SGD(0.1)

    @smp.step
    def get_grads(x: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x)))
        return tape.gradient(loss, model.trainable_variables), loss

    @tf.function
    def train_step(x: Any) -> Any:
        grads, loss = get_grads(x)
        opt.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
        return loss.reduce_mean()

    x = np.ones((8, 16), np.float32)
    train_step(x)
    graph = train_step.get_concrete_function(tf.TensorSpec((8, 16), tf.float32)).graph
    ops = graph.get_operations()
    barrier = next(op for op in ops if op.name.startswith("smp_gate_barrier"))
    probed = []
    for end in (op for op in ops if op.name.startswith("smp_gate_end_B")):
        for probe in end.inputs[1:]:  # input 0: the start marker's token; then one slice per probed output
            tensor = probe.op.inputs[0].op.inputs[0]  # slice <- reshape <- the probed tensor
            probed.append(len(tensor.consumers()) > 1)
    return {"after_barrier": sorted(op.type for op in barrier._control_outputs), "probed_live": probed}


def test_gradients_do_not_wait_for_the_step_end_and_no_probe_computes_an_unread_gradient() -> None:
    """The step's outputs leave as they are made (the gradients are summed while later microbatches run,
    not after the last action), and a backward's end marker reads only gradients something else reads:
    on pp rank 0 the gradient of the model's input has no reader, and probing it would compute it."""
    results = run_mpi_ranks(graph_of_a_step, 2, timeout=120)
    for rank, got in enumerate(results):
        assert set(got["after_barrier"]) <= {"NoOp", "PyFunc"}, (rank, got["after_barrier"])  # the flush, the return
        assert got["probed_live"] and all(got["probed_live"]), (rank, got["probed_live"])
