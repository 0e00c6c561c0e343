"""Model parallelism divides memory in TensorFlow too: after partitioning and a step, each rank holds
the storage of its own variables only (the others' released), its optimizer keeps slots for those
alone, and the gradient list keeps one entry per variable, of size zero for the others' (no
full-size zeros). Counted from the variables' actual storage, at pp 2 and 3 and pp 2 x dp 2, with
the tape and with ``optimizer.get_gradients``; the losses still equal one process's (other tests)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.mpi_spawn import run_mpi_ranks

from . import cases_memory

pytestmark = pytest.mark.mpi


def _check(ranks: list[dict[str, Any]], pp: int) -> None:
    whole = ranks[0]["whole"]
    for r in ranks:
        where = f"pp rank {r['pp_rank']}"
        assert r["held"] == r["owned"], f"{where}: holds {r['held']} B of variables, owns {r['owned']} B"
        assert r["released"] == [not o for o in r["owned_mask"]], where
        if pp > 1:
            assert 0 < r["owned"] < whole, f"{where}: owns {r['owned']} of {whole} B"
        # Adam: two slots per variable this rank steps, none for the others
        assert r["slots"] == 2 * r["trainable_owned_bytes"], f"{where}: {r['slots']} B of Adam slots"
        assert r["slot_count"] == 2 * sum(r["trainable_owned"]), where
        # model.memory_check: the held bytes, and the placement's estimate of them
        check = r["check"]
        assert check["held"]["weights"] == r["held"] == check["estimate"]["weights"], f"{where}: {check}"
        slot_bytes = check["estimate"]["optimizer"]
        assert slot_bytes == r["slots"] and 0 <= check["held"]["optimizer"] - slot_bytes <= 64, f"{where}: {check}"
        for size, full, mine in zip(r["grad_sizes"], r["trainable_sizes"], r["trainable_owned"]):
            assert size == (full if mine else 0), f"{where}: a gradient of {size} elements ({full}, owned {mine})"
    assert sum(r["owned"] for r in ranks if True) == whole * (len(ranks) // pp), "the ranks' parts make the model"
    assert len({tuple(r["losses"]) for r in ranks}) == 1 or len(ranks) > pp


@pytest.mark.parametrize(("pp", "replicas", "api", "auto"), [(2, 1, "tape", False), (3, 1, "get_gradients", False),
                                                             (2, 2, "tape", False), (2, 1, "tape", True)])
def test_each_rank_holds_only_its_variables_and_their_slots(pp: int, replicas: int, api: str, auto: bool) -> None:
    ranks = run_mpi_ranks(cases_memory.held_share, pp * replicas, args=(pp, replicas, api, auto), timeout=180)
    _check(ranks, pp)


def test_a_rank_over_memory_per_rank_is_a_clear_error_on_every_rank_before_any_value() -> None:
    # 6 Dense(64) layers at pp 2: 3 per rank, 3 x (64 x 64 + 64) x 4 B = 49,920 B of weights, x 4 with
    # gradients and Adam's slots = 199,680 B per rank
    ranks = run_mpi_ranks(cases_memory.held_share, 2, args=(2, 1, "tape", False, 150_000), timeout=180)
    for r in ranks:
        msg = r["error"]
        assert msg is not None, "the step ran over the budget"
        assert "memory_per_rank=146.48 KiB" in msg and "rank 0: 195.00 KiB" in msg and "rank 1: 195.00 KiB" in msg, msg
        assert "weights 48.75 KiB" in msg and "pipeline_parallel_degree" in msg, msg
        assert r["held"] == 0, "variables got values before the check"
    ok = run_mpi_ranks(cases_memory.held_share, 2, args=(2, 1, "tape", False, 200_000), timeout=180)
    assert [r["error"] for r in ok] == [None, None]
