"""Robust statistics: exact values on small cases, invariances as properties."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepwatch_server.analysis.robust import MAD_TO_SIGMA, clip, mad, median, robust_stats

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)
samples = st.lists(finite, min_size=1, max_size=50)


def test_median_and_mad_exact() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert mad([1.0, 2.0, 3.0, 4.0, 100.0]) == 1.0
    with pytest.raises(ValueError, match="empty"):
        median([])


def test_identical_peers_give_finite_z() -> None:
    stats = robust_stats([0.22] * 8, rel_floor=0.01, abs_floor=1e-3)
    assert stats.mad == 0.0
    assert stats.scale == pytest.approx(max(0.01 * 0.22, 1e-3))
    assert math.isfinite(stats.z(0.31))
    assert stats.z(0.31) == pytest.approx((0.31 - 0.22) / stats.scale)


def test_outlier_does_not_move_median() -> None:
    base = [1.0, 1.01, 0.99, 1.02, 0.98, 1.0, 1.01, 0.99]
    with_outlier = [*base, 50.0]
    assert robust_stats(with_outlier).median == pytest.approx(1.0)
    assert robust_stats(with_outlier).z(50.0) > 100


def test_floors_are_validated() -> None:
    with pytest.raises(ValueError, match="abs_floor"):
        robust_stats([1.0], abs_floor=0.0)
    with pytest.raises(ValueError, match="finite"):
        robust_stats([1.0, math.nan])


@given(samples, st.randoms(use_true_random=False))
def test_permutation_invariant(values: list[float], rnd: random.Random) -> None:
    shuffled = list(values)
    rnd.shuffle(shuffled)
    assert robust_stats(values) == robust_stats(shuffled)


@given(samples, st.floats(min_value=-1e3, max_value=1e3))
def test_median_shift_equivariant(values: list[float], shift: float) -> None:
    assert median([v + shift for v in values]) == pytest.approx(median(values) + shift, abs=1e-6)
    assert mad([v + shift for v in values]) == pytest.approx(mad(values), abs=1e-6)


@given(samples, st.floats(min_value=0.0, max_value=0.5), st.floats(min_value=1e-9, max_value=1.0))
def test_scale_respects_floors(values: list[float], rel: float, abs_floor: float) -> None:
    stats = robust_stats(values, rel_floor=rel, abs_floor=abs_floor)
    assert stats.scale >= abs_floor
    assert stats.scale >= rel * abs(stats.median) - 1e-12
    assert stats.scale >= MAD_TO_SIGMA * stats.mad - 1e-12
    assert math.isfinite(stats.z(max(values)))
    assert stats.z(stats.median) == 0.0


@given(finite, st.floats(min_value=0.0, max_value=10.0))
def test_clip_bounds(x: float, bound: float) -> None:
    assert -bound <= clip(x, bound) <= bound
