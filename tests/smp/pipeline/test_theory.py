"""Exact theory on unit costs (peers.md section 11): bubble fractions and peak memory."""

from __future__ import annotations

import pytest

from smp.pipeline import Costs, build_plan, simulate

GRID = [(p, m) for p in (2, 3, 4, 5, 8) for m in sorted({p, p + 1, 2 * p, 3 * p + 1, 4 * p, 8 * p})]
ZB = Costs(forward=1, backward=2, backward_weight=1)  # F = I = W = 1


@pytest.mark.parametrize(("p", "m"), GRID)
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m(p: int, m: int) -> None:
    for name in ("gpipe", "1f1b"):
        result = simulate(build_plan(name, p, m))
        assert result.bubble_fraction == pytest.approx((p - 1) / m, abs=1e-12), name
        assert result.wall_share == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), name
        assert result.makespan == 3 * (m + p - 1)


@pytest.mark.parametrize(("p", "m"), GRID + [(4, 2), (8, 3)])
def test_in_flight_1f1b_min_p_minus_r_m_and_gpipe_m(p: int, m: int) -> None:
    assert simulate(build_plan("1f1b", p, m)).peak_in_flight == [min(p - r, m) for r in range(p)]
    assert simulate(build_plan("gpipe", p, m)).peak_in_flight == [m] * p


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 16), (4, 12), (8, 16), (8, 32), (3, 9)])
def test_interleaved_bubble_is_p_minus_1_over_v_m(p: int, m: int, v: int) -> None:
    result = simulate(build_plan("interleaved_1f1b", p, m, virtual_stages=v))
    assert result.bubble_fraction == pytest.approx((p - 1) / (v * m), abs=1e-12)


@pytest.mark.parametrize(("p", "v"), [(4, 2), (8, 4), (4, 4), (8, 2)])
def test_interleaved_first_rank_holds_p_plus_p_minus_1_over_v(p: int, v: int) -> None:
    """Megatron's warm-up 2(p-1) + (v-1)p (+1) chunks on rank 0 = p + (p-1)/v microbatches' worth."""
    per_chunk = Costs(activation_bytes=1 / v)
    result = simulate(build_plan("interleaved_1f1b", p, 4 * p, virtual_stages=v), per_chunk)
    assert result.peak_activation_bytes[0] == pytest.approx(p + (p - 1) / v)


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in GRID if m >= p])
def test_zb_h1_bubble_is_a_third_at_1f1b_peak(p: int, m: int) -> None:
    result = simulate(build_plan("zb_h1", p, m), ZB)
    assert result.bubble_fraction == pytest.approx((p - 1) / (3 * m), abs=1e-12)
    one_f_one_b = simulate(build_plan("1f1b", p, m))
    assert max(result.peak_in_flight) == max(one_f_one_b.peak_in_flight) == p


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in GRID if m >= 2 * p - 1])
def test_zb_v_below_zb_h1_at_1f1b_peak_memory(p: int, m: int) -> None:
    # a V segment is half a rank's share: half the activations
    result = simulate(build_plan("zb_v", p, m), Costs(forward=1, backward=2, backward_weight=1, activation_bytes=0.5))
    h1 = simulate(build_plan("zb_h1", p, m), ZB)
    assert result.bubble_fraction < h1.bubble_fraction
    assert result.bubble_fraction == pytest.approx((p - 1) / (6 * m), abs=1e-12)  # what this order reaches
    assert max(result.peak_activation_bytes) == pytest.approx(max(simulate(build_plan("1f1b", p, m)).peak_activation_bytes))


# peers.md section 11, "Worked bubble fractions", to the 3 decimals printed there.
PEERS_TABLE = [
    # p, m, 1F1B, wall share, interleaved v=2, v=4, ZB-H1
    (4, 8, 0.375, 0.273, 0.188, 0.094, 0.125),
    (4, 16, 0.188, 0.158, 0.094, 0.047, 0.062),
    (8, 16, 0.438, 0.304, 0.219, 0.109, 0.146),
    (8, 32, 0.219, 0.179, 0.109, 0.055, 0.073),
    (8, 64, 0.109, 0.099, 0.055, 0.027, 0.036),
    (16, 64, 0.234, 0.190, 0.117, 0.059, 0.078),
    (16, 128, 0.117, 0.105, 0.059, 0.029, 0.039),
]


@pytest.mark.parametrize(("p", "m", "f1b", "wall", "v2", "v4", "h1"), PEERS_TABLE)
def test_peers_worked_table(p: int, m: int, f1b: float, wall: float, v2: float, v4: float, h1: float) -> None:
    one = simulate(build_plan("1f1b", p, m))
    got = (
        one.bubble_fraction,
        one.wall_share,
        simulate(build_plan("interleaved_1f1b", p, m, virtual_stages=2)).bubble_fraction,
        simulate(build_plan("interleaved_1f1b", p, m, virtual_stages=4)).bubble_fraction,
        simulate(build_plan("zb_h1", p, m), ZB).bubble_fraction,
    )
    # the table prints 3 decimals
    for value, printed in zip(got, (f1b, wall, v2, v4, h1), strict=True):
        assert abs(value - printed) <= 0.0005 + 1e-12, (value, printed)
