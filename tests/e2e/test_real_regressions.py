"""Real training: a steady run raises no regression; a job-wide slowdown after it is one
within 5 windows.

Four gloo ranks of the evaluation harness (:mod:`stepwatch_server.evaluation.real`: a tiny
GPT under DDP, the real agent with its communication hook, a real ``stepwatch serve``, a
CPU burner on every core started and stopped by PID), profiler off, one run of 352 steps
in 16-step windows: the tagged warm-up, the baseline over the 8 windows after it, 6 steady
windows (steps 161-256: the harness' steady scenario, in which no regression may open),
then from step 257 every rank does 10% of its step time more real compute (a matmul loop
in forward). The collector's regression detector must open ``regression:step_time`` within
5 windows of the onset, attributed to compute. (One run for both halves: the steady
half is the control, as a run of its own it cost the suite 45 s.) The scenarios'
processes run at a raised niceness of their session, so that the load they see is their
own burner, not whatever else the machine runs (which would change the whole job's speed
mid-run: a real change of its step time).
"""

from __future__ import annotations

import pytest

from stepwatch_server.evaluation import real


def _scenario(name: str) -> real.RealScenario:
    return next(s for s in real.SCENARIOS if s.name == name)


def _keys(o: real.RealOutcome, kind: str) -> list[str]:
    return sorted(e["key"] for e in o.events if e["kind"] == kind)


@pytest.mark.solo
def test_a_steady_run_raises_no_regression_and_a_job_wide_ten_percent_slowdown_after_it_does() -> None:
    s = _scenario("job-wide +10%")
    o = real.run_scenario(s)
    assert s.steps is not None and s.fault_from is not None
    assert o.analysed_through_step >= s.steps, "the analysis did not reach the end"
    onset_window = (s.fault_from - 1) // o.window_steps
    regressions = [e for e in o.events if e["kind"] == "regression"]
    early = [e["message"] for e in regressions if e["evidence"]["opened_window"] < onset_window]
    assert early == [], early  # the steady windows before the onset raised nothing
    assert "regression:step_time" in _keys(o, "regression"), _keys(o, "straggler")
    assert o.right, [e["message"] for e in o.events if e["kind"] == "regression"]  # attributed to compute
    assert o.windows_to_flag is not None and 1 <= o.windows_to_flag <= 5, o.windows_to_flag
    (ev,) = [e for e in o.events if e["key"] == "regression:step_time"]
    # Its start is the CUSUM change point: the onset's window, give or take one.
    assert abs(ev["first_step"] - s.fault_from) <= o.window_steps, ev["first_step"]
    assert ev["evidence"]["change_ratio"] >= 0.05 and "compute +" in ev["message"]
