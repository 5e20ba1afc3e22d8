"""Regression detection on seeded synthetic job series."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace

import pytest

from stepwatch_server.analysis import (
    Finding,
    FingerprintMismatchError,
    JobStep,
    RegressionConfig,
    RegressionDetector,
    build_baseline,
    compare_runs,
)
from stepwatch_server.analysis.attribution import attribute

from ..synthetic import job_series

WARMUP = 10
DROP_AT = 200


def windows_to_open(series: Sequence[JobStep], metric: str, drop_at: int = DROP_AT) -> tuple[int, Finding]:
    """Untagged windows from the change to the opening of ``metric``'s regression (1 = the first)."""
    det = RegressionDetector("r")
    untagged = 0
    for sample in series:
        untagged += sample.tag is None
        for f in det.update(sample):
            if f.status == "open" and f.metric == metric:
                return untagged - (drop_at - WARMUP), f
    raise AssertionError(f"no {metric} regression opened")


@pytest.mark.parametrize("seed", range(5))
def test_five_percent_mfu_drop_found_within_ten_windows(seed: int) -> None:
    series = job_series(n_windows=260, drop_at=DROP_AT, drop=0.05, seed=seed)
    delay, finding = windows_to_open(series, "mfu")
    assert 1 <= delay <= 10
    assert finding.kind == "regression"
    assert finding.key == "regression:mfu"
    assert finding.evidence["change_ratio"] == pytest.approx(-0.05, abs=0.015)
    assert finding.cost_ratio == pytest.approx(0.05, abs=0.015)
    assert finding.evidence["delta_comm_exposed_s"] == pytest.approx(0.105, abs=0.03)
    assert finding.message.startswith("MFU -")
    assert "exposed communication +0.1" in finding.message
    assert "data wait unchanged" in finding.message
    json.dumps(finding.to_dict())


def test_start_step_is_the_change_point() -> None:
    series = job_series(n_windows=260, drop_at=DROP_AT, drop=0.08, seed=3)
    first_dropped = next(s for s in series if s.tag is None and s.comm_exposed_s and s.comm_exposed_s > 0.45)
    _, finding = windows_to_open(series, "mfu")
    assert finding.first_step == first_dropped.first_step
    assert f"from step {first_dropped.first_step:,}" in finding.message


def test_step_time_regression_attributed_to_data_wait() -> None:
    series = job_series(n_windows=260, drop_at=DROP_AT, drop=0.1, drop_component="data_wait_s", seed=4)
    _, finding = windows_to_open(series, "step_time")
    assert finding.message.startswith("Step time +")
    assert "data wait +0.2" in finding.message
    assert finding.cost_seconds == pytest.approx(2.0 * (1 / 0.9 - 1), rel=0.2)


def test_no_false_regressions_over_ten_thousand_clean_windows() -> None:
    series = job_series(n_windows=10_000, seed=42)
    det = RegressionDetector("r")
    assert det.extend(series) == []
    assert det.baseline is not None
    assert det.baseline.metrics["step_time"].median == pytest.approx(2.0, rel=0.02)


def test_tagged_warmup_checkpoint_and_eval_are_excluded() -> None:
    # Long tagged pauses: eval every 20 windows, checkpoints every 10, a slow warm-up.
    series = job_series(n_windows=400, checkpoint_every=10, eval_every=20, eval_windows=6, seed=5)
    assert {s.tag for s in series} == {None, "warmup", "checkpoint", "eval"}
    assert RegressionDetector("r").extend(series) == []
    # The same series with the tags lost would be called a regression.
    untagged = [replace(s, tag=None) for s in series]
    assert any(f.status == "open" for f in RegressionDetector("r").extend(untagged))


def test_baseline_ignores_warmup() -> None:
    series = job_series(n_windows=100, warmup_windows=20, seed=6)
    base = build_baseline(series, run="r")
    assert base.step_time_s == pytest.approx(2.0, rel=0.02)
    assert base.first_step == 20 * 20 + 1


