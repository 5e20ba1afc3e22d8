"""The per-run analysis pipeline (samples, progress tally, state) and window readiness."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch_server.analysis.arrivals import RankSteps
from stepwatch_server.analysis.attribution import deltas, top_component
from stepwatch_server.analysis.pipeline import (
    ProgressTally,
    RunAnalysis,
    StepRow,
    timing_means,
    window_sample,
)
from stepwatch_server.analysis.types import RankWindow
from stepwatch_server.worker.readiness import RankProgress, ready_windows

from ..synthetic import Fault, Topology, rank_windows

RATE = 1e-6  # MFU per token/s


def test_window_sample_leaves_tagged_steps_out() -> None:
    steps = [
        StepRow(1, 2.0, 100.0),
        StepRow(2, 2.0, 100.0),
        StepRow(3, 32.0, 0.0, "checkpoint"),
        StepRow(4, 4.0, 100.0),
    ]
    s = window_sample(
        steps, first_step=1, last_step=4, mfu_per_token_rate=RATE, components={"compute_s": 1.5}
    )
    assert s is not None and s.tag is None
    assert s.step_time_s == pytest.approx(8.0 / 3)
    assert s.mfu == pytest.approx(300.0 / 8.0 * RATE)
    assert (s.first_step, s.step, s.compute_s) == (1, 4, 1.5)


def test_window_sample_mostly_tagged_is_a_tagged_sample_and_empty_is_none() -> None:
    steps = [StepRow(i, 3.0, 10.0, "warmup") for i in range(1, 4)] + [StepRow(4, 2.0, 10.0)]
    s = window_sample(steps, first_step=1, last_step=4, mfu_per_token_rate=RATE)
    assert s is not None and s.tag == "warmup" and s.mfu is None
    assert window_sample([], first_step=1, last_step=4, mfu_per_token_rate=RATE) is None
    no_peak = window_sample(steps[3:], first_step=1, last_step=4, mfu_per_token_rate=None)
    assert no_peak is not None and no_peak.mfu is None


def _synced(rests: list[float], *, transfer: float = 0.02, steps: int = 8) -> list[RankSteps]:
    """One window of a synchronous step: each rank computes ``rest`` seconds (all of it on
    the CPU), then waits in the last collective for the slowest rank and the transfer."""
    slowest = max(rests)
    return [
        RankSteps(
            rank=r,
            host=f"h{r // 2}",
            first_step=1,
            step_time_s=[slowest + transfer] * steps,
            data_wait_s=[0.0] * steps,
            sync_s=[slowest - rest + transfer] * steps,
            cpu_s=[rest] * steps,
        )
        for r, rest in enumerate(rests)
    ]


def test_the_timing_breakdown_follows_the_critical_path_not_the_waits() -> None:
    """The job's step is the last arriver's: its compute and the transfer. The other ranks'
    wait for it is not communication time (a mean over ranks would call it that)."""
    m = timing_means([_synced([0.05, 0.05, 0.05, 0.08])])
    assert m["compute_s"] == pytest.approx(0.08)
    assert m["comm_exposed_s"] == pytest.approx(0.02)
    assert m["cpu_s"] == pytest.approx(0.08)
    # Tagged steps stay out; a rank alone in its group is its own critical path.
    assert timing_means([_synced([0.05, 0.08])], excluded=set(range(1, 9))) == {}
    assert timing_means([_synced([0.05])])["comm_exposed_s"] == pytest.approx(0.02)
    # A step some rank has no sync for has no known last arriver: left out, not averaged
    # over the ranks that have one (which would count their wait as communication).
    lost = _synced([0.05, 0.05, 0.05, 0.08])
    lost[3] = replace(lost[3], sync_s=[None] * 4 + list(lost[3].sync_s[4:]))
    assert timing_means([lost])["compute_s"] == pytest.approx(0.08)
    lost[3] = replace(lost[3], sync_s=[None] * 8)
    assert timing_means([lost]) == {}
    # One step of 50 s (the last arriver descheduled) stays out: in a mean it would be
    # 3 s of compute per step for the whole window, and for a baseline built on it.
    stalled = _synced([0.05, 0.05, 0.05, 0.08])
    for r in range(4):
        times = list(stalled[r].step_time_s)
        times[5] = 50.0
        stalled[r] = replace(stalled[r], step_time_s=times)
    assert timing_means([stalled])["compute_s"] == pytest.approx(0.08)
    # Every rank's compute grew, one rank's most (ranks sharing cores drift apart): the
    # others' waits grew more than their own compute, and still the step grew by compute.
    before = timing_means([_synced([0.10, 0.10, 0.10, 0.10])])
    after = timing_means([_synced([0.105, 0.105, 0.105, 0.14])])
    moved = deltas(after, before)
    assert top_component(moved) == "compute_s", moved
    assert moved["comm_exposed_s"] == pytest.approx(0.0, abs=1e-9)


def test_a_baseline_saved_without_the_critical_path_keeps_its_medians_not_its_components() -> None:
    """Components from before the breakdown followed the critical path (means over all
    ranks) do not compare with today's: a later regression would be attributed to the
    change of method."""
    from stepwatch_server.analysis.baseline import Baseline, MetricBaseline

    b = Baseline("r", None, 1, 160, 0.13, {"step_time_s": MetricBaseline(0.13, 0.002, 8)}, {"compute_s": 0.1})
    assert Baseline.from_dict(b.to_dict()) == b
    old = {k: v for k, v in b.to_dict().items() if k != "components_basis"}
    assert Baseline.from_dict(old).components == {}
    assert Baseline.from_dict(old).metrics == b.metrics


def test_progress_tally_counts_productive_time_and_the_wall_span() -> None:
    t = ProgressTally(keep=2)
    t.add([StepRow(1, 10.0, 5.0, "warmup", wall_end=1010.0), StepRow(2, 10.0, 5.0, None, wall_end=1020.0)])
    t.add(
        [StepRow(3, 20.0, 0.0, "checkpoint", wall_end=1040.0), StepRow(4, 10.0, 5.0, None, wall_end=1060.0)]
    )
    t.add([StepRow(5, 12.0, 6.0, None, wall_end=1072.0)])
    # Warm-up trains (productive); the checkpoint does not; a restart gap (1040 -> 1050) counts as wall.
    assert t.productive_s == 10 + 10 + 10 + 12
    assert t.wall_s == 1072.0 - 1000.0
    assert t.recent == [[5.0, 1.0, 10.0], [6.0, 1.0, 12.0]]  # untagged steps of the last 2 windows
    back = ProgressTally.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back == t


def _feed(analysis: RunAnalysis, windows: list[list[RankWindow]]) -> list[tuple[int, str, str]]:
    out = []
    for ws in windows:
        w0 = ws[0]
        steps = [StepRow(s, w0.step_time_s, 1000.0) for s in range(w0.first_step, w0.last_step + 1)]
        changes = analysis.feed(
            w0.window, ws, steps, first_step=w0.first_step, last_step=w0.last_step, mfu_per_token_rate=RATE
        )
        out += [(ch.window, ch.finding.key, ch.finding.status) for ch in changes]
    return out


def test_state_round_trip_continues_exactly_where_it_stopped() -> None:
    stream = list(
        rank_windows(
            topology=Topology(hosts=8, ranks_per_host=8, tp=4, pp=2),
            n_windows=40,
            faults=[Fault("compute", at=10, target=45, mag=0.2, until=25)],
            seed=4,
        )
    )
    whole = _feed(RunAnalysis("r"), stream)
    first = RunAnalysis("r")
    part = _feed(first, stream[:17])
    resumed = RunAnalysis.from_state("r", json.loads(json.dumps(first.to_state())))
    part += _feed(resumed, stream[17:])
    assert part == whole
    stragglers = [c for c in whole if c[1].startswith("straggler:")]
    assert stragglers == [
        (12, "straggler:compute:rank=45", "open"),
        (27, "straggler:compute:rank=45", "closed"),
    ]
    # The straggler holds the whole synchronous job back by ~20%: a job-wide regression
    # of both metrics, opened after the fault began and closed after it ended.
    regressions = [c for c in whole if c[1].startswith("regression:")]
    assert {k for _, k, _ in regressions} == {"regression:mfu", "regression:step_time"}
    assert all(10 < w <= 15 for w, _, st in regressions if st == "open"), regressions
    assert all(25 < w <= 35 for w, _, st in regressions if st == "closed"), regressions
    assert [st for _, k, st in regressions if k == "regression:mfu"] == ["open", "closed"]
    assert resumed.imbalance is not None and resumed.imbalance.slowest_stage == 1  # the heavier last stage
    assert resumed.progress.steps == 40 * 20


def test_state_of_an_unknown_version_is_refused() -> None:
    with pytest.raises(ValueError, match="version"):
        RunAnalysis.from_state("r", {"version": 99})


# -- readiness --------------------------------------------------------------------------
def ready(ranks: list[RankProgress], **kw: object) -> tuple[tuple[int, ...], dict[int, float]]:
    args: dict[str, object] = {
        "next_window": 0,
        "window_steps": 10,
        "world_size": 4,
        "max_step": max((r.last_step for r in ranks), default=0),
        "pending": {},
        "now": 100.0,
        "grace_s": 60.0,
        "limit": 100,
    }
    args.update(kw)
    r = ready_windows(ranks=ranks, **args)
    return r.windows, dict(r.pending)


def test_a_window_is_ready_when_every_rank_passed_it() -> None:
    ranks = [RankProgress(0, 35), RankProgress(1, 30), RankProgress(2, 42), RankProgress(3, 31)]
    windows, pending = ready(ranks)
    assert windows == (0, 1, 2)  # every rank passed step 30; window 3 (31-40) lacks rank 1
    assert pending == {3: 100.0}  # window 3 is passed by newer data: its grace starts now
    assert ready(ranks, next_window=2)[0] == (2,)
    assert ready(ranks, limit=2)[0] == (0, 1)


def test_a_late_rank_is_left_out_after_the_grace_period() -> None:
    ranks = [RankProgress(0, 55), RankProgress(1, 12), RankProgress(2, 55), RankProgress(3, 55)]
    windows, pending = ready(ranks, next_window=1, pending={1: 30.0, 2: 90.0})
    assert windows == (1,)  # 70 s since window 1 was first seen passed: analysed without rank 1
    assert pending == {2: 90.0, 3: 100.0, 4: 100.0}  # window 5 holds the newest step: not passed
    assert ready(ranks, next_window=1, pending={1: 50.0})[0] == ()


def test_finished_ranks_complete_every_window_and_missing_ranks_need_grace() -> None:
    done = [RankProgress(r, 25, final_step=25) for r in range(4)]
    assert ready(done)[0] == (0, 1, 2)  # including the partial last window
    restarted = [*done[:3], RankProgress(3, 26, final_step=25)]  # stepped again after its final batch
    assert ready(restarted)[0] == (0, 1)
    three = done[:3]  # rank 3 never reported
    assert ready(three)[0] == ()
    assert ready(three, pending={0: 0.0, 1: 0.0, 2: 0.0})[0] == (0, 1, 2)


@settings(max_examples=200, deadline=None)
@given(
    last=st.lists(st.integers(0, 200), min_size=1, max_size=6),
    world=st.integers(1, 6),
    next_window=st.integers(0, 25),
    grace=st.floats(0, 100),
)
def test_ready_windows_is_a_contiguous_prefix_of_passed_windows(
    last: list[int], world: int, next_window: int, grace: float
) -> None:
    ranks = [RankProgress(i, s) for i, s in enumerate(last)]
    r = ready_windows(
        next_window=next_window,
        window_steps=10,
        world_size=world,
        ranks=ranks,
        max_step=max(last),
        pending={},
        now=0.0,
        grace_s=grace,
        limit=50,
    )
    assert list(r.windows) == list(range(next_window, next_window + len(r.windows)))
    if r.windows:
        assert max(r.windows) < (max(last) - 1) // 10  # never the window still being filled
    assert not set(r.windows) & set(r.pending)
