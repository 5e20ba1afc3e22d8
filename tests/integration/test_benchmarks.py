"""The benchmarks still run (tiny sizes): ``make bench`` must not rot between releases.
The figures themselves are printed by the benchmarks, never asserted here."""

from __future__ import annotations

import pytest

from benchmarks import ingest, loadgen, query, run_listing
from benchmarks.__main__ import discover
from stepwatch_server.schemas.ingest import IngestPayload


def test_every_benchmark_is_discovered() -> None:
    assert {
        "agent_overhead",
        "comm_timing",
        "hot_path",
        "ingest",
        "profiler_window",
        "query",
        "run_listing",
    } <= set(discover())


def test_load_generator_payloads_are_valid_batches() -> None:
    fleet = loadgen.Fleet("lg", ranks=16, steps_per_window=8)
    batches = [IngestPayload.model_validate_json(b) for b in fleet.payloads(windows=2)]
    assert len(batches) == 32 and len({b.batch_id for b in batches}) == 32
    assert [(b.rank.rank, b.steps.first) for b in batches[15:17]] == [(15, 1), (0, 9)]


@pytest.mark.parametrize(
    ("bench", "args", "says"),
    [
        (ingest, ["--ranks", "32", "--steps-per-window", "8", "--windows", "1", "--rounds", "1"], "ratio"),
        (query, ["--days", "1", "--ranks", "16"], "run overview"),
        (run_listing, ["--runs", "120"], "scrape_s"),
    ],
    ids=["ingest", "query", "run_listing"],
)
def test_benchmark_runs(
    bench: object, args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench.main(args) == 0  # type: ignore[attr-defined]
    assert says in capsys.readouterr().out
