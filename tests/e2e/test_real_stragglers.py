"""Real training names the slow rank through the collector, with the profiler off.

Four gloo ranks of the evaluation harness (:mod:`stepwatch_server.evaluation.real`: a
tiny GPT under DDP with the agent's communication hook, a real ``stepwatch serve``, a CPU
burner the harness starts and stops by PID on every core), ``profile_every=0``: the only
evidence is the always-on timing of every step. A rank given 20% more real compute (a
matmul loop in forward) from mid-run must be flagged as a compute straggler, with its
rank, and no other rank may be flagged. The harness polls the collector's API
until the ranks finished and the analysis passed the last step.

The link tests run the ranks in network namespaces the harness creates (one per rank,
veth pairs to a bridge, the collector in the bridge's namespace; root, as here and in
CI): with rank 1's veth limited by ``tc tbf`` at 150 Mbit/s both ways, rank 1 must be
named ``straggler:link:rank=1`` and not for compute or a host stall, and ranks 0, 2 and 3,
in the same namespaces unshaped, must raise no flag (the control: a clean run in the
namespaces is ``stepwatch evaluate --real``'s "clean (namespaces)" row; as a test of its
own it cost the suite 30 s). Every namespace is removed afterwards, failed or not.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from stepwatch_server.evaluation import real

#: The harness' 8 s windows hold 16 steps at about 0.5 s a step (sized from the first
#: batch that shows the pace, not from the slow first steps): the fault starts with window
#: 2 of 6, and the flag must open within 3 windows of it. A straggler is judged against its
#: peers in the same window, so no baseline has to form first.
STEPS, FAULT_FROM = 96, 33


def _scenario(name: str) -> real.RealScenario:
    return next(s for s in real.SCENARIOS if s.name == name)


def _false(o: real.RealOutcome) -> list[str]:
    """What a false flag was, for the failure message: key and message of each."""
    return [f"{e['key']}: {e['message']}" for e in o.events if e.get("_false")]


def _stragglers(o: real.RealOutcome) -> list[str]:
    return sorted(e["key"] for e in o.events if e["kind"] == "straggler")


@pytest.mark.solo
def test_extra_compute_on_one_rank_is_named_as_compute() -> None:
    o = real.run_scenario(_scenario("compute +20%"), steps=STEPS, fault_from=FAULT_FROM, profile_every=0)
    assert o.analysed_through_step >= STEPS, "the analysis did not reach the last step"
    assert o.right, f"expected straggler:compute:rank=2, got {_stragglers(o)} ({o.note})"
    # Opened at or after the onset's window (before it, the flag named a clean rank 2), within 3.
    assert o.windows_to_flag is not None and 0 <= o.windows_to_flag <= 3, o.windows_to_flag
    (ev,) = [e for e in o.events if e["key"] == "straggler:compute:rank=2"]
    assert ev["ranks"] == [2] and ev["cause"] == "compute"
    assert ev["evidence"]["extra_cpu_s"] > 0 and ev["cost_seconds"] > 0
    assert [k for k in _stragglers(o) if k.endswith("rank=2")] == ["straggler:compute:rank=2"]
    # The three others ran clean for 96 steps: none of them may be flagged. (Ten whole clean
    # runs of 300 steps: ``python -m stepwatch_server.evaluation.real --scenario clean
    # --runs 10 --steps 300``.)
    assert o.false_flags == 0, _false(o)


#: The link tests: 64 steps (4 windows of 16) are enough, the tbf link is shaped from step 1.
LINK_STEPS = 64


def _namespaces_left() -> list[str]:
    """This process's namespaces still present (the harness names them sw<pid>...)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    tag = f"sw{os.getpid() % 100000}"
    return [line.split()[0] for line in out.splitlines() if line.startswith(tag)]


@pytest.mark.solo
def test_a_slowed_link_is_named_as_link_and_not_as_compute() -> None:
    try:
        o = real.run_scenario(_scenario("slow link (tbf)"), steps=LINK_STEPS, profile_every=0)
    finally:
        assert _namespaces_left() == []
    assert o.analysed_through_step >= LINK_STEPS, "the analysis did not reach the last step"
    assert o.right, f"expected straggler:link:rank=1, got {_stragglers(o)} ({o.note})"
    (ev,) = [e for e in o.events if e["key"] == "straggler:link:rank=1"]
    assert ev["ranks"] == [1] and ev["cause"] == "link"
    assert ev["evidence"]["peer_rate_mb_s"] >= 3 * ev["evidence"]["rate_mb_s"] > 0
    assert ev["cost_seconds"] > 0
    assert [k for k in _stragglers(o) if k.endswith("rank=1")] == ["straggler:link:rank=1"]
    assert o.false_flags == 0, _false(o)  # the unshaped ranks: the control
    # and in the namespaces nothing else: no hang (the collector behind the bridge hears
    # every rank), no regression (the link is slow from the first step).
    assert [e["key"] for e in o.events if e["kind"] in ("hang", "regression")] == [], o.events
