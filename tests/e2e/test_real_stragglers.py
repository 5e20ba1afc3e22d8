"""Real training names the slow rank through the collector, with the profiler off.

Four gloo ranks of the evaluation harness (:mod:`stepwatch_server.evaluation.real`: a
tiny GPT under DDP with the agent's communication hook, a real ``stepwatch serve``, a CPU
burner the harness starts and stops by PID on every core), ``profile_every=0``: the only
evidence is the always-on timing of every step. A rank given 20% more real compute (a
matmul loop in forward) from mid-run must be flagged as a compute straggler, with its
rank; a clean run must raise no straggler flag. The harness polls the collector's API
until the ranks finished and the analysis passed the last step.
"""

from __future__ import annotations

import pytest

from stepwatch_server.evaluation import real

#: The harness' 8 s windows hold 16 steps at about 0.5 s a step: the fault starts with
#: window 3 of 8 (8 steps when the first steps were slow: window 6 of 16).
STEPS, FAULT_FROM = 128, 49


def _scenario(name: str) -> real.RealScenario:
    return next(s for s in real.SCENARIOS if s.name == name)


def _stragglers(o: real.RealOutcome) -> list[str]:
    return sorted(e["key"] for e in o.events if e["kind"] == "straggler")


@pytest.mark.e2e
def test_extra_compute_on_one_rank_is_named_as_compute() -> None:
    o = real.run_scenario(_scenario("compute +20%"), steps=STEPS, fault_from=FAULT_FROM, profile_every=0)
    assert o.analysed_through_step >= STEPS, "the analysis did not reach the last step"
    assert o.right, f"expected straggler:compute:rank=2, got {_stragglers(o)} ({o.note})"
    assert o.windows_to_flag is not None and o.windows_to_flag <= 3, o.windows_to_flag
    (ev,) = [e for e in o.events if e["key"] == "straggler:compute:rank=2"]
    assert ev["ranks"] == [2] and ev["cause"] == "compute"
    assert ev["evidence"]["extra_cpu_s"] > 0 and ev["cost_seconds"] > 0
    assert [k for k in _stragglers(o) if k.endswith("rank=2")] == ["straggler:compute:rank=2"]


@pytest.mark.e2e
def test_a_clean_run_raises_no_straggler_flag() -> None:
    o = real.run_scenario(_scenario("clean"), steps=STEPS, fault_from=FAULT_FROM, profile_every=0)
    assert o.analysed_through_step >= STEPS, "the analysis did not reach the last step"
    assert _stragglers(o) == []
