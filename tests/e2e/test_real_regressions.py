"""Real training: a job-wide slowdown is a regression within 5 windows; a steady run raises none.

Four gloo ranks of the evaluation harness (:mod:`stepwatch_server.evaluation.real`: a tiny
GPT under DDP, the real agent with its communication hook, a real ``stepwatch serve``, a
CPU burner on every core started and stopped by PID), profiler off. From step 161 every
rank does 10% of its step time more real compute (a matmul loop in forward). The
collector's regression detector must open ``regression:step_time`` within 5 windows of the
onset (16-step windows, the baseline formed over the 8 windows after the tagged warm-up),
attributed to compute; the same run without the fault must open no regression. The
scenarios' processes run at a raised niceness of their session, so that the load they see
is their own burner, not whatever else the machine runs (which would change the whole
job's speed mid-run: a real change of its step time); a run in which the whole machine
stood still for seconds, or one of whose ranks did (a hang event in a run without a hang),
is run once more (``STILL_S``, ``_froze``).
"""

from __future__ import annotations

import pytest

from stepwatch_server.evaluation import real


def _scenario(name: str) -> real.RealScenario:
    return next(s for s in real.SCENARIOS if s.name == name)


#: A run in which the whole machine stood still this long (:class:`real.Stillness`: the
#: virtual machine stopped by its host, training and collector with it) is no evidence
#: either way, as the job's speed after such a pause can differ from before it: it is run
#: once more, and the second must not stand still.
STILL_S = 5.0


def _froze(o: real.RealOutcome) -> list[str]:
    """Hang events of a run that has no hang in it: one rank's whole process stood still
    for the hang threshold (15 s) and went on. On 2026-12-03 afternoon 5 of 7 job-wide runs
    of the harness had one, with the timing code of before that day's change (2 of 3) as
    after it (3 of 4); in the recorded one, rank 0's sender sent no heartbeat for 17 s
    while its training thread stood still 22 s (the whole process, not a collective),
    and that run's regression went unflagged. Such a run is no evidence either way."""
    return [e["message"] for e in o.events if e["kind"] == "hang"]


def _run(s: real.RealScenario) -> real.RealOutcome:
    o = real.run_scenario(s)
    if o.paused_s >= STILL_S or _froze(o):
        o = real.run_scenario(s)
    assert o.paused_s < STILL_S, f"the machine stood still for {o.paused_s:.0f} s in both runs"
    assert not _froze(o), f"a rank stood still for the hang threshold in both runs: {_froze(o)}"
    return o


def _keys(o: real.RealOutcome, kind: str) -> list[str]:
    return sorted(e["key"] for e in o.events if e["kind"] == kind)


@pytest.mark.solo
def test_a_job_wide_ten_percent_slowdown_is_a_regression_within_five_windows() -> None:
    s = _scenario("job-wide +10%")
    o = _run(s)
    assert s.steps is not None and o.analysed_through_step >= s.steps, "the analysis did not reach the end"
    assert "regression:step_time" in _keys(o, "regression"), _keys(o, "straggler")
    assert o.right, [e["message"] for e in o.events if e["kind"] == "regression"]  # attributed to compute
    assert o.windows_to_flag is not None and 1 <= o.windows_to_flag <= 5, o.windows_to_flag
    (ev,) = [e for e in o.events if e["key"] == "regression:step_time"]
    # Its start is the CUSUM change point: the onset's window, give or take one.
    assert abs(ev["first_step"] - s.fault_from) <= o.window_steps, ev["first_step"]
    assert ev["evidence"]["change_ratio"] >= 0.05 and "compute +" in ev["message"]


@pytest.mark.solo
def test_a_steady_run_raises_no_regression() -> None:
    s = _scenario("clean, steady load")
    o = _run(s)
    assert s.steps is not None and o.analysed_through_step >= s.steps, "the analysis did not reach the end"
    assert _keys(o, "regression") == [], [e["message"] for e in o.events]
