"""The planner's formulas on hand-computed cases, and properties of the integer split."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.planner import formulas as F


def test_min_prompt_depth_rounds_up():
    assert F.min_prompt_depth(L=10, W0=3, C0=1, M=16) == 3  # ceil(40/16)
    assert F.min_prompt_depth(L=10, W0=3, C0=1, M=1000) == 1


def test_min_token_depth():
    assert F.min_token_depth(L=10, W0=3, C0=1, K0=1, M=25) == 6  # 30/(25-20)
    assert F.min_token_depth(L=10, W0=3, C0=1, K0=1, M=26) == 5  # ceil(30/6)


def test_min_token_depth_rejects_kv_that_does_not_fit():
    with pytest.raises(ValueError, match="does not fit"):
        F.min_token_depth(L=10, W0=3, C0=1, K0=1, M=20)


def test_inverse_throughputs():
    assert F.colocated_inverse_throughput(D=4, Y=10, t=1, N=20) == pytest.approx(36.75)
    assert F.prompt_inverse_throughput(D=7, D_p=2, Y=10, m=1.5) == pytest.approx(52.5)
    assert F.token_inverse_throughput(D=7, D_t=4, t=1, N=25) == pytest.approx(43.75)
    assert F.disaggregated_inverse_throughput(7, 3, 4, 10, 1, 25, 1.5) == pytest.approx(43.75)


def test_optimal_split_balances_both_pools():
    dp, dt = F.optimal_split(D=8, Y=10, t=1, N=20, m=1.5)
    assert (dp, dt) == pytest.approx((8 * 15 / 35, 8 * 20 / 35))
    assert F.prompt_inverse_throughput(8, dp, 10, 1.5) == pytest.approx(35)  # = m*Y + N*t
    assert F.token_inverse_throughput(8, dt, 1, 20) == pytest.approx(35)


def test_threshold():
    assert F.disaggregation_threshold(D=4, m=1.5) == pytest.approx(3.0)
    assert F.disaggregation_threshold(D=4, m=1.0) == pytest.approx(1.0)
    assert F.disaggregation_threshold(D=4, m=1.8) == math.inf  # 4*0.2 - 1 < 0
    assert F.disaggregation_threshold(D=4, m=1.75) == math.inf  # denominator exactly 0
    assert F.should_disaggregate(D=4, Y=3.5, t=1, m=1.5)
    assert not F.should_disaggregate(D=4, Y=2.5, t=1, m=1.5)
    with pytest.raises(ValueError, match="m must be >= 1"):
        F.disaggregation_threshold(D=4, m=0.9)


def test_threshold_is_where_colocated_and_balanced_disaggregated_meet():
    D, m, t, N = 6, 1.3, 1.0, 40
    Y = F.disaggregation_threshold(D, m) * t
    assert F.colocated_inverse_throughput(D, Y, t, N) == pytest.approx(m * Y + N * t)


def test_integer_split_picks_the_better_neighbour():
    s = F.integer_split(D=7, Y=10, t=1, N=25, m=1.5, dp_min=1, dt_min=1)  # real D_p = 2.625
    assert (s.D_p, s.D_t) == (3, 4)
    assert s.I_dis == pytest.approx(43.75)  # D_p = 2 would give 52.5


def test_integer_split_respects_minimum_depths():
    s = F.integer_split(D=7, Y=10, t=1, N=25, m=1.5, dp_min=4, dt_min=1)
    assert (s.D_p, s.D_t) == (4, 3)
    s = F.integer_split(D=7, Y=10, t=1, N=25, m=1.5, dp_min=1, dt_min=6)
    assert (s.D_p, s.D_t) == (1, 6)
    with pytest.raises(ValueError, match="cannot hold"):
        F.integer_split(D=7, Y=10, t=1, N=25, m=1.5, dp_min=4, dt_min=4)


@settings(max_examples=300, deadline=None)
@given(
    D=st.integers(2, 64),
    Y=st.floats(1e-3, 10),
    t=st.floats(1e-4, 1),
    N=st.integers(1, 2048),
    m=st.floats(1.0, 1.99),
    L=st.integers(1, 128),
    W0=st.floats(0.01, 10),
    C0=st.floats(0.0, 1),
    K0=st.floats(0.0, 1),
    M=st.floats(1, 500),
)
def test_integer_split_properties(D, Y, t, N, m, L, W0, C0, K0, M):
    try:
        dp_min = F.min_prompt_depth(L, W0, C0, M)
        dt_min = F.min_token_depth(L, W0, C0, K0, M)
    except ValueError:
        return  # the KV of one microbatch does not fit: nothing to split
    if dp_min + dt_min > D:
        with pytest.raises(ValueError):
            F.integer_split(D, Y, t, N, m, dp_min, dt_min)
        return
    s = F.integer_split(D, Y, t, N, m, dp_min, dt_min)
    assert s.D_p + s.D_t == D
    assert s.D_p >= dp_min and s.D_t >= dt_min
    # The memory bounds the minimums encode still hold after rounding.
    assert L * (C0 + W0) / s.D_p <= M * (1 + 1e-9)
    assert L * W0 / s.D_t + L * (C0 + K0) <= M * (1 + 1e-9)
    # No feasible integer split is faster.
    best = min(
        F.disaggregated_inverse_throughput(D, dp, D - dp, Y, t, N, m)
        for dp in range(dp_min, D - dt_min + 1)
    )
    assert s.I_dis == pytest.approx(best, rel=1e-12)
