"""smp.tensorflow DistributedModel with manual placement against one Keras process (real MPI ranks).

Each launch trains several models (`cases.train`): the DistributedModel through ``@smp.step`` in an
outer ``@tf.function`` with ``optimizer.apply_gradients``, and on pp rank 0 the same model class
on ``keras.Model`` in one process, same initial values, same microbatches. Checked: the loss of
every step on every rank, every variable (taken from its owner, non-trainable ones included:
BatchNorm moving stats, the dropout seed state) after 3 Adam steps, no None gradient, zero
gradients for the variables another rank owns, the post-partition hook ran once per model, and
the recorded action order (lockstep: each microbatch's forward, then its backward).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.helpers.mpi_spawn import run_mpi_ranks

from . import cases

pytestmark = pytest.mark.mpi

LOSS_RTOL = 1e-6
# Adam after 3 steps: rounding differences of ~1e-8 in a gradient (another summation order of
# the two reads of a tied or reused variable) move a weight by up to ~1e-6.
VAR_ATOL, VAR_RTOL = 2e-6, 1e-6


def _config(pp: int, auto: bool = False) -> dict[str, Any]:
    return {"pipeline_parallel_degree": pp, "microbatches": cases.MICROBATCHES, "auto_partition": auto,
            "default_partition": 0}


def _check_case(results: list[dict[str, Any]], key: str, pp: int) -> None:
    ranks = [r[key] for r in results]
    ref = next(r for r in ranks if "ref_losses" in r)
    for r in ranks:
        np.testing.assert_allclose(r["losses"], ref["ref_losses"], rtol=LOSS_RTOL,
                                   err_msg=f"{key}: losses of pp rank {r['pp_rank']}")
        assert r["none_grads"] and not any(r["none_grads"]), f"{key}: None gradients on pp rank {r['pp_rank']}"
        assert r["hook_runs"] == 1, f"{key}: post-partition hook ran {r['hook_runs']} times"
        for step_sums in r["grad_sums"]:
            for owner, g in zip(r["owner_of_trainable"], step_sums):
                if owner != r["pp_rank"]:
                    assert g == 0.0, f"{key}: pp rank {r['pp_rank']} has a nonzero gradient for a variable of {owner}"
    owned: dict[int, np.ndarray] = {}
    for r in ranks:
        for i, value in r["owned"].items():
            assert i not in owned, f"{key}: variable {i} owned by two ranks"
            owned[i] = value
    assert sorted(owned) == list(range(len(ref["ref_vars"]))), f"{key}: variables without an owner"
    for i, value in owned.items():
        np.testing.assert_allclose(value, ref["ref_vars"][i], rtol=VAR_RTOL, atol=VAR_ATOL,
                                   err_msg=f"{key}: variable {i} ({ref['paths'][i]})")
    if pp > 1:
        assert {r["pp_rank"] for r in ranks} == set(range(pp))
        assert all(any(o == p for o in ranks[0]["owner_of_trainable"]) for p in range(pp)), \
            f"{key}: a partition owns no trainable variable:\n{ref['stages']}"
    for r in ranks:
        actions = r["actions"]
        assert [a[0] for a in actions] == sorted(a[0] for a in actions), f"{key}: microbatches out of order: {actions}"
        for m in range(cases.MICROBATCHES):
            mine = [a for a in actions if a[0] == m]
            forward = [a[2] for a in mine if a[1] == "F"]
            assert forward and [a[2] for a in mine if a[1] == "B"] == forward[::-1], f"{key}: {mine}"


@pytest.fixture(scope="module")
def pp2_sessions() -> list[dict[str, Any]]:
    """Manual placement, then (after smp.reset) auto_partition: one 2-rank job."""
    return run_mpi_ranks(cases.launch_sessions, 2, args=({
        "manual": ([("mlp", "tape"), ("tied_lm", "get_gradients"), ("bn_dropout", "tape"),
                    ("tied_lm", "tape+none_batch"), ("cnn", "tape")], _config(2)),
        "auto": ([("tied_lm", "tape"), ("mlp", "get_gradients"), ("cnn", "tape")], _config(2, auto=True))},),
        timeout=500)


@pytest.fixture(scope="module")
def pp2(pp2_sessions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r["manual"] for r in pp2_sessions]


@pytest.fixture(scope="module")
def pp3() -> list[dict[str, Any]]:
    return run_mpi_ranks(cases.launch, 3, args=([("tied_lm", "tape")], _config(3)),
                         timeout=300)


@pytest.fixture(scope="module")
def pp2_auto(pp2_sessions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r["auto"] for r in pp2_sessions]


@pytest.fixture(scope="module")
def pp1() -> list[dict[str, Any]]:
    return run_mpi_ranks(cases.single, 1, timeout=240)


@pytest.mark.parametrize("key", ["mlp/tape", "tied_lm/get_gradients", "bn_dropout/tape", "tied_lm/tape+none_batch",
                                 "cnn/tape"])
def test_pp2_matches_one_process(pp2: list[dict[str, Any]], key: str) -> None:
    _check_case(pp2, key, 2)


@pytest.mark.parametrize("key", ["tied_lm/get_gradients", "tied_lm/tape+none_batch"])
def test_pp2_tied_lm_crosses_the_cut_back_and_forth(pp2: list[dict[str, Any]], key: str) -> None:
    """0 -> 1 -> 0 -> 1: four stages, and the tied embedding is read on its owner (0) and sent."""
    stages = pp2[0][key]["stages"].splitlines()
    assert [line.split(",")[0].split(": ")[1] for line in stages] == [
        "partition 0", "partition 1", "partition 0", "partition 1"], "\n".join(stages)
    assert "MatMul/ReadVariableOp" in stages[2], "the tied head's read of the embedding is not sent from its owner"
    if key.endswith("none_batch"):
        assert "[None, 3, 8]" in stages[0], "the boundaries of a None-batch step should have an unknown batch size"


@pytest.mark.parametrize("key", ["mlp/tape", "tied_lm/get_gradients", "cnn/tape"])
def test_pp2_gradients_of_variables_another_rank_owns_are_known_zeros(pp2: list[dict[str, Any]], key: str) -> None:
    """Each rank's gradient of a variable it does not own is the engine's marked zero in every microbatch.

    `StepOutput` reduces those to one zero (no per-microbatch adds and scaling): a fifth of a
    rank's step on benchmarks/tf_pipeline.py. If the mark stops reaching the step's outputs the
    values stay right and only the speed goes, so this test watches the mark.
    """
    for r in pp2:
        case = r[key]
        unowned = sum(owner != case["pp_rank"] for owner in case["owner_of_trainable"])
        assert unowned > 0
        assert set(case["unowned_grads"]) == {unowned}, (case["pp_rank"], case["unowned_grads"], unowned)


def test_pp2_dropout_masks_change_per_step_and_equal_one_process(pp2: list[dict[str, Any]]) -> None:
    """The seed state advances on its owner every microbatch (masks differ), and losses equal the reference."""
    owner = next(r for r in pp2 if r["bn_dropout/tape"]["pp_rank"] == 0)["bn_dropout/tape"]
    counters = [s[1] for s in owner["seeds"]]
    assert counters == sorted(set(counters)) and len(counters) == cases.STEPS, owner["seeds"]


def test_pp3_matches_one_process(pp3: list[dict[str, Any]]) -> None:
    _check_case(pp3, "tied_lm/tape", 3)
    stages = pp3[0]["tied_lm/tape"]["stages"].splitlines()
    assert [line.split(",")[0].split(": ")[1] for line in stages][-1] == "partition 0", "\n".join(stages)


@pytest.mark.parametrize("key", ["tied_lm/tape", "mlp/get_gradients", "cnn/tape"])
def test_pp2_auto_partition_matches_one_process(pp2_auto: list[dict[str, Any]], key: str) -> None:
    """auto_partition (the default): pp rank 0's decision, broadcast, applied like a manual one; scopes ignored."""
    _check_case(pp2_auto, key, 2)
    assert "smp_partition_" not in pp2_auto[0][key]["stages"]


@pytest.mark.parametrize("key", ["mlp/tape", "bn_dropout/get_gradients", "mlp/tape/no_outer"])
def test_pp1_matches_one_process(pp1: list[dict[str, Any]], key: str) -> None:
    _check_case(pp1, key, 1)
    assert pp1[0][key]["stages"].count("stage ") == 1 and "sends -" in pp1[0][key]["stages"]


def test_misuse_errors_name_the_fix(pp1: list[dict[str, Any]]) -> None:
    r = pp1[0]
    assert r["call_outside_step"].startswith("SMPError") and "@smp.step" in r["call_outside_step"]
    assert r["get_gradients_eager"].startswith("SMPError") and "smp.step" in r["get_gradients_eager"]
    assert r["partition_out_of_range"].startswith("InvalidPartitionIDError"), r["partition_out_of_range"]
    assert "[0, 1)" in r["partition_out_of_range"]
    assert r["installed"] and r["uninstalled"]
    with_flag, without, programs = r["training_dropped"]
    np.testing.assert_array_equal(with_flag, without)
    assert programs == 1, "training= on a call() without it should not make a second trace"
