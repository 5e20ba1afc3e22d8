"""A hang on real training is diagnosed: the rank that never entered the collective.

Four gloo ranks of the evaluation harness (:mod:`stepwatch_server.evaluation.real`: a
tiny GPT under DDP with the agent's communication hook, a real ``stepwatch serve`` with
a hang floor of 15 s, a CPU burner on every core that the harness starts and
stops by PID). At step ``FAULT_FROM`` rank 2 sleeps after forward and never enters the
step's gradient all-reduces; ranks 0, 1 and 3 enter them and block inside, so no
training thread closes a window again and only the sender threads' heartbeats say where
each rank is. The run's hang event must name rank 2 as never entered, the all-reduce
and the ranks waiting in it (a heartbeat's counters count once read half a threshold
after the rank's last step, so the event may open a heartbeat before its diagnosis; the
harness polls until the diagnosis is there, within its deadline).
"""

from __future__ import annotations

import pytest

from stepwatch_server.evaluation import real

#: Rank 2 stops at step 14: past the agent's 5 warm-up steps, so the collector knows
#: the step time the hang threshold is scaled from.
STEPS, FAULT_FROM = 40, 14


@pytest.mark.solo
def test_a_rank_that_never_enters_the_all_reduce_is_named_by_the_hang() -> None:
    s = next(x for x in real.SCENARIOS if x.name == "hang in all_reduce")
    o = real.run_scenario(s, steps=STEPS, fault_from=FAULT_FROM, profile_every=0, timeout_s=300.0)
    hangs = [e for e in o.events if e["kind"] == "hang"]
    assert o.right, f"no hang naming rank 2 as never entered: {[(e['key'], e['message']) for e in hangs]}"
    assert [e["key"] for e in hangs] == ["hang:run"], "the stopped run was flagged as one hang"
    (ev,) = hangs
    stuck = ev["evidence"]["collective"]
    assert ev["ranks"] == [2] and ev["status"] == "open"
    assert (stuck["group"], stuck["op"], stuck["never_entered"], stuck["waiting"]) == (
        "world",
        "all_reduce",
        [2],
        [0, 1, 3],
    )
    assert stuck["unconfirmed"] == [], "rank 2's own heartbeat confirmed it never entered"
    assert stuck["seq"] > FAULT_FROM and stuck["since"] is not None
    assert "rank 2 never entered all_reduce #" in ev["message"]
