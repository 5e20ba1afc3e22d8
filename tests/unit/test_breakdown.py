"""Interval arithmetic and the step time breakdown (DESIGN §3)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.profiler.breakdown import StepBreakdown, breakdown, clip, intersect, subtract, total, union

Interval = tuple[float, float]


def _parts(b: StepBreakdown) -> list[float]:
    return [b.compute_s, b.comm_overlapped_s, b.comm_exposed_s, b.data_wait_s, b.idle_s]


# -- interval operations ---------------------------------------------------------------


def test_union_sorts_merges_touching_and_drops_empty() -> None:
    assert union([(5, 6), (0, 2), (2, 3), (1, 1.5), (4, 4), (7, 6)]) == [(0, 3), (5, 6)]
    assert union([], [(1, 2)], [(0, 1)]) == [(0, 2)]
    assert union() == []


def test_intersect_subtract_clip_total() -> None:
    a = [(0.0, 4.0), (6.0, 10.0)]
    b = [(2.0, 7.0), (8.0, 9.0), (12.0, 13.0)]
    assert intersect(a, b) == [(2.0, 4.0), (6.0, 7.0), (8.0, 9.0)]
    assert subtract(a, b) == [(0.0, 2.0), (7.0, 8.0), (9.0, 10.0)]
    assert subtract(b, a) == [(4.0, 6.0), (12.0, 13.0)]
    assert subtract(a, []) == a
    assert subtract([], b) == []
    assert clip(a, 3.0, 7.0) == [(3.0, 4.0), (6.0, 7.0)]
    assert clip(a, 5.0, 5.0) == []
    assert total(a) == 8.0


def test_non_finite_bounds_are_rejected() -> None:
    with pytest.raises(ValueError, match="finite"):
        union([(0.0, math.nan)])
    with pytest.raises(ValueError, match="finite"):
        breakdown((0.0, math.inf), [], [], [])


_cells = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60)), max_size=12)


def _mask(intervals: list[tuple[int, int]]) -> set[int]:
    """Reference model: the unit cells [k, k+1) an interval set covers."""
    return {k for s, e in intervals for k in range(s, e)}


@settings(max_examples=200, deadline=None)
@given(_cells, _cells)
def test_interval_operations_match_a_cell_model(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> None:
    ua, ub = union(a), union(b)
    for got in (ua, ub):
        assert all(s < e for s, e in got)
        assert all(got[i][1] < got[i + 1][0] for i in range(len(got) - 1))  # sorted, disjoint, not touching
    ma, mb = _mask(a), _mask(b)
    assert total(ua) == len(ma)
    assert total(union(a, b)) == len(ma | mb)
    assert total(intersect(ua, ub)) == len(ma & mb)
    assert total(subtract(ua, ub)) == len(ma - mb)
    assert total(clip(ua, 10, 30)) == len({k for k in ma if 10 <= k < 30})


# -- breakdown ---------------------------------------------------------------------------


def test_hand_computed_example() -> None:
    """Step [0, 100]: loader 0-10; compute 5-50 and 60-80; comm 40-70 and 90-95.

    data wait   0-10                      = 10 (wins over compute 5-10)
    overlapped  40-50, 60-70              = 20
    compute     10-40, 70-80              = 40
    exposed     50-60, 90-95              = 15
    idle        80-90, 95-100             = 15
    """
    b = breakdown((0.0, 100.0), [(5, 50), (60, 80)], [(40, 70), (90, 95)], [(0, 10)])
    assert b == StepBreakdown(
        step_s=100.0,
        compute_s=40.0,
        comm_overlapped_s=20.0,
        comm_exposed_s=15.0,
        data_wait_s=10.0,
        idle_s=15.0,
    )
    assert b.overlap_ratio == pytest.approx(20 / 35)
    assert b.comm_s == 35.0


def test_everything_is_clipped_to_the_step() -> None:
    b = breakdown((10.0, 20.0), [(0, 12)], [(18, 40)], [(-5, 11)])
    assert (b.data_wait_s, b.compute_s, b.comm_exposed_s, b.idle_s) == (1.0, 1.0, 2.0, 6.0)


def test_data_wait_wins_over_communication() -> None:
    b = breakdown((0.0, 10.0), [], [(0, 10)], [(0, 4)])
    assert (b.data_wait_s, b.comm_exposed_s, b.comm_overlapped_s) == (4.0, 6.0, 0.0)


def test_no_communication_has_no_overlap_ratio() -> None:
    b = breakdown((0.0, 1.0), [(0, 1)], [], [])
    assert b.overlap_ratio is None
    assert b.compute_s == 1.0


def test_empty_and_reversed_steps() -> None:
    assert breakdown((5.0, 5.0), [(0, 10)], [], []) == StepBreakdown(0, 0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="ends before"):
        breakdown((5.0, 4.0), [], [], [])


def test_large_profiler_timestamps_keep_precision() -> None:
    """Kineto timestamps are ~5e12 µs; lengths are taken after shifting to the step start."""
    t0 = 5_099_495_338_356.71
    b = breakdown((t0, t0 + 1000.0), [(t0 + 1.0, t0 + 2.0)], [], [])
    assert b.compute_s == pytest.approx(1.0, abs=1e-3)
    assert math.fsum(_parts(b)) == pytest.approx(b.step_s, abs=1e-9)


def test_scaled_converts_units() -> None:
    b = breakdown((0.0, 1e6), [(0, 5e5)], [], []).scaled(1e-6)
    assert (b.step_s, b.compute_s, b.idle_s) == (1.0, 0.5, 0.5)


_t = st.floats(0.0, 1_000.0, allow_nan=False)
_ivs = st.lists(st.tuples(_t, _t), max_size=15)


@settings(max_examples=300, deadline=None)
@given(st.tuples(_t, _t), _ivs, _ivs, _ivs)
def test_parts_are_non_negative_and_sum_to_the_step(
    step: Interval, compute: list[Interval], comm: list[Interval], wait: list[Interval]
) -> None:
    step = (min(step), max(step))
    b = breakdown(step, compute, comm, wait)
    assert b.step_s == step[1] - step[0]
    assert all(p >= 0.0 for p in _parts(b))
    assert math.fsum(_parts(b)) == pytest.approx(b.step_s, abs=1e-9)
    ratio = b.overlap_ratio
    assert ratio is None or 0.0 <= ratio <= 1.0


@settings(max_examples=200, deadline=None)
@given(_cells, _cells, _cells)
def test_breakdown_matches_a_cell_model(
    compute: list[tuple[int, int]], comm: list[tuple[int, int]], wait: list[tuple[int, int]]
) -> None:
    """With integer endpoints every part is an exact count of unit cells."""
    step = set(range(5, 55))
    w = _mask(wait) & step
    c = (_mask(compute) & step) - w
    m = (_mask(comm) & step) - w
    b = breakdown((5.0, 55.0), compute, comm, wait)
    assert b.data_wait_s == len(w)
    assert b.comm_overlapped_s == len(c & m)
    assert b.compute_s == len(c - m)
    assert b.comm_exposed_s == len(m - c)
    assert b.idle_s == len(step - w - c - m)
