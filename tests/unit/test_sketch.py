"""The mergeable log-bucket quantile sketch.

Exact reference: the *lower* quantile, the element of 0-based rank
``floor(q * (n - 1))`` of the sorted input, which is what ``LogSketch.quantile``
promises to approximate within relative error ``alpha``.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.sketch import MAX_BUCKETS, MIN_VALUE, LogSketch


def exact_lower_quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[math.floor(q * (len(s) - 1))]


def sketch_of(values: list[float], alpha: float = 0.01) -> LogSketch:
    sk = LogSketch(alpha)
    for v in values:
        sk.add(v)
    return sk


def same_state(a: LogSketch, b: LogSketch) -> None:
    """Equal buckets, counts and extremes; the float sum only up to rounding order."""
    da, db = a.to_dict(), b.to_dict()
    assert da.pop("sum") == pytest.approx(db.pop("sum"), rel=1e-12)
    assert da == db
    assert a.buckets() == b.buckets()


# Positive values spread over 12 decades (1 µs to 1 Ms when the unit is seconds).
_values = st.lists(st.floats(-6.0, 6.0).map(lambda e: 10.0**e), min_size=1, max_size=300)
_q = st.one_of(st.sampled_from([0.0, 0.01, 0.25, 0.5, 0.9, 0.99, 1.0]), st.floats(0.0, 1.0))


@settings(max_examples=150, deadline=None)
@given(_values, st.lists(_q, min_size=1, max_size=8), st.sampled_from([0.01, 0.02, 0.05]))
def test_quantiles_are_within_alpha_of_the_exact_lower_quantile(
    values: list[float], qs: list[float], alpha: float
) -> None:
    sk = sketch_of(values, alpha)
    for q in qs:
        exact = exact_lower_quantile(values, q)
        got = sk.quantile(q)
        assert got is not None
        assert abs(got - exact) <= alpha * exact * (1 + 1e-9), (q, got, exact)
    assert sk.count == len(values)
    assert sk.min == min(values)
    assert sk.max == max(values)
    assert sk.sum == pytest.approx(math.fsum(values), rel=1e-9)


@settings(max_examples=100, deadline=None)
@given(_values, _values)
def test_merge_equals_the_sketch_of_the_concatenation(a: list[float], b: list[float]) -> None:
    merged = sketch_of(a)
    merged.merge(sketch_of(b))
    same_state(merged, sketch_of(a + b))
    same_state(merged, sketch_of(b + a))


@settings(max_examples=100, deadline=None)
@given(_values)
def test_round_trip_through_json(values: list[float]) -> None:
    sk = sketch_of(values)
    d = json.loads(json.dumps(sk.to_dict(), allow_nan=False))
    back = LogSketch.from_dict(d)
    assert back.to_dict() == sk.to_dict()
    for q in (0.0, 0.5, 0.99, 1.0):
        assert back.quantile(q) == sk.quantile(q)


def test_wire_format() -> None:
    sk = LogSketch()
    for v in (0.0, 1.0, 1.0, 1.5):
        sk.add(v)
    d = sk.to_dict()
    assert set(d) == {"alpha", "offset", "counts", "zero", "count", "sum", "min", "max"}
    assert d["alpha"] == 0.01
    assert d["offset"] == 0  # ceil(log_gamma(1.0)) == 0
    counts = d["counts"]
    assert isinstance(counts, list)
    assert counts[0] == 2 and counts[-1] == 1 and sum(counts) == 3
    assert (d["zero"], d["count"], d["sum"], d["min"], d["max"]) == (1, 4, 3.5, 0.0, 1.5)


def test_empty_sketch() -> None:
    sk = LogSketch()
    assert sk.quantile(0.5) is None
    assert sk.count == 0 and sk.min == math.inf and sk.max == -math.inf
    d = sk.to_dict()
    assert d == {
        "alpha": 0.01,
        "offset": 0,
        "counts": [],
        "zero": 0,
        "count": 0,
        "sum": 0.0,
        "min": None,
        "max": None,
    }
    assert LogSketch.from_dict(d).to_dict() == d
    other = sketch_of([2.0])
    other.merge(sk)
    sk.merge(other)
    same_state(sk, other)


def test_zero_bucket_and_weights() -> None:
    sk = LogSketch()
    sk.add(0.0, count=3)
    sk.add(MIN_VALUE / 2)
    sk.add(2.0, count=4)
    assert sk.zero_count == 4 and sk.count == 8
    assert sk.quantile(0.0) == 0.0
    assert sk.quantile(0.4) == 0.0  # rank 2 of 8: a zero
    assert sk.quantile(0.9) == pytest.approx(2.0, rel=0.01)
    sk.add(5.0, count=0)
    assert sk.count == 8


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_add_rejects_values_that_are_not_durations(bad: float) -> None:
    with pytest.raises(ValueError, match="finite and >= 0"):
        LogSketch().add(bad)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="alpha"):
        LogSketch(0.0)
    with pytest.raises(ValueError, match="count"):
        LogSketch().add(1.0, count=-1)
    with pytest.raises(ValueError, match="q must be"):
        sketch_of([1.0]).quantile(1.5)
    with pytest.raises(ValueError, match="different alpha"):
        LogSketch(0.01).merge(LogSketch(0.02))


def test_bucket_span_is_bounded_and_folding_keeps_merge_exact() -> None:
    """Values over ~208 decades need ~24,000 buckets at 1%: the lowest are folded."""
    low = [1e-8 * 1.5**i for i in range(50)]
    high = [1e200 * 1.1**i for i in range(50)]
    sk = sketch_of(low + high)
    keys = list(sk.buckets())
    assert keys[-1] - keys[0] < MAX_BUCKETS
    counts = sk.to_dict()["counts"]
    assert isinstance(counts, list) and len(counts) <= MAX_BUCKETS
    assert sk.quantile(0.99) == pytest.approx(exact_lower_quantile(low + high, 0.99), rel=0.01)
    assert sk.quantile(0.0) == 1e-8  # min and max stay exact
    a, b = sketch_of(high), sketch_of(low)
    a.merge(b)
    same_state(a, sk)
    same_state(LogSketch.from_dict(sk.to_dict()), sk)


def _good() -> dict[str, Any]:
    return sketch_of([0.0, 0.5, 1.0, 2.0]).to_dict()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"alpha": math.nan}, "alpha"),
        ({"alpha": 2.0}, "alpha"),
        ({"alpha": "0.01"}, "alpha"),
        ({"offset": 1.5}, "offset"),
        ({"offset": True}, "offset"),
        ({"offset": 10**9}, "offset"),
        ({"counts": "1,2"}, "counts"),
        ({"counts": [1] * (MAX_BUCKETS + 1), "count": MAX_BUCKETS + 2}, "counts"),
        ({"counts": [1, -1, 1]}, "counts"),
        ({"counts": [1, 1.0]}, "counts"),
        ({"zero": -1}, "zero"),
        ({"count": 99}, "count"),
        ({"count": True}, "count"),
        ({"sum": math.nan}, "sum"),
        ({"sum": math.inf}, "sum"),
        ({"sum": -1.0}, "sum"),
        ({"min": None}, "min"),
        ({"max": math.nan}, "max"),
        ({"min": 3.0}, "max"),
        ({"min": -1.0}, "min"),
        ({"unexpected": 1}, "unexpected"),
    ],
)
def test_from_dict_rejects_bad_input_naming_the_field(change: dict[str, Any], field: str) -> None:
    d = _good()
    d.update(change)
    with pytest.raises(ValueError, match=f"'{field}'"):
        LogSketch.from_dict(d)


@pytest.mark.parametrize("field", ["alpha", "offset", "counts", "zero", "count", "sum", "min", "max"])
def test_from_dict_rejects_missing_fields(field: str) -> None:
    d = _good()
    del d[field]
    with pytest.raises(ValueError, match=f"'{field}'"):
        LogSketch.from_dict(d)


def test_from_dict_rejects_a_non_object_and_an_inconsistent_empty_sketch() -> None:
    with pytest.raises(ValueError, match="object"):
        LogSketch.from_dict([1, 2])  # type: ignore[arg-type]
    empty = LogSketch().to_dict()
    empty["min"] = 1.0
    with pytest.raises(ValueError, match="'min'"):
        LogSketch.from_dict(empty)


def test_an_alpha_out_of_range_is_named_the_same_by_the_constructor_and_the_document_check() -> None:
    d = LogSketch(0.01).to_dict()
    with pytest.raises(ValueError, match=r"^alpha must be a number in \[0.0001, 0.5\], got 2$"):
        LogSketch(2)
    for check in (LogSketch.check, LogSketch.from_dict):
        with pytest.raises(ValueError, match=r"^sketch field 'alpha' is invalid: alpha must be .* got 0.9$"):
            check(dict(d, alpha=0.9))
