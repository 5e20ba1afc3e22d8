"""Hang checks: thresholds, silent ranks, a stopped run, and the collective it stopped in."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepwatch_server.analysis import check_hang, hang_threshold_s
from stepwatch_server.analysis.stuck_collectives import (
    WORLD,
    GroupCounters,
    StuckCollective,
    describe,
    stuck_collectives,
)

NOW = 1_000_000.0
#: A heartbeat's idle time: long after the rank's last step (its counters are where it stopped).
IDLE = 1e4


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
        # Past the threshold, and past it after the last report of the run.
        newest = min(NOW - t for t in last.values())
        assert {f.ranks[0] for f in findings} == {
            r for r in silence if NOW - last[r] > threshold and NOW - last[r] - newest > threshold
        }
    for f in findings:
        assert f.cost_seconds > threshold
        assert f.status == "open"


def test_invalid_median_falls_back_to_floor() -> None:
    assert hang_threshold_s(0.0) == pytest.approx(60.0)


# -- the diagnosis: which collective, who never entered it, who waits in it ----------------
def _counters(
    entered: dict[int, int],
    completed: int,
    *,
    group: str = WORLD,
    since: float = NOW - 200.0,
    heartbeat: bool = True,
) -> list[GroupCounters]:
    """Per rank ``entered`` (``completed`` for every rank); the waiting ranks entered
    collective ``completed + 1`` at ``since`` (+ rank ms)."""
    return [
        GroupCounters(r, group, e, min(e, completed), "all_reduce", since + r / 1000, heartbeat, IDLE)
        for r, e in entered.items()
    ]


def test_the_rank_that_never_entered_the_collective_its_peers_wait_in_is_named() -> None:
    # 8 ranks, 4 buckets a step: rank 5 stopped after collective 41,199, the others entered
    # the step's 4 all-reduces (41,200 .. 41,203) and completed none of them.
    entered = {r: 41_203 for r in range(8)}
    entered[5] = 41_199
    last = {r: NOW - 300.0 for r in range(8)}
    [f] = check_hang(
        NOW,
        last,
        median_step_s=12.0,
        run="job",
        host_by_rank={r: f"n{r // 4}" for r in range(8)},
        last_step_by_rank=dict.fromkeys(range(8), 1_000),
        collectives=_counters(entered, 41_199),
    )
    assert (f.key, f.ranks, f.hosts) == ("hang:run", (5,), ("n1",))
    assert f.collective == {
        "group": "world",
        "op": "all_reduce",
        "seq": 41_200,
        "never_entered": [5],
        "waiting": [0, 1, 2, 3, 4, 6, 7],
        "since": NOW - 200.0,
        "unconfirmed": [],
        "went_past": [],
    }
    when = time.strftime("%H:%M:%S", time.gmtime(NOW - 200.0))
    assert f.message == (
        "Run job has hung: rank 5 never entered all_reduce #41,200 of group world; "
        f"7 ranks wait in it since {when} UTC; no step for 5.0 min (threshold 2.0 min)."
    )


def test_peers_waiting_on_a_silent_rank_make_a_run_hang_before_their_own_silence_passes() -> None:
    # Rank 2's last batch is older than the threshold, its peers' younger; their
    # heartbeats show them blocked in the collective rank 2 never entered: the run hangs.
    last = {0: NOW - 40.0, 1: NOW - 41.0, 2: NOW - 65.0, 3: NOW - 40.0}
    # Without them, the ranks stopped within a threshold of each other: no rank is named
    # as silent while the run steps (it does not), the run's verdict waits for the others.
    assert check_hang(NOW, last, median_step_s=2.0) == []
    [f] = check_hang(NOW, last, median_step_s=2.0, collectives=_counters({0: 9, 1: 9, 2: 6, 3: 9}, 6))
    assert (f.key, f.ranks) == ("hang:run", (2,))
    assert f.collective is not None and f.collective["seq"] == 7 and f.collective["waiting"] == [0, 1, 3]


def test_counters_read_while_ranks_stepped_give_no_diagnosis() -> None:
    # Window counters (no heartbeat) of ranks in flight are no evidence that they still wait.
    last = dict.fromkeys(range(4), NOW - 90.0)
    stale = _counters({0: 9, 1: 9, 2: 6, 3: 9}, 6, heartbeat=False)
    [f] = check_hang(NOW, last, median_step_s=2.0, collectives=stale)
    assert f.collective is None and "all ranks stopped together" in f.message
    # A rank that stepped past the collective completed it: nobody is stuck in it.
    moved = [
        *_counters({0: 9, 1: 9, 2: 6, 3: 9}, 6),
        GroupCounters(4, WORLD, 12, 12, "all_reduce", NOW, True, IDLE),
    ]
    assert stuck_collectives(moved, range(5)) == []
    # A rank silent while its peers step on is still a silent rank, counters or not.
    stepping = {0: NOW - 1.0, 1: NOW - 1.0, 2: NOW - 90.0}
    windows = _counters({0: 30, 1: 31, 2: 6}, 29, heartbeat=False)
    assert [f.key for f in check_hang(NOW, stepping, 2.0, collectives=windows)] == ["hang:rank=2"]


def test_every_rank_waiting_inside_means_the_fault_is_below_the_ranks() -> None:
    last = dict.fromkeys(range(4), NOW - 90.0)
    [f] = check_hang(NOW, last, median_step_s=2.0, collectives=_counters(dict.fromkeys(range(4), 9), 6))
    assert f.ranks == () and f.collective is not None
    assert f.collective["never_entered"] == [] and f.collective["waiting"] == [0, 1, 2, 3]
    assert "all 4 ranks wait in all_reduce #7 of group world since" in f.message
    assert "transport or link" in f.message


def test_a_rank_that_never_entered_any_collective_and_a_rank_without_heartbeat() -> None:
    # Rank 3 sent no counters at all (stuck before its first collective) and rank 2's are
    # from its last window only: both never entered #1, the diagnosis says which is unconfirmed.
    rows = [*_counters({0: 2, 1: 2}, 0), GroupCounters(2, WORLD, 0, 0, None, None, False)]
    [s] = stuck_collectives(rows, range(4))
    assert (s.seq, s.never_entered, s.waiting, s.unconfirmed) == (1, (2, 3), (0, 1), (2, 3))
    assert describe(s).startswith("ranks 2, 3 never entered all_reduce #1 of group world; 2 ranks wait in it")
    assert "sent no heartbeat" in describe(s)
    assert StuckCollective.from_dict(s.to_dict()) == s
    # Counters below what every rank completed are older than the rank's truth (it took
    # part in those collectives): unconfirmed even when a heartbeat carried them.
    behind = _counters({0: 9, 1: 9, 2: 4}, 6)
    [s] = stuck_collectives(behind, range(3))
    assert (s.seq, s.never_entered, s.unconfirmed) == (7, (2,), (2,))


def test_groups_other_than_world_have_the_members_that_report_them() -> None:
    # A pipeline pair (ranks 1 and 2) is stuck: rank 2 never entered send #4 of group "7";
    # ranks 0 and 3 are not members (no row) and their world collectives all completed.
    rows = _counters({0: 5, 1: 5, 2: 5, 3: 5}, 5)
    rows += [
        GroupCounters(1, "7", 4, 3, "send", NOW - 50.0, True, IDLE),
        GroupCounters(2, "7", 3, 3, "recv", NOW - 80.0, True, IDLE),
    ]
    [s] = stuck_collectives(rows, range(4))
    assert (s.group, s.op, s.seq, s.never_entered, s.waiting, s.since) == (
        "7",
        "send",
        4,
        (2,),
        (1,),
        NOW - 50.0,
    )
    assert describe(s).startswith("rank 2 never entered send #4 of group 7; 1 rank waits in it since")
    # A rank that finished is still a member: rank 1 waits for a partner that left.
    [s] = stuck_collectives(rows, [0, 1])
    assert s.never_entered == (2,)


def test_a_missing_rank_without_heartbeat_is_named_only_once_the_others_waited_past_the_threshold() -> None:
    # Rank 2's heartbeat may still be on its way: its window counters are not evidence
    # until the others have waited longer than the threshold (a live agent sent one by then).
    last = dict.fromkeys(range(3), NOW - 90.0)
    rows = [GroupCounters(r, WORLD, 9, 6, "all_reduce", NOW - 10.0, True, IDLE) for r in (0, 1)]
    rows.append(GroupCounters(2, WORLD, 6, 6, "all_reduce", NOW - 95.0, False))
    [early] = check_hang(NOW, last, median_step_s=2.0, floor_s=60.0, collectives=rows)
    assert early.collective is None
    later = [replace(c, since=NOW - 61.0) if c.heartbeat else c for c in rows]
    [f] = check_hang(NOW, last, median_step_s=2.0, floor_s=60.0, collectives=later)
    assert f.collective is not None and f.collective["unconfirmed"] == [2] and f.ranks == (2,)
    assert "rank 2 sent no heartbeat" in f.message


def test_a_heartbeat_read_soon_after_the_last_step_is_no_evidence_of_where_the_rank_stopped() -> None:
    # Rank 3 sent a heartbeat 2 s after its last step (threshold 60 s): a slow rank between
    # two windows, still on its way into the collective; it proves nothing yet.
    last = dict.fromkeys(range(4), NOW - 90.0)
    rows = _counters({0: 9, 1: 9, 2: 6, 3: 6}, 6, since=NOW - 10.0)
    rows[3] = replace(rows[3], idle_s=2.0)
    [f] = check_hang(NOW, last, median_step_s=2.0, floor_s=60.0, collectives=rows)
    assert f.collective is None
    rows[3] = replace(rows[3], idle_s=31.0)  # half the threshold without a step: stopped there
    [f] = check_hang(NOW, last, median_step_s=2.0, floor_s=60.0, collectives=rows)
    assert f.collective is not None and f.collective["never_entered"] == [2, 3]
    assert f.collective["unconfirmed"] == []


def test_ranks_past_a_broadcast_their_peers_wait_in_are_not_named_as_never_entering_the_next() -> None:
    # DDP broadcasts buffers from rank 0 before each forward (#46), then all-reduces (#47).
    # Rank 1 hung before its forward; rank 2 got rank 0's buffers and waits in #47; ranks
    # 0 and 3 wait in the broadcast. Rank 1 alone never entered the stuck collective.
    rows = [
        GroupCounters(0, WORLD, 46, 45, "broadcast", NOW - 200.0, True, IDLE),
        GroupCounters(1, WORLD, 45, 45, "all_reduce", NOW - 201.0, True, IDLE),
        GroupCounters(2, WORLD, 47, 46, "all_reduce", NOW - 199.0, True, IDLE),
        GroupCounters(3, WORLD, 46, 45, "broadcast", NOW - 199.5, True, IDLE),
    ]
    [s] = stuck_collectives(rows, range(4))
    assert (s.op, s.seq, s.never_entered, s.waiting, s.went_past) == ("broadcast", 46, (1,), (0, 3), (2,))
    assert describe(s).startswith("rank 1 never entered broadcast #46 of group world; 2 ranks wait in it")
    assert "rank 2 went past it" in describe(s)
    assert StuckCollective.from_dict(s.to_dict()) == s
    # Past an all-reduce nobody can go while a peer never entered it: such counters are
    # inconsistent (the waiting ranks' are older than the one that went past), no diagnosis.
    symmetric = [replace(c, op="all_reduce") if c.rank in (0, 3) else c for c in rows]
    assert stuck_collectives(symmetric, range(4)) == []
    # A rank's counters from a window (not where it stopped) do not choose the collective.
    stale = [*rows[:1], replace(rows[1], entered=44, completed=43, heartbeat=False), *rows[2:]]
    [s] = stuck_collectives(stale, range(4))
    assert (s.seq, s.never_entered, s.unconfirmed) == (46, (1,), (1,))


def test_before_any_step_past_warm_up_the_startup_allowance_is_the_threshold() -> None:
    # A first step on a loaded machine (compilation, lazy init, the first bucket rebuild)
    # takes many ordinary steps: no hang while the run has no step time yet.
    assert hang_threshold_s(None, 10.0, 5.0, startup_s=60.0) == 60.0
    assert hang_threshold_s(None, 10.0, 90.0, startup_s=60.0) == 90.0  # never below the floor
    assert hang_threshold_s(0.5, 10.0, 5.0, startup_s=60.0) == 5.0  # a step time known: the rule
    last = dict.fromkeys(range(4), NOW - 30.0)
    assert check_hang(NOW, last, None, 10.0, 5.0, startup_s=60.0) == []
    [f] = check_hang(NOW, last, 0.2, 10.0, 5.0, startup_s=60.0)
    assert f.key == "hang:run"


def test_a_pipeline_pair_whose_one_rank_never_sent_names_that_rank() -> None:
    # Rank 3 waits in a recv from rank 2 that never sent anything to it: rank 2 has no row
    # in the pair's sequence, and is still its member.
    rows = [GroupCounters(3, "world:p2p:2-3", 1, 0, "recv", NOW - 200.0, True, IDLE)]
    [s] = stuck_collectives(rows, range(4))
    assert (s.group, s.op, s.seq, s.never_entered, s.waiting) == ("world:p2p:2-3", "recv", 1, (2,), (3,))
    assert s.unconfirmed == (2,)  # no heartbeat of rank 2 in that sequence