def test_recovery_closes_with_hysteresis() -> None:
    before = job_series(n_windows=150, drop_at=100, drop=0.08, seed=7)
    after = job_series(n_windows=60, warmup_windows=0, checkpoint_every=0, eval_every=0, seed=8)
    last = before[-1].step
    series = [*before, *(replace(s, step=s.step + last) for s in after)]
    det = RegressionDetector("r")
    events = [(i, f) for i, s in enumerate(series) for f in det.update(s) if f.metric == "mfu"]
    assert [f.status for _, f in events] == ["open", "closed"]
    (_, opened), (i_closed, closed) = events
    recovered_at = len(before)
    assert recovered_at + 5 <= i_closed + 1 <= recovered_at + 10  # 5 clean samples, no sooner
    assert closed.first_step == opened.first_step
    assert closed.status == "closed"
    assert "recovered" in closed.message
    assert det.open_findings() == []


def test_state_round_trip_mid_regression() -> None:
    series = job_series(n_windows=300, drop_at=DROP_AT, drop=0.06, seed=9)
    straight = RegressionDetector("r").extend(series)
    det = RegressionDetector("r")
    cut = len(series) // 2
    early = det.extend(series[:15]) + det.extend(series[15:cut])
    state = json.loads(json.dumps(det.to_state()))
    rebuilt = RegressionDetector.from_state(state)
    assert rebuilt.to_state() == det.to_state()
    assert early + rebuilt.extend(series[cut:]) == straight
    # Also while the baseline is still being collected.
    det2 = RegressionDetector("r")
    det2.extend(series[:20])
    assert det2.baseline is None
    rebuilt2 = RegressionDetector.from_state(json.loads(json.dumps(det2.to_state())))
    assert rebuilt2.extend(series[20:]) == straight


def test_compare_against_named_baseline_run() -> None:
    reference = job_series(n_windows=120, seed=10)
    base = build_baseline(reference, run="llama-ref", fingerprint="cfg-abc")
    slower = job_series(n_windows=60, drop_at=0, drop=0.06, warmup_windows=0, seed=11)
    result = compare_runs(slower, base, run="llama-new", fingerprint="cfg-abc")
    assert result.change["mfu"] == pytest.approx(-0.06, abs=0.015)
    assert result.component_deltas["comm_exposed_s"] == pytest.approx(0.128, abs=0.03)
    assert [f.metric for f in result.findings] == ["mfu", "step_time"]
    assert result.findings[0].first_step == slower[0].first_step
    assert result.message.startswith("Run llama-new vs baseline llama-ref: MFU -")
    same = compare_runs(
        job_series(n_windows=60, warmup_windows=0, seed=12), base, run="x", fingerprint="cfg-abc"
    )
    assert same.findings == ()
    assert "time breakdown unchanged" in same.message
    with pytest.raises(FingerprintMismatchError):
        compare_runs(slower, base, run="llama-new", fingerprint="cfg-other")
    detector = RegressionDetector("llama-new", baseline=base, fingerprint="cfg-abc")
    assert any(f.status == "open" for f in detector.extend(slower))  # no warm-up needed


def test_missing_mfu_still_watches_step_time() -> None:
    series = [replace(s, mfu=None) for s in job_series(n_windows=260, drop_at=DROP_AT, drop=0.05, seed=13)]
    det = RegressionDetector("r")
    assert [f.metric for f in det.extend(series)] == ["step_time"]


def test_attribution_wording() -> None:
    assert attribute({"comm_exposed_s": 1.1, "data_wait_s": 0.001, "compute_s": 0.0}, 0.02) == (
        "exposed communication +1.10 s/step; data wait unchanged"
    )
    assert attribute({}, 0.02) == "no time breakdown to attribute it"
    assert attribute({"compute_s": 0.001}, 0.02).startswith("no breakdown component grew")


def test_config_validation_and_round_trip() -> None:
    cfg = RegressionConfig(h=8.0)
    assert RegressionConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="clip_z"):
        RegressionConfig(k=5.0, clip_z=4.0)
