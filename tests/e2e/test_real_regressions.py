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
job's speed mid-run: a real change of its step time). A run in which the whole machine
stood still for seconds, or one of whose ranks did (a hang event in a run without a hang),
is no evidence and is run again (``STILL_S``, ``_froze``); so is a job-wide run unless the
job was steady before the onset and the fault slowed it by its full size
(``_no_evidence``), and a steady run unless the job's speed stayed where its baseline put
it (``_not_steady``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import pytest

from stepwatch_server.analysis.regressions import RegressionConfig
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
    and that run's regression went unflagged. Such a run is no evidence either way. The
    cause, found on 2026-12-04, and the harness' remedy: :data:`real.MALLOC_ENV`."""
    return [e["message"] for e in o.events if e["kind"] == "hang"]


#: A job-wide run is evidence for "a 10% slowdown is flagged" only if the machine was
#: steady before the onset and the job really slowed by the scenario's size, both read off
#: the harness' own step ends (16-step windows: the baseline's windows 2-9, the onset's
#: window 10 on). Measured on 2026-12-03 over 11 runs on this 2-vCPU machine: the fault
#: (extra CPU work calibrated at the onset) slowed the job by 0% to 42%, and the baseline
#: windows' medians spread over 18-54% of their median, where the detector's claim (10% in
#: 5 windows) holds at a window noise of about 3.4% (``analysis/regressions.py``); every
#: run that met both conditions was flagged in time. A run that does not meet them is run
#: again, up to ``TRIES`` runs; if none does, the test fails saying why.
MAX_BASELINE_SPREAD = 0.25
TRIES = 3


def _window_medians(o: real.RealOutcome) -> list[float]:
    """The median step time of each whole window, off the harness' own step ends."""
    ends, ws = o.step_ends, o.window_steps or 16
    # Step k's duration (k >= 2: step 1 has no start here).
    dur = [ends[k - 1] - ends[k - 2] for k in range(2, len(ends) + 1)]
    return [statistics.median(dur[max(0, w * ws - 1) : (w + 1) * ws - 1]) for w in range(len(ends) // ws)]


def _stood_still(o: real.RealOutcome) -> str | None:
    """Why a run is no evidence either way because something stood still (None: nothing did)."""
    if o.paused_s >= STILL_S:
        return f"the machine stood still for {o.paused_s:.0f} s"
    if _froze(o):
        return f"a rank stood still for the hang threshold: {_froze(o)[0][:120]}"
    return None


def _before_and_after(o: real.RealOutcome, s: real.RealScenario, need: int) -> tuple[list[float], ...]:
    """Window medians of the baseline (windows 2 to the onset's) and from the onset's window
    on; both empty when fewer than ``need`` windows after the onset were kept."""
    med = _window_medians(o)
    onset = ((s.fault_from or 1) - 1) // (o.window_steps or 16)
    return (med[2:onset], med[onset:]) if len(med) >= onset + need else ([], [])


def _no_evidence(o: real.RealOutcome, s: real.RealScenario) -> str | None:
    """Why a job-wide run says nothing about the detector (None: it is evidence)."""
    if reason := _stood_still(o):
        return reason
    base, after = _before_and_after(o, s, 4)
    if not after:
        return f"only {len(o.step_ends)} step ends kept"
    level = statistics.median(base)
    spread = (max(base) - min(base)) / level
    if spread > MAX_BASELINE_SPREAD:
        return f"unsteady before the onset: window medians spread over {spread:.0%} of their median"
    ratio = statistics.median(after) / level
    if ratio < 1 + s.size:
        return f"the fault slowed the job by {ratio - 1:.0%}, not {s.size:.0%}"
    return None


#: A steady run is evidence that the detector raises nothing on a job whose speed did not
#: change only if its speed really did not change after the baseline, read off the
#: harness' own step ends like the job-wide run's: the windows from the scenario's onset
#: window on (the same 16-step windows) no slower at their median than the baseline's
#: level by half the job-wide scenario's size, and no ``min_duration`` consecutive windows
#: (a stretch the CUSUM may open on) slower by its whole size. The detector opens on a
#: sustained 10% within 5 windows (the job-wide test); with its slack and threshold
#: (``k`` 0.5 robust sigmas, at least half of ``min_change`` 3%; ``h`` 10) it needs
#: about 2.2 window sigmas, 6-7% at this harness' window noise of about 3%, to open
#: within the 6 windows after the baseline. On 2026-12-04 the CI run of ``0644c34``
#: failed this test in both of its runs, flagged with ``regression:step_time`` +14.3%
#: from step 161 on a run without a fault: the whole job got slower while the machine
#: ran other work. In 27 runs that afternoon the level after the baseline was -12% to +7%
#: of it (3 over 5%), and 3-window stretches reached +13% (2 over 10%): 4 runs of 27 not
#: steady. A run outside the bounds is run again, up to ``TRIES`` runs; if none is
#: steady the test fails saying why.
STEADY_DRIFT = 0.05
STEADY_STRETCH = 0.10


def _not_steady(o: real.RealOutcome, s: real.RealScenario) -> str | None:
    """Why a run without a fault says nothing about false regressions (None: it is evidence)."""
    if reason := _stood_still(o):
        return reason
    n = RegressionConfig().min_duration
    base, after = _before_and_after(o, s, n)
    if not after:
        return f"only {len(o.step_ends)} step ends kept"
    level = statistics.median(base)
    drift = statistics.median(after) / level - 1
    if drift > STEADY_DRIFT:
        return f"the job got {drift:.1%} slower after its baseline"
    stretch = max(statistics.median(after[i : i + n]) for i in range(len(after) - n + 1)) / level - 1
    if stretch > STEADY_STRETCH:
        return f"{n} windows after the baseline were {stretch:.0%} slower than it"
    return None


def _evidence_run(
    s: real.RealScenario, why_not: Callable[[real.RealOutcome, real.RealScenario], str | None]
) -> real.RealOutcome:
    """The first of up to ``TRIES`` runs of ``s`` that is evidence by ``why_not``."""
    why = []
    for _ in range(TRIES):
        o = real.run_scenario(s)
        reason = why_not(o, s)
        if reason is None:
            return o
        why.append(reason)
    raise AssertionError(f"no run of {TRIES} was evidence: {why}")


def _keys(o: real.RealOutcome, kind: str) -> list[str]:
    return sorted(e["key"] for e in o.events if e["kind"] == kind)


@pytest.mark.solo
def test_a_job_wide_ten_percent_slowdown_is_a_regression_within_five_windows() -> None:
    s = _scenario("job-wide +10%")
    o = _evidence_run(s, _no_evidence)
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
    o = _evidence_run(s, _not_steady)
    assert s.steps is not None and o.analysed_through_step >= s.steps, "the analysis did not reach the end"
    assert _keys(o, "regression") == [], [e["message"] for e in o.events]
