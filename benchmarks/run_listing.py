"""The collector at 10,000 runs: ``GET /api/v1/runs`` p99, the page at ``/`` and a
``/metrics`` scrape, against a 50-run baseline measured in the same run.

    .venv/bin/python benchmarks/run_listing.py [--runs 10000] [--postgresql]

Two databases are filled through the collector's real ingest code (payloads built by the
agent's own code, validated by the collector's schema): ``--runs`` runs of one rank, half
of them reporting (their last batch is recent; the other half's batches are moved two
days back, past the exporter's expiry), and a baseline of 50 runs with the same split.
Each app is then read through its HTTP layer (in process). Budgets (issue 15) at 10,000
runs: list p99 <= 50 ms, page <= 200 KB, scrape <= 500 ms.

Also measured, with no budget: the list filtered by ``?status=finished`` (a condition on
``runs``: none match here) and by ``?status=live`` (every run here: each is classified by
``run_states`` before the page is cut, the filter's worst case).

Default databases: fresh SQLite files; ``--postgresql``: fresh databases on the test
PostgreSQL (``tests/pg.py``), to measure production.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import update

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' payload builder

from benchmarks._harness import pg_database  # noqa: E402
from stepwatch_server.app import create_app  # noqa: E402
from stepwatch_server.ingest.store import Ingestor  # noqa: E402
from stepwatch_server.schemas.ingest import IngestPayload  # noqa: E402
from stepwatch_server.settings import Settings  # noqa: E402
from stepwatch_server.storage import migrate  # noqa: E402
from stepwatch_server.storage.backend import open_storage  # noqa: E402
from stepwatch_server.storage.engine import make_engine  # noqa: E402
from stepwatch_server.storage.models import Run  # noqa: E402
from tests.payloads import payload  # noqa: E402

BUDGET = {"list_p99_s": 0.050, "page_bytes": 200_000, "scrape_s": 0.500}


def populate(url: str, runs: int) -> None:
    engine = make_engine(url)
    try:
        ingestor = Ingestor(open_storage(engine))
        for start in range(0, runs, 500):
            group = [
                IngestPayload.model_validate(payload(run=f"bench-{i:05d}", times=[0.5] * 4))
                for i in range(start, min(runs, start + 500))
            ]
            ingestor.store_many(group)
        old = datetime.now(timezone.utc) - timedelta(days=2)
        with engine.begin() as conn:  # half of the runs stopped reporting two days ago
            conn.execute(update(Run).where(Run.id % 2 == 0).values(last_report_at=old))
    finally:
        engine.dispose()


def measure(url: str, requests: int = 200, scrapes: int = 7) -> dict[str, float]:
    app = create_app(Settings(database_url=url, analysis_enabled=False))
    with TestClient(app) as c:
        c.get("/api/v1/runs")  # warm the pool and caches
        times = []
        for _ in range(requests):
            t0 = time.perf_counter()
            r = c.get("/api/v1/runs")
            times.append(time.perf_counter() - t0)
            assert r.status_code == 200
        filtered = {}
        for status in ("finished", "live"):
            took = []
            for _ in range(max(requests // 4, 1)):
                t0 = time.perf_counter()
                assert c.get("/api/v1/runs", params={"status": status}).status_code == 200
                took.append(time.perf_counter() - t0)
            took.sort()
            filtered[f"{status}_p99_s"] = took[int(0.99 * (len(took) - 1))]
        page = c.get("/")
        scrape = []
        for _ in range(scrapes):
            t0 = time.perf_counter()
            assert c.get("/metrics").status_code == 200
            scrape.append(time.perf_counter() - t0)
    times.sort()
    return {
        "list_p99_s": times[int(0.99 * (len(times) - 1))],
        **filtered,
        "list_bytes": float(len(r.content)),
        "page_bytes": float(len(page.content)),
        "scrape_s": statistics.median(scrape),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=10_000)
    p.add_argument("--postgresql", action="store_true", help="measure on PostgreSQL")
    args = p.parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.postgresql:
            small = stack.enter_context(pg_database("stepwatch_bench_small"))
            big = stack.enter_context(pg_database("stepwatch_bench_big"))
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            small, big = f"sqlite:///{tmp}/small.db", f"sqlite:///{tmp}/big.db"
            migrate.upgrade(small)
            migrate.upgrade(big)
        for url, n in ((small, 50), (big, args.runs)):
            t0 = time.perf_counter()
            populate(url, n)
            print(f"{n:>6} runs ({n // 2} reporting) stored in {time.perf_counter() - t0:.1f} s", flush=True)
        base, large = measure(small), measure(big)
    print(f"backend: {'postgresql' if args.postgresql else 'sqlite'}")
    print(f"{'':14}{'50 runs':>12}{f'{args.runs} runs':>14}{'ratio':>8}  budget")
    for key, unit, scale in (
        ("list_p99_s", "ms", 1e3),
        ("finished_p99_s", "ms", 1e3),
        ("live_p99_s", "ms", 1e3),
        ("list_bytes", "KB", 1e-3),
        ("page_bytes", "KB", 1e-3),
        ("scrape_s", "ms", 1e3),
    ):
        ratio = large[key] / base[key] if base[key] else float("nan")
        budget = BUDGET.get(key)
        verdict = (
            ""
            if budget is None
            else ("met" if large[key] <= budget else "MISSED") + f" (<= {budget * scale:g})"
        )
        figures = f"{base[key] * scale:>10.1f}{unit}{large[key] * scale:>12.1f}{unit}{ratio:>8.2f}"
        print(f"{key:14}{figures}  {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
