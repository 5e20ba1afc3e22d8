"""Straggler detection on seeded synthetic windows: causes, ranks, timing, no false flags."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch_server.analysis import (
    Finding,
    RankWindow,
    StragglerConfig,
    StragglerDetector,
    evaluate_window,
    stage_imbalance,
)

from ..synthetic import Fault, Noise, Topology, rank_windows

FAULT_AT = 20
DP = Topology(hosts=8, ranks_per_host=8)  # 8 hosts x 8 ranks, pure data parallel
THREE_D = Topology(
    hosts=8, ranks_per_host=8, tp=4, pp=2
)  # dp 8, with communicator groups and a heavier last stage


def run_detector(
    stream: Iterable[list[RankWindow]], detector: StragglerDetector | None = None
) -> list[tuple[int, Finding]]:
    det = detector or StragglerDetector("synthetic")
    events: list[tuple[int, Finding]] = []
    for windows in stream:
        events.extend((windows[0].window, f) for f in det.update(windows))
    return events


def opened(events: Sequence[tuple[int, Finding]]) -> list[tuple[int, Finding]]:
    return [(w, f) for w, f in events if f.status == "open"]


@pytest.mark.parametrize(
    ("topology", "fault", "ranks", "hosts"),
    [
        (DP, Fault("compute", at=FAULT_AT, target=13, mag=0.2), (13,), ("sim-n0001",)),
        (THREE_D, Fault("compute", at=FAULT_AT, target=45, mag=0.2), (45,), ("sim-n0005",)),
        (DP, Fault("data", at=FAULT_AT, target=5, mag=0.15), (5,), ("sim-n0000",)),
        (THREE_D, Fault("data", at=FAULT_AT, target=33, mag=0.15), (33,), ("sim-n0004",)),
        (DP, Fault("link", at=FAULT_AT, target=7, mag=1.0), (7,), ("sim-n0000",)),
        (THREE_D, Fault("link", at=FAULT_AT, target=21, mag=0.5), (21,), ("sim-n0002",)),
        (DP, Fault("host", at=FAULT_AT, target=3, mag=0.2), tuple(range(24, 32)), ("sim-n0003",)),
        (THREE_D, Fault("host", at=FAULT_AT, target=2, mag=0.2), tuple(range(16, 24)), ("sim-n0002",)),
    ],
    ids=["compute-dp", "compute-3d", "data-dp", "data-3d", "link-dp", "link-3d", "host-dp", "host-3d"],
)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_each_cause_flagged_with_right_rank_within_three_windows(
    topology: Topology, fault: Fault, ranks: tuple[int, ...], hosts: tuple[str, ...], seed: int
) -> None:
    events = opened(
        run_detector(rank_windows(topology=topology, n_windows=FAULT_AT + 6, faults=[fault], seed=seed))
    )
    assert len(events) == 1, [f.message for _, f in events]
    window, finding = events[0]
    assert window - FAULT_AT + 1 <= 3  # opened by the third faulty window
    assert finding.cause == fault.kind
    assert finding.ranks == ranks
    assert finding.hosts == hosts
    assert finding.first_step == FAULT_AT * 20 + 1
    assert finding.cost_seconds > 0
    assert 0 < finding.cost_ratio < 1
    assert finding.kind == "straggler"


def test_compute_straggler_evidence_cost_and_message() -> None:
    fault = Fault("compute", at=FAULT_AT, target=2, mag=0.2)
    [(_, finding)] = opened(
        run_detector(rank_windows(topology=DP, n_windows=FAULT_AT + 3, faults=[fault], seed=7))
    )
    ev = finding.evidence
    # Longer compute, shorter wait: it is the one the others wait for.
    assert ev["compute_s"] / ev["peer_median_compute_s"] == pytest.approx(ev["ratio"])
    assert ev["ratio"] >= 1.10
    assert ev["z"] >= 5
    assert ev["comm_wait_s"] < ev["peer_median_comm_wait_s"]
    # The what-if: the step shortens by about the extra compute (20% of 1.6 s).
    assert finding.cost_seconds == pytest.approx(0.32, rel=0.25)
    assert finding.cost_ratio == pytest.approx(finding.cost_seconds / ev["step_time_s"], rel=0.05)
    assert finding.message.startswith(
        "Rank 2 (host sim-n0000) is a compute straggler since step 401: compute "
    )
    assert "vs peer median" in finding.message
    assert finding.message.endswith("%).")
    json.dumps(finding.to_dict())
    assert Finding.from_dict(finding.to_dict()) == finding


def test_no_false_flags_over_ten_thousand_clean_rank_windows() -> None:
    windows = 0
    events: list[tuple[int, Finding]] = []
    for topology, seed in ((DP, 11), (THREE_D, 12)):
        stream = list(rank_windows(topology=topology, n_windows=100, seed=seed))
        windows += sum(len(ws) for ws in stream)
        events += run_detector(stream)
    assert windows >= 10_000
    assert events == []


def test_one_noisy_window_raises_nothing() -> None:
    fault = Fault("compute", at=FAULT_AT, target=9, mag=1.0, until=FAULT_AT + 1)  # a huge one-window spike
    spike = Fault("data", at=FAULT_AT + 5, target=9, mag=2.0, until=FAULT_AT + 6)
    events = run_detector(rank_windows(topology=DP, n_windows=FAULT_AT + 12, faults=[fault, spike], seed=3))
    assert events == []
    stream = list(rank_windows(topology=DP, n_windows=FAULT_AT + 1, faults=[fault], seed=3))
    assert "straggler:compute:rank=9" in evaluate_window(stream[FAULT_AT]).hits  # it was seen, once


def test_hysteresis_no_flapping() -> None:
    faults = [
        Fault("compute", at=10, target=4, mag=0.25, until=20),
        Fault("compute", at=21, target=4, mag=0.25, until=23),  # one clean window inside the fault
        Fault("compute", at=25, target=4, mag=0.25, until=30),  # two clean windows inside the fault
    ]
    events = run_detector(rank_windows(topology=DP, n_windows=40, faults=faults, seed=5))
    statuses = [(w, f.status) for w, f in events]
    assert statuses == [(12, "open"), (32, "closed")]
    closed = events[-1][1]
    assert closed.first_step == 10 * 20 + 1
    assert closed.last_step == 30 * 20
    assert closed.message.startswith("Rank 4 (host sim-n0000) was a compute straggler from step 201 to 600")


def test_pipeline_stages_compared_within_stage_only() -> None:
    # The last of four stages computes 40% longer by design: no stragglers, but an
    # imbalance finding.
    noise = Noise(stage_skew=0.4)
    stream = list(
        rank_windows(
            topology=Topology(hosts=8, ranks_per_host=8, tp=2, pp=4), n_windows=30, noise=noise, seed=8
        )
    )
    assert run_detector(stream) == []
    imbalance = stage_imbalance(stream[5])
    assert imbalance is not None
    assert imbalance.slowest_stage == 3
    assert imbalance.ratio == pytest.approx(1.4, rel=0.05)
    assert imbalance.cost_seconds > 0
    assert "Pipeline stage 3" in imbalance.message
    # Without a layout the same numbers would be compared across stages and flag stage 3.
    flat = [
        [replace(w, pp_rank=None, tp_rank=None, groups={}, group_transfer_s={}) for w in ws] for ws in stream
    ]
    assert opened(run_detector(flat))


def test_without_profiler_only_data_stragglers_are_detected() -> None:
    faults = [
        Fault("compute", at=FAULT_AT, target=3, mag=0.3),
        Fault("data", at=FAULT_AT, target=50, mag=0.2),
    ]
    stream = [
        [replace(w, compute_s=None, comm_wait_s=None, comm_transfer_s=None, comm_exposed_s=None) for w in ws]
        for ws in rank_windows(topology=DP, n_windows=FAULT_AT + 5, faults=faults, seed=4)
    ]
    keys = [f.key for _, f in opened(run_detector(stream))]
    assert keys == ["straggler:data:rank=50"]


def test_profiler_gaps_neither_advance_nor_reset_a_streak() -> None:
    fault = Fault("compute", at=FAULT_AT, target=6, mag=0.25)
    stream = list(rank_windows(topology=DP, n_windows=FAULT_AT + 8, faults=[fault], seed=6, profiler_every=2))
    events = opened(run_detector(stream))
    assert [(w, f.key) for w, f in events] == [(FAULT_AT + 4, "straggler:compute:rank=6")]


def test_host_flag_replaces_per_rank_flags() -> None:
    events = run_detector(
        rank_windows(
            topology=DP, n_windows=FAULT_AT + 10, faults=[Fault("host", at=FAULT_AT, target=6, mag=0.2)]
        )
    )
    [(_, finding)] = opened(events)
    assert finding.key == "straggler:host:host=sim-n0006"
    assert finding.message.startswith("Host sim-n0006 is slow since step 401: ")
    assert "compute" in finding.message


def test_link_named_by_intersecting_slow_groups() -> None:
    fault = Fault("link", at=FAULT_AT, target=21, mag=0.5)
    stream = list(rank_windows(topology=THREE_D, n_windows=FAULT_AT + 1, faults=[fault], seed=9))
    verdict = evaluate_window(stream[FAULT_AT])
    # Every member of rank 21's DP and TP groups sees a slow group; only 21 is in both.
    assert [k for k in verdict.hits if ":link:" in k] == ["straggler:link:rank=21"]
    hit = verdict.hits["straggler:link:rank=21"]
    assert hit.evidence["slow_groups"] >= 2
    assert hit.evidence["transfer_dp_s"] > 1.3 * hit.evidence["median_transfer_dp_s"]


def test_state_round_trip_matches_uninterrupted_run() -> None:
    faults = [Fault("compute", at=5, target=1, mag=0.3, until=15), Fault("host", at=8, target=4, mag=0.2)]
    stream = list(rank_windows(topology=DP, n_windows=25, faults=faults, seed=10))
    straight = run_detector(stream)
    det = StragglerDetector("synthetic")
    resumed = run_detector(stream[:9], det)
    state = json.loads(json.dumps(det.to_state()))
    rebuilt = StragglerDetector.from_state(state)
    assert rebuilt.to_state() == det.to_state()
    assert [f.key for f in rebuilt.open_findings()] == [f.key for f in det.open_findings()]
    resumed += run_detector(stream[9:], rebuilt)
    assert resumed == straight
    assert {f.key for _, f in straight} == {"straggler:compute:rank=1", "straggler:host:host=sim-n0004"}


def test_replayed_windows_are_ignored() -> None:
    stream = list(
        rank_windows(topology=DP, n_windows=30, faults=[Fault("data", at=5, target=8, mag=0.2)], seed=2)
    )
    det = StragglerDetector("synthetic")
    first = run_detector(stream, det)
    assert run_detector(stream, det) == []
    assert len(first) == 1


def test_config_round_trip_and_validation() -> None:
    cfg = StragglerConfig(min_ratio=1.2, open_after=4)
    assert StragglerConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="min_peers"):
        StragglerConfig(min_peers=2)


def _windows(values: Sequence[tuple[float, float, int]]) -> list[RankWindow]:
    return [
        RankWindow(
            run="p",
            rank=i,
            host=f"n{host}",
            local_rank=i,
            window=0,
            first_step=1,
            last_step=10,
            n_steps=10,
            step_time_s=max(c + d for c, d, _ in values) + 0.1,
            data_wait_s=d,
            compute_s=c,
        )
        for i, (c, d, host) in enumerate(values)
    ]


rank_values = st.lists(
    st.tuples(
        st.floats(min_value=0.01, max_value=10.0),
        st.floats(min_value=0.0, max_value=2.0),
        st.integers(min_value=0, max_value=3),
    ),
    min_size=4,
    max_size=24,
)


@settings(max_examples=60, deadline=None)
@given(rank_values, st.randoms(use_true_random=False))
def test_hits_have_nonnegative_cost_and_ignore_order(
    values: list[tuple[float, float, int]], rnd: random.Random
) -> None:
    windows = _windows(values)
    verdict = evaluate_window(windows)
    for hit in verdict.hits.values():
        assert hit.cost_seconds >= 0
        assert hit.evidence["cost_s"] >= 0
    shuffled = list(windows)
    rnd.shuffle(shuffled)
    assert set(evaluate_window(shuffled).hits) == set(verdict.hits)
