"""The arithmetic behind /metrics, on hand-made rows (no database, no registry)."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepwatch_server.exporter import state
from stepwatch_server.exporter.catalog import FAMILIES, series_bound, series_per_run
from stepwatch_server.exporter.state import EventRow, JobStepSums, RankWindowSums


def step(
    n: int, t: float = 0.5, tag: int = 0, ranks: int = 4, tokens: int = 4000, wait: float = 0.0
) -> JobStepSums:
    return JobStepSums(
        step=n,
        ranks=ranks,
        token_ranks=ranks,
        step_time_sum=t * ranks,
        data_wait_max=wait,
        tokens=tokens,
        padded_tokens=None,
        tag=tag,
    )


def test_current_rates_use_the_newest_untagged_steps_only() -> None:
    rows = [step(i, 0.5) for i in range(1, 30)] + [step(30, 9.0, tag=2)]  # a checkpoint step
    rates = state.current_rates(rows, dp_size=4)
    assert rates is not None
    assert rates.step_time_s == pytest.approx(0.5)
    assert rates.tokens_per_s == pytest.approx(4000 / 0.5)
    assert state.current_rates([step(1, tag=1), step(2, tag=1)], dp_size=4) is None  # all warm-up


def test_tokens_scale_from_reporting_replicas_to_all() -> None:
    # 2 of 4 replicas reported 2,000 tokens: the step is estimated at 4,000.
    half = JobStepSums(
        5, ranks=2, token_ranks=2, step_time_sum=1.0, data_wait_max=0, tokens=2000, padded_tokens=None, tag=0
    )
    assert half.tokens_est(4) == pytest.approx(4000)
    rates = state.current_rates([half], dp_size=4)
    assert rates is not None and rates.tokens_per_s == pytest.approx(4000 / 0.5)


def test_mfu_scale_follows_the_overview_formula() -> None:
    conv = state.convention_of(
        {"flops_per_token": 1e9, "peak_flops": 1e14, "formula": "6N", "dtype": "bf16"}, 8
    )
    assert conv.mfu_scale == pytest.approx(1e9 / (8 * 1e14))
    assert conv.hfu_scale is None
    assert state.convention_of({"flops_per_token": 1e9, "peak_flops": None}, 8).mfu_scale is None
    assert state.convention_of(None, 8).formula == ""


def test_baseline_is_the_median_of_the_given_steps() -> None:
    rows = [step(i, t) for i, t in enumerate([0.5, 0.6, 0.4, 5.0, 0.5], start=11)]
    b = state.baseline_of(rows, dp_size=4)
    assert b is not None
    assert b.step_time_s == pytest.approx(0.5)  # the 5 s outlier does not move it
    assert (b.steps, b.last_step) == (5, 15)


def test_hang_threshold_is_widened_by_checkpoints() -> None:
    rows = [step(i, 2.0) for i in range(1, 50)]
    assert state.hang_threshold(rows, 0.0) == pytest.approx(60.0)  # the floor
    assert state.hang_threshold([step(i, 30.0) for i in range(1, 50)], 0.0) == pytest.approx(300.0)
    assert state.hang_threshold(rows, 200.0) == pytest.approx(300.0)  # 1.5 x a 200 s checkpoint
    assert state.longest_tagged_step([step(1, 200.0, tag=2), step(2, 900.0, tag=1)]) == pytest.approx(200.0)


def test_tagged_counts_name_every_tag() -> None:
    assert state.tagged_counts([step(1, tag=1), step(2, tag=1), step(3, tag=3), step(4)]) == {
        "warmup": 2,
        "checkpoint": 0,
        "eval": 1,
    }


def test_quantiles_are_exact() -> None:
    values = [float(v) for v in range(1, 101)]
    qs = dict(state.quantiles(values, (0.0, 0.1, 0.5, 0.9, 1.0)))
    assert qs[0.0] == 1.0 and qs[1.0] == 100.0
    assert qs[0.5] == pytest.approx(statistics.median(values))
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    assert qs[0.1] == pytest.approx(deciles[0]) and qs[0.9] == pytest.approx(deciles[-1])


@given(st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=1, max_size=200))
def test_quantiles_are_monotone_and_within_range(values: list[float]) -> None:
    qs = [v for _, v in state.quantiles(values)]
    assert qs == sorted(qs)
    assert qs[0] == min(values) and qs[-1] == max(values)


@given(st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=0, max_size=300))
def test_quantiles_from_the_order_statistics_the_database_returns(values: list[float]) -> None:
    """The exporter asks the database only for the positions ``order_positions`` names;
    interpolating between them gives the quantiles of all the values."""
    ordered = sorted(values)
    wanted = state.order_positions(len(ordered))
    assert len(wanted) <= 2 * len(state.QUANTILES) and all(0 <= i < len(ordered) for i in wanted)
    at = {i: ordered[i] for i in wanted}
    assert state.interpolate(len(ordered), at) == state.quantiles(values)


def rank_row(
    rank: int, window: int, t: float = 0.5, compute: float | None = None, wait: float = 0.0
) -> RankWindowSums:
    return RankWindowSums(
        rank=rank,
        window=window,
        n_steps=4,
        step_time_sum=4 * t,
        data_wait_sum=4 * wait,
        profiled_steps=2 if compute is not None else None,
        compute_s=compute,
        comm_overlapped_s=0.1 if compute is not None else None,
        comm_exposed_s=0.05 if compute is not None else None,
        idle_s=0.01 if compute is not None else None,
        comm_wait_s=0.2 - (compute or 0) / 10 if compute is not None else None,
    )


def test_complete_window_is_the_one_before_the_newest() -> None:
    assert state.complete_window({6: 8, 7: 3}, newest=7) == 6
    assert state.complete_window({0: 1}, newest=0) == 0  # a run's first window
    assert state.complete_window({7: 3}, newest=7) == 7
    assert state.complete_window({}, newest=7) is None


def test_reporting_ranks_count_from_the_first_step_of_the_window_before_the_newest() -> None:
    assert state.reporting_since(12, 4) == 5  # windows 1 (steps 5-8) and 2 (9-12)
    assert state.reporting_since(5, 4) == 0  # the window before is window 0, with step 0
    assert state.reporting_since(3, 4) == 0
    assert state.reporting_since(None, 4) == 0


def test_slowest_ranks_by_compute_when_profiled() -> None:
    # Synchronous training: equal step times; rank 2 computes longer (the culprit).
    complete = {r: rank_row(r, 6, t=0.5) for r in range(4)}
    profiled = {r: rank_row(r, 5, compute=0.30 if r == 2 else 0.20) for r in range(4)}
    values = state.rank_values(complete, profiled)
    assert state.slowest(values, 1) == [2]
    assert state.slowest(state.rank_values(complete, {}), 2) == [0, 1]  # ties: lower rank first
    assert state.slowest(values, 0) == []


def test_breakdown_and_overlap_from_the_profiled_means() -> None:
    means = {"compute": 0.2, "comm_overlapped": 0.1, "comm_exposed": 0.05, "data_wait": 0.04, "idle": 0.01}
    parts, overlap = state.breakdown(means)
    assert parts == means
    assert overlap == pytest.approx(0.1 / 0.15)
    assert state.breakdown(None) == (None, None)
    assert state.breakdown({**means, "comm_overlapped": 0.0, "comm_exposed": 0.0})[1] is None


def event(
    ranks: tuple[int, ...], cost: float, cause: str | None = "compute", kind: str = "straggler"
) -> EventRow:
    hosts = tuple(f"node{r // 8}" for r in ranks)
    return EventRow(kind, cause, ranks, hosts, 100, cost, cost / 2)


def test_flagged_ranks_costliest_first_each_once_capped() -> None:
    events = [
        event((3,), 0.1),
        event((3,), 0.4),
        event((8, 9), 0.2, cause="host"),
        event((), 1.0, None, "hang"),
    ]
    out = state.flagged_ranks(events, limit=2)
    assert [(rank, ev.cost_seconds) for rank, _, ev in out] == [(3, 0.4), (8, 0.2)]
    assert out[1][1] == "node1"


def test_open_event_counts_have_every_slot() -> None:
    counts = state.open_event_counts(
        [event((1,), 0.1), event((2,), 0.1, cause=None), event((), 1, None, "hang")]
    )
    assert counts[("straggler", "compute")] == 1 and counts[("straggler", "unknown")] == 1
    assert counts[("hang", "")] == 1 and counts[("regression", "")] == 0
    assert len(counts) == len(state.EVENT_SLOTS)


def test_every_cause_the_analysis_names_is_its_own_label() -> None:
    """The late-arrival causes (a stall, waiting for a core) were exported as
    ``unknown``: the label set is the analysis' own list of causes."""
    counts = state.open_event_counts(
        [event((1,), 0.1, cause="host_stall"), event((2,), 0.1, cause="cpu_contention")]
    )
    assert counts[("straggler", "host_stall")] == 1 and counts[("straggler", "cpu_contention")] == 1
    assert counts[("straggler", "unknown")] == 0


def test_series_bound_grows_with_the_configuration_not_the_data() -> None:
    assert series_bound(10, 8, 16) - series_bound(9, 8, 16) == series_per_run(8, 16)
    per_rank = sum(1 for f in FAMILIES if f.scope == "rank")
    assert series_per_run(9, 16) - series_per_run(8, 16) == per_rank
