"""The benchmarks still run (tiny sizes): ``make bench`` must not rot between releases.
The figures themselves are printed by the benchmarks, never asserted here; what is
asserted is that their verdicts can fail (given figures with a known slowdown)."""

from __future__ import annotations

import pytest

from benchmarks import (
    agent_overhead,
    collective_counting,
    ingest,
    loadgen,
    metrics_scrape,
    profiler_window,
    query,
    run_listing,
)
from benchmarks.__main__ import discover
from stepwatch_server.schemas.ingest import IngestBatches, IngestPayload


def test_every_benchmark_is_discovered() -> None:
    assert {
        "agent_overhead",
        "collective_counting",
        "comm_timing",
        "hot_path",
        "ingest",
        "metrics_scrape",
        "profiler_window",
        "query",
        "run_listing",
    } <= set(discover())


def test_load_generator_payloads_are_valid_batches() -> None:
    fleet = loadgen.Fleet("lg", ranks=16, steps_per_window=8)
    batches = [IngestPayload.model_validate_json(b) for b in fleet.payloads(windows=2)]
    assert len(batches) == 32 and len({b.batch_id for b in batches}) == 32
    assert [(b.rank.rank, b.steps.first) for b in batches[15:17]] == [(15, 1), (0, 9)]


def test_host_bodies_carry_the_same_windows_one_host_each() -> None:
    per_rank = [IngestPayload.model_validate_json(b) for b in loadgen.Fleet("lg", 16, 8).payloads(2)]
    fleet = loadgen.Fleet("lg", 16, 8)
    hosts = [IngestBatches.model_validate_json(b).batches for b in fleet.host_payloads(2)]
    assert len(hosts) == 4 and all(len({p.rank.host for p in h}) == 1 and len(h) == 8 for h in hosts)
    flat = [p for h in hosts for p in h]
    assert [(p.rank.rank, p.steps.first, p.steps.time_s) for p in flat] == [
        (p.rank.rank, p.steps.first, p.steps.time_s) for p in per_rank
    ]


@pytest.mark.parametrize(
    ("bench", "args", "says"),
    [
        (ingest, ["--ranks", "32", "--steps-per-window", "8", "--windows", "1", "--rounds", "1"], "ratio"),
        (query, ["--days", "1", "--ranks", "16"], "run overview"),
        (run_listing, ["--runs", "120"], "scrape_s"),
        (metrics_scrape, ["--ranks", "8,16", "--scrapes", "1", "--rounds", "1"], "ratio"),
        (collective_counting, ["--rounds", "1", "--calls", "20"], "counted/plain"),
    ],
    ids=["ingest", "query", "run_listing", "metrics_scrape", "collective_counting"],
)
def test_benchmark_runs(
    bench: object, args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench.main(args) == 0  # type: ignore[attr-defined]
    assert says in capsys.readouterr().out


def _rounds(aa: list[float], agent: list[float]) -> dict[str, list[dict[str, float]]]:
    """Per-round runs of 30 ms steps: the second no-agent run and the agent runs as ratios."""
    base = 0.030
    return {
        agent_overhead.NO_AGENT: [{"wall_s": base, "cpu_s": base} for _ in aa],
        "collector up": [{"wall_s": base * x, "cpu_s": base * x} for x in agent],
        agent_overhead.AGAIN: [{"wall_s": base * x, "cpu_s": base * x} for x in aa],
    }


def test_overhead_verdict_flags_an_injected_3_percent_slowdown() -> None:
    quiet = [1.002, 0.998, 1.001, 0.999, 1.003, 0.997]
    slowed = agent_overhead.verdict(_rounds(quiet, [1.031, 1.029, 1.030, 1.032, 1.028, 1.030]))
    assert slowed["resolves"] and not slowed["met"]
    assert slowed["worst"]["wall_s"] == pytest.approx(0.0305, abs=1e-3)
    fine = agent_overhead.verdict(_rounds(quiet, [1.004, 1.006, 1.005, 1.003, 1.007, 1.005]))
    assert fine["resolves"] and fine["met"]


def test_overhead_verdict_says_when_its_band_cannot_resolve_2_percent() -> None:
    noisy = [1.06, 0.95, 1.04, 0.96]
    v = agent_overhead.verdict(_rounds(noisy, [1.03, 1.03, 1.03, 1.03]))
    assert not v["resolves"] and v["band"]["wall_s"] > 0.02 and not v["met"]


def test_profiler_self_estimate_is_checked_against_the_in_run_excess() -> None:
    figures = {
        "pairs": [(10.0, 9.9, 20.0, 19.8)],
        "median_ratio": 1.01,
        "median_cpu_ratio": 1.01,
        "windows_per_run": 1.0,
        "every": [400],
        "cost_per_window_s": 0.1,
        "self_measured_ratio": 0.0075,
        "self_measured_ratio_in_force": 0.0075,
        "in_run_excess_ratio": 0.0319,
    }
    assert any("under by 4.3x" in line and "MISSED" in line for line in profiler_window.report(figures))
    figures["self_measured_ratio"] = 0.025
    assert any("within 2x): met" in line for line in profiler_window.report(figures))


def test_read_budgets_can_be_missed() -> None:
    """The query and scrape verdicts fail a figure over its absolute budget or more than
    2x its same-run baseline (and pass one within both)."""
    assert query.verdict(0.030, 0.050) == (pytest.approx(50 / 30), True)
    assert not query.verdict(0.030, 0.070)[1]  # 2.3x the 1-day figure
    assert not query.verdict(0.090, 0.120)[1]  # over 100 ms
    assert metrics_scrape.verdict(0.040, 0.070)[1]
    assert not metrics_scrape.verdict(0.040, 0.090)[1]
    assert not metrics_scrape.verdict(0.150, 0.210)[1]
