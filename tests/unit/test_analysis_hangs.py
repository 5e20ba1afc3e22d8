"""Hang checks: thresholds, silent ranks, and a stopped run."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepwatch_server.analysis import check_hang, hang_threshold_s

NOW = 1_000_000.0


def test_threshold_is_k_times_median_with_a_floor() -> None:
    assert hang_threshold_s(12.0) == 120.0
    assert hang_threshold_s(2.0) == 60.0
    assert hang_threshold_s(None) == 60.0
    assert hang_threshold_s(2.0, k=5, floor_s=5) == 10.0


def test_healthy_run_has_no_hang() -> None:
    last = {r: NOW - 3.0 for r in range(8)}
    assert check_hang(NOW, last, median_step_s=2.0) == []
    assert check_hang(NOW, {}, median_step_s=2.0) == []


def test_silent_rank_while_the_run_steps() -> None:
    last = {r: NOW - 1.0 for r in range(8)}
    last[5] = NOW - 400.0
    [finding] = check_hang(
        NOW, last, median_step_s=12.0, run="job", host_by_rank={5: "n1"}, last_step_by_rank={5: 41_200}
    )
    assert finding.kind == "hang"
    assert finding.key == "hang:rank=5"
    assert finding.ranks == (5,)
    assert finding.hosts == ("n1",)
    assert finding.first_step == 41_200
    assert finding.evidence["threshold_s"] == 120.0
    assert finding.evidence["silent_s"] == 400.0
    assert finding.cost_seconds == 400.0
    assert finding.message.startswith("Rank 5 (host n1) has not reported a step for 6.7 min")


def test_exactly_at_threshold_is_not_a_hang() -> None:
    assert check_hang(NOW, {0: NOW - 120.0, 1: NOW}, median_step_s=12.0) == []
    assert len(check_hang(NOW, {0: NOW - 120.5, 1: NOW}, median_step_s=12.0)) == 1


def test_whole_run_hang_names_the_rank_that_stopped_first() -> None:
    last_time = {r: NOW - 300.0 for r in range(16)}
    last_step = dict.fromkeys(range(16), 1_001)
    last_step[9] = 1_000  # rank 9 never finished step 1,001: the others wait for it
    last_time[9] = NOW - 312.0
    [finding] = check_hang(
        NOW,
        last_time,
        median_step_s=12.0,
        run="job",
        host_by_rank={r: f"n{r // 8}" for r in range(16)},
        last_step_by_rank=last_step,
    )
    assert finding.key == "hang:run"
    assert finding.ranks == (9,)
    assert finding.hosts == ("n1",)
    assert finding.evidence["silent_s"] == 300.0
    assert finding.message == (
        "Run job has made no step for 5.0 min (threshold 2.0 min); rank 9 stopped first (at step 1,000)."
    )


def test_whole_run_hang_all_together() -> None:
    [finding] = check_hang(NOW, dict.fromkeys(range(4), NOW - 90.0), median_step_s=2.0)
    assert finding.key == "hang:run"
    assert finding.ranks == ()
    assert "all ranks stopped together" in finding.message


@given(
    st.dictionaries(st.integers(0, 64), st.floats(min_value=0.0, max_value=10_000.0), min_size=1),
    st.floats(min_value=0.1, max_value=60.0),
)
def test_flags_exactly_the_ranks_past_the_threshold(silence: dict[int, float], median: float) -> None:
    last = {r: NOW - s for r, s in silence.items()}
    threshold = hang_threshold_s(median)
    findings = check_hang(NOW, last, median)
    if min(silence.values()) > threshold:
        assert [f.key for f in findings] == ["hang:run"]
    else:
        assert {f.ranks[0] for f in findings} == {r for r, s in silence.items() if NOW - last[r] > threshold}
    for f in findings:
        assert f.cost_seconds > threshold
        assert f.status == "open"


def test_invalid_median_falls_back_to_floor() -> None:
    assert hang_threshold_s(0.0) == pytest.approx(60.0)
