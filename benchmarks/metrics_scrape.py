"""/metrics at 4,096 ranks: series count and scrape time, against 8 ranks in the same run.

    .venv/bin/python benchmarks/metrics_scrape.py [--ranks 4096] [--database-url URL]

Feeds two runs through the collector's real ingest code (payloads built by the agent's
own code and validated by the collector's schema): a baseline run of 8 ranks and a run of
``--ranks`` ranks, two windows each, with a profiler breakdown on every window and one
compute straggler found by the real detector. Then it scrapes ``/metrics`` of the app
(in process, through its HTTP layer) repeatedly and prints, for each run, the series it
adds and the median scrape time, and their ratios. The series of a run must not grow with
its ranks (bounded cardinality); the scrape time grows linearly (every rank enters the
quantiles).

Default database: a fresh SQLite file; pass a PostgreSQL URL to measure production.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' payload builders and detector bridge

from stepwatch_server.analysis.stragglers import StragglerDetector  # noqa: E402
from stepwatch_server.app import create_app  # noqa: E402
from stepwatch_server.exporter.catalog import series_per_run  # noqa: E402
from stepwatch_server.settings import Settings  # noqa: E402
from stepwatch_server.storage import migrate  # noqa: E402
from tests.runstate import detect_stragglers, feed, fill_breakdown  # noqa: E402


def populate(app: object, run: str, world: int) -> float:
    """Three windows of 4 steps per rank; rank world/2+1 computes 50% longer."""
    state = app.state  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    feed(state.ingestor, run=run, world=world, first=1, steps=12, step_time=lambda r: 0.25)
    detector = StragglerDetector(run)
    slow = world // 2 + 1
    for w in (0, 1, 2):
        fill_breakdown(
            state.engine,
            run,
            window=w,
            compute=lambda r: 0.15 if r == slow else 0.1,
            comm_wait=lambda r: 0.05,
        )
        detect_stragglers(state.engine, detector, w)
    return time.perf_counter() - t0


def scrape_times(app: object, n: int) -> tuple[float, str]:
    """Median seconds of ``n`` scrapes after a first one (which sums each run's tokens once)."""
    with TestClient(app) as client:  # type: ignore[arg-type]
        text = client.get("/metrics").text
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            text = client.get("/metrics").text
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples), text


def series_of(text: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.labels.get("run", "")
            counts[key] = counts.get(key, 0) + 1
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument("--database-url", default=None)
    ap.add_argument("--scrapes", type=int, default=15)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = args.database_url or f"sqlite:///{tmp}/bench.db"
        migrate.upgrade(url)
        settings = Settings(database_url=url, window_seconds=1.0)
        app = create_app(settings)
        fed = {run: populate(app, run, n) for run, n in (("small", 8), ("large", args.ranks))}
        both, text = scrape_times(app, args.scrapes)
        counts = series_of(text)
        bound = series_per_run(settings.metrics_top_k, settings.metrics_max_flagged)
        # Each run alone: an app that exports one run (the newest), made newest by one step.
        per_run = {}
        for run, world in (("small", 8), ("large", args.ranks)):
            feed(app.state.ingestor, run=run, world=world, first=13, steps=1, ranks=[0])
            per_run[run], _ = scrape_times(
                create_app(Settings(database_url=url, metrics_max_runs=1)), args.scrapes
            )
    backend = url.split(":")[0]
    print(f"database: {backend}; stored in {fed['small']:.1f} s (8 ranks), {fed['large']:.1f} s (large run)")
    print(f"series for the 8-rank run:    {counts.get('small', 0)}")
    print(f"series for the {args.ranks}-rank run: {counts.get('large', 0)}  (bound per run: {bound})")
    print(f"whole exposition: {sum(counts.values())} series, median scrape {both * 1e3:.1f} ms")
    print(
        f"median scrape, one run exported: 8 ranks {per_run['small'] * 1e3:.1f} ms, "
        f"{args.ranks} ranks {per_run['large'] * 1e3:.1f} ms "
        f"(ratio {per_run['large'] / per_run['small']:.1f}x for {args.ranks / 8:.0f}x the ranks)"
    )
    return 0 if counts.get("large", 0) <= bound else 1


if __name__ == "__main__":
    raise SystemExit(main())
