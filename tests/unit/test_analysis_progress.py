"""Progress and goodput: the seed arithmetic exactly, and the projection's shape."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepwatch_server.analysis import (
    ThroughputWindow,
    calendar_efficiency,
    duration_s,
    project,
    required_step_time_s,
)
from stepwatch_server.analysis.progress import SECONDS_PER_DAY, quantile

UPDATES = 635_782
TOKENS_PER_STEP = 4_194_304.0  # 1,024 sequences of 4,096 tokens


def days(seconds: float) -> float:
    return seconds / SECONDS_PER_DAY


def test_seed_arithmetic() -> None:
    assert round(days(duration_s(UPDATES, 12.0, 0.9)), 2) == 98.11
    assert round(days(duration_s(UPDATES, 10.0, 0.9)), 2) == 81.76
    assert round(required_step_time_s(UPDATES, 76 * SECONDS_PER_DAY, 0.9), 2) == 9.30


def test_seed_arithmetic_through_project() -> None:
    recent = [ThroughputWindow(tokens=100 * TOKENS_PER_STEP, steps=100, seconds=1_200.0)] * 5
    p = project(
        target_tokens=UPDATES * TOKENS_PER_STEP,
        tokens_done=0.0,
        recent=recent,
        now=0.0,
        efficiency=0.9,
        deadline=76 * SECONDS_PER_DAY,
    )
    assert p.eta_s is not None
    assert round(days(p.eta_s), 2) == 98.11
    assert p.step_time_s == 12.0
    assert p.remaining_steps == pytest.approx(UPDATES)
    assert p.required_step_time_s is not None
    assert round(p.required_step_time_s, 2) == 9.30
    assert p.on_track is False
    assert p.eta_early_s == p.eta_late_s == p.eta_s  # identical windows: no spread


def test_measured_calendar_efficiency_and_band() -> None:
    recent = [
        ThroughputWindow(tokens=20 * TOKENS_PER_STEP, steps=20, seconds=20 * step)
        for step in (9.5, 10.0, 10.5, 10.0)
    ]
    p = project(
        target_tokens=1_000_000 * TOKENS_PER_STEP,
        tokens_done=250_000 * TOKENS_PER_STEP,
        recent=recent,
        now=5_000.0,
        productive_s=900.0,
        wall_s=1_000.0,
        deadline=5_000.0 + 100 * SECONDS_PER_DAY,
    )
    assert p.calendar_efficiency == pytest.approx(0.9)
    assert p.fraction_done == pytest.approx(0.25)
    assert p.step_time_s == pytest.approx(10.0)
    assert p.eta_s == pytest.approx(750_000 * 10.0 / 0.9)
    assert p.eta_early_s is not None and p.eta_late_s is not None and p.eta_s is not None
    assert p.eta_early_s < p.eta_s < p.eta_late_s
    assert p.finish_at == pytest.approx(5_000.0 + p.eta_s)
    assert p.required_step_time_s == pytest.approx(100 * SECONDS_PER_DAY * 0.9 / 750_000)
    assert p.on_track is True


def test_no_throughput_yet() -> None:
    p = project(target_tokens=1e9, tokens_done=0.0, recent=[], now=0.0)
    assert p.eta_s is None and p.tokens_per_s is None and p.required_step_time_s is None
    assert p.calendar_efficiency == 1.0


def test_done_run() -> None:
    recent = [ThroughputWindow(tokens=1e6, steps=1, seconds=1.0)]
    p = project(target_tokens=1e9, tokens_done=2e9, recent=recent, now=10.0, deadline=20.0)
    assert p.remaining_tokens == 0 and p.fraction_done == 1.0 and p.eta_s == 0.0
    assert p.on_track is True


def test_calendar_efficiency_bounds() -> None:
    assert calendar_efficiency(90.0, 100.0) == pytest.approx(0.9)
    assert calendar_efficiency(0.0, 0.0) == 1.0
    assert calendar_efficiency(120.0, 100.0) == 1.0
    with pytest.raises(ValueError, match="efficiency"):
        project(target_tokens=1.0, tokens_done=0.0, recent=[], now=0.0, efficiency=0.0)


@given(
    st.floats(min_value=1.0, max_value=1e7),
    st.floats(min_value=0.1, max_value=100.0),
    st.floats(min_value=0.05, max_value=1.0),
)
def test_required_step_time_inverts_duration(steps: float, step_time: float, eff: float) -> None:
    assert required_step_time_s(steps, duration_s(steps, step_time, eff), eff) == pytest.approx(step_time)


@given(st.lists(st.floats(min_value=0.0, max_value=1e6), min_size=1, max_size=30), st.floats(0.0, 1.0))
def test_quantile_within_range(values: list[float], q: float) -> None:
    assert min(values) <= quantile(values, q) <= max(values)
