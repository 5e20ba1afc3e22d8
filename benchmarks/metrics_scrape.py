"""/metrics at 1,024, 4,096 and 16,384 ranks: scrape time as a ratio of the smallest run's.

    python -m benchmarks.metrics_scrape [--ranks 1024,4096,16384] [--database-url URL]

Stores one run per size through the collector's real ingest code (payloads built by the
agent's own code, validated by the collector's schema, grouped as the group commit
groups them): three windows of 4 steps per rank, a profiler breakdown on the middle
window of every rank (one rank computing 50% longer) and an open compute-straggler flag
on that rank. Then, for each run alone (an app exporting one run), it scrapes
``/metrics`` through the app's HTTP layer and prints the series the run adds and the
median scrape time, as a ratio of the smallest run's. Budget (issue #16): <= 200 ms at
16,384 ranks and <= 2x the 1,024-rank figure (flat in ranks: the quantiles and the
top-K come from the database, only the selected ranks' rows are read). The series of a
run must not grow with its ranks (bounded cardinality): the exit status says so.

Two kinds of scrape are timed, each against the budgets: of a live run (every rank's
next window stored before each scrape, then the analysis worker's pass, as the
collector's worker makes one every ``analysis_interval_s``: the complete window moves at
most scrapes of a running job, and the scrape reads the census the analysis stored of it,
``exporter/summaries.py``) and of a run that stored nothing since the last scrape (a
stalled run, or scrapes more frequent than windows: the stored census again). The first
is the one a running job costs. The analysis here is always caught up and never shares
the scrape's CPU (its pass comes in between): the steady state. Printed beside them,
without a budget: the live scrape where no stored census stands (the analysis off or
behind), which reads every rank's row of the window; the analysis pass itself, and the
part of it that computes the summaries (where that work went: once per window instead
of once per scrape).

Default database: a fresh PostgreSQL database (production); ``--database-url`` for
another one, e.g. ``sqlite:///tmp/x.db``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, delete, func, insert, select, text, update

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' payload builders and flag writer

from stepwatch_server.app import create_app  # noqa: E402
from stepwatch_server.exporter import summaries  # noqa: E402
from stepwatch_server.exporter.catalog import series_per_run  # noqa: E402
from stepwatch_server.ingest.store import Ingestor  # noqa: E402
from stepwatch_server.reads.status import utc  # noqa: E402
from stepwatch_server.schemas.ingest import IngestPayload  # noqa: E402
from stepwatch_server.settings import Settings  # noqa: E402
from stepwatch_server.storage import migrate  # noqa: E402
from stepwatch_server.storage.backend import open_storage  # noqa: E402
from stepwatch_server.storage.columns import window_of  # noqa: E402
from stepwatch_server.storage.engine import make_engine  # noqa: E402
from stepwatch_server.storage.models import Run, WindowSummary  # noqa: E402
from stepwatch_server.worker.loop import AnalysisWorker, WorkerConfig  # noqa: E402
from tests.payloads import payload  # noqa: E402
from tests.runstate import open_straggler, run_id  # noqa: E402

from ._harness import pg_database  # noqa: E402

WS = WindowSummary.__table__
BUDGET_S = 0.200
BUDGET_RATIO = 2.0
GROUP = 512  # batches per transaction, as a busy collector's group commit forms them


#: Steps first stored per rank, and per window (0.25 s steps at window_seconds=1).
STEPS, WINDOW_STEPS = 12, 4
#: The window with a profiler breakdown.
PROFILED = 1
#: Windows stored between two vacuums of the tables every batch updates in place (a
#: rank's row in ``ranks``, a step's in ``job_steps``): a minute of a job with 10 s
#: windows, as often as autovacuum (``autovacuum_naptime`` 1 min, a fifth of a table
#: dead) gets to them. The benchmark stores a window every half second or so, a
#: minute's windows in 3 s: without it, a rank's row of ``ranks`` gathered tens of dead
#: versions where a job's gathers about 6, and the status count over the ranks read
#: them all (16.3 ms at 16,384 ranks instead of 4.3, median of the benchmark's scrapes).
VACUUM_WINDOWS = 6


def populate(ingestor: Ingestor, run: str, world: int, *, first: int = 1, steps: int = STEPS) -> float:
    """``steps`` steps of 0.25 s from every rank (4-step windows at window_seconds=1)."""
    t0 = time.perf_counter()
    batch = []
    for rank in range(world):
        body = payload(
            run=run,
            rank=rank,
            world=world,
            first=first,
            times=[0.25] * steps,
            tokens=[1000] * steps,
            profiles_through=first + steps - 1,  # an agent with a profiler, every entry sent
        )
        batch.append(IngestPayload.model_validate(body))
        if len(batch) == GROUP or rank == world - 1:
            assert all(ingestor.store_many(batch))
            batch = []
    return time.perf_counter() - t0


def profile(ingestor: Ingestor, run: str, world: int, window: int) -> None:
    """A profiler breakdown on ``window`` of every rank, rank world/2+1 computing 50%
    longer (written as the profile writer's running means leave it), and its flag."""
    slow = world // 2 + 1
    with ingestor.engine.begin() as conn:
        conn.execute(
            text(
                """UPDATE rank_windows SET profiled_steps = 2, skew_steps = 2,
                   compute_s = CASE WHEN rank = :slow THEN 0.15 ELSE 0.10 END,
                   comm_overlapped_s = 0.05, comm_exposed_s = 0.02, idle_s = 0.01,
                   comm_wait_s = CASE WHEN rank = :slow THEN 0.0 ELSE 0.05 END, comm_transfer_s = 0.01
                   WHERE run_id = :run AND "window" = :w"""
            ),
            {"slow": slow, "run": run_id(ingestor.engine, run), "w": window},
        )
    open_straggler(
        ingestor.engine, run, rank=slow, host=f"node{slow // 8}", cost_seconds=0.05, cost_ratio=0.2
    )


@dataclass
class Times:
    """Median seconds of each kind of scrape of one app, and of the analysis passes."""

    kept: float
    live: float
    unanalysed: float
    analysis: float
    text: str
    #: Of the analysis pass, what computing the summaries costs.
    summaries: float = 0.0


def scrape_times(app: object, n: int, advance: Callable[[bool], float]) -> Times:
    """Median seconds of ``n`` scrapes of a run that stores nothing in between, which read
    the complete window's stored census (``exporter/summaries.py``), and
    of ``n`` scrapes of a live one: before each, ``advance(True)`` stores the run's next
    window for every rank and makes the analysis pass that summarises the window before
    it (returning the pass' seconds), as at most scrapes of a running job (10 s windows,
    a 15 s scrape interval, a pass every 5 s); then of ``n`` live scrapes whose windows
    the analysis did not summarise (``advance(False)``). After a first, untimed scrape,
    which sums each run's tokens once."""
    with TestClient(app) as client:  # type: ignore[arg-type]
        client.get("/metrics")
        kept, live, bare, passes = [], [], [], []
        for _ in range(n):
            t0 = time.perf_counter()
            text_ = client.get("/metrics").text
            kept.append(time.perf_counter() - t0)
        for analysed, out in ((True, live), (False, bare)):
            for _ in range(n):
                spent = advance(analysed)
                if analysed:
                    passes.append(spent)
                t0 = time.perf_counter()
                text_ = client.get("/metrics").text
                out.append(time.perf_counter() - t0)
    med = statistics.median
    return Times(med(kept), med(live), med(bare), med(passes), text_)


def series_of(text_: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for fam in text_string_to_metric_families(text_):
        for s in fam.samples:
            key = s.labels.get("run", "")
            counts[key] = counts.get(key, 0) + 1
    return counts


def _make_newest(engine: Engine, run: str) -> None:
    """The run becomes the most recently reporting one (the one an app with
    ``metrics_max_runs=1`` exports)."""
    runs = Run.__table__
    with engine.begin() as conn:
        # Typed reads and writes: SQLite returns the timestamp naive (a string through text()).
        latest = utc(conn.execute(select(func.max(runs.c.last_report_at))).scalar())
        when = max(latest or datetime.now(timezone.utc), datetime.now(timezone.utc)) + timedelta(seconds=1)
        conn.execute(update(runs).where(runs.c.name == run).values(last_report_at=when))


def _vacuum(engine: Engine, *tables: str) -> None:
    """``VACUUM ANALYZE`` of ``tables`` on PostgreSQL (SQLite keeps no dead row versions)."""
    if engine.dialect.name == "postgresql":
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f"VACUUM ANALYZE {', '.join(tables)}"))


def verdict(base: float, largest: float) -> tuple[float, bool]:
    """The largest run's scrape as a ratio of the smallest's, and whether both budgets hold."""
    ratio = largest / base if base > 0 else float("inf")
    return ratio, largest <= BUDGET_S and ratio <= BUDGET_RATIO


@contextlib.contextmanager
def _database(url: str | None) -> Iterator[str]:
    if url is not None:
        migrate.upgrade(url)
        yield url
    else:
        with pg_database() as fresh:
            yield fresh


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1024,4096,16384", help="run sizes, smallest first (the baseline)")
    ap.add_argument("--database-url", default=None)
    ap.add_argument("--scrapes", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    sizes = sorted(int(x) for x in args.ranks.split(","))
    with _database(args.database_url) as url:
        engine = make_engine(url)
        try:
            ingestor = Ingestor(open_storage(engine), window_seconds=1.0)
            stored = {}
            for n in sizes:
                stored[n] = populate(ingestor, f"r{n}", n)
                profile(ingestor, f"r{n}", n, window=PROFILED)
            # Planner statistics and a vacuumed heap, as autovacuum keeps them on a
            # collector's database (and as benchmarks/query.py takes them): tables filled
            # seconds ago have no statistics, and the plans made without (a per-row index
            # scan of 16,384 rows estimated as one) measure the missing statistics, not the
            # reads. The profile writer's update above leaves every profiled row's old
            # version dead (more than autovacuum's threshold of a fifth of the table): the
            # census of that window then read twice the index entries and three times the
            # heap pages (1,238 instead of ~400 at 16,384 ranks), measuring the missed
            # vacuum, not the reads.
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.execute(text("VACUUM ANALYZE" if engine.dialect.name == "postgresql" else "ANALYZE"))
            settings = Settings(database_url=url)
            bound = series_per_run(settings.metrics_top_k, settings.metrics_max_flagged)
            series: dict[int, int] = {}
            # Interleaved rounds (smallest first, then the others), the median of each
            # size's round medians: the first app also warms the engine's statement cache.
            times: dict[int, list[Times]] = {n: [] for n in sizes}
            after = dict.fromkeys(sizes, STEPS)  # the last step each run has stored
            # The collector's analysis worker, made to pass by the benchmark (the app's own
            # is off): in between, so that it never shares the scrape's CPU.
            storage = open_storage(engine)
            worker = AnalysisWorker(storage, WorkerConfig(summary_top=settings.metrics_top_k))
            worker.run_once()  # the windows stored so far, untimed

            def advance(n: int, analysed: bool) -> float:
                populate(ingestor, f"r{n}", n, first=after[n] + 1, steps=WINDOW_STEPS)
                after[n] += WINDOW_STEPS
                if after[n] // WINDOW_STEPS % VACUUM_WINDOWS == 0:
                    _vacuum(engine, "ranks", "job_steps")
                rid = run_id(engine, f"r{n}")
                if not analysed:  # the analysis runs on, but this run keeps none of its summaries
                    worker.run_once()
                    with engine.begin() as conn:
                        conn.execute(delete(WindowSummary).where(WindowSummary.run_id == rid))
                    return 0.0
                t0 = time.perf_counter()
                worker.run_once()
                spent = time.perf_counter() - t0
                complete = window_of(after[n], WINDOW_STEPS) - 1
                with engine.connect() as conn:  # what the scrape is to read: the complete window's
                    at = dict(conn.execute(select(WS.c.kind, WS.c.window).where(WS.c.run_id == rid)).all())
                    if at != {"census": complete, "profiled": PROFILED}:
                        raise SystemExit(
                            f"the analysis stored the summaries of windows {at}, not those in view"
                        )
                    # Of the pass, what the summaries cost (computed again, the same queries).
                    t0 = time.perf_counter()
                    summaries.census_of(conn, rid, complete, WINDOW_STEPS, settings.metrics_top_k)
                    summaries.profiled_of(conn, rid, PROFILED, WINDOW_STEPS, settings.metrics_top_k)
                    summarising.append(time.perf_counter() - t0)
                return spent

            for _ in range(args.rounds):
                for n in sizes:
                    _make_newest(engine, f"r{n}")
                    only = Settings(database_url=url, metrics_max_runs=1, analysis_enabled=False)
                    app = create_app(only, engine=engine)
                    with engine.connect() as conn:
                        kept = conn.execute(select(WS).where(WS.c.run_id == run_id(engine, f"r{n}"))).all()
                    summarising: list[float] = []
                    t = scrape_times(app, args.scrapes, lambda a, n=n: advance(n, a))
                    t.summaries = statistics.median(summarising)
                    with engine.begin() as conn:  # what the analysis would have stored, back
                        conn.execute(insert(WS), [r._asdict() for r in kept if r.kind == "profiled"])
                        rid = run_id(engine, f"r{n}")
                        census = summaries.census_of(
                            conn,
                            rid,
                            window_of(after[n], WINDOW_STEPS) - 1,
                            WINDOW_STEPS,
                            settings.metrics_top_k,
                        )
                        summaries.store(conn, storage.insert, rid, [census] if census else [])
                    times[n].append(t)
                    series[n] = series_of(t.text).get(f"r{n}", 0)

            def med(n: int, field: str) -> float:
                return statistics.median(getattr(t, field) for t in times[n])

            scrape = {n: med(n, "kept") for n in sizes}
            live = {n: med(n, "live") for n in sizes}
            bare = {n: med(n, "unanalysed") for n in sizes}
            passes = {n: med(n, "analysis") for n in sizes}
            summarised = {n: med(n, "summaries") for n in sizes}
        finally:
            engine.dispose()
    base, largest = sizes[0], sizes[-1]
    backend = url.split(":")[0]
    print(f"metrics_scrape: database {backend}; one run exported per app, {args.scrapes} scrapes each")
    print(f"  budget: <= {BUDGET_S * 1e3:.0f} ms at {largest:,} and <= {BUDGET_RATIO:.0f}x {base:,} ranks")
    for n in sizes:
        print(
            f"  {n:6,} ranks: stored in {stored[n]:4.1f} s, {series[n]} series (bound {bound}); scrape "
            f"live {live[n] * 1e3:5.1f} ms ({live[n] / live[base]:4.2f}x), "
            f"census kept {scrape[n] * 1e3:5.1f} ms ({scrape[n] / scrape[base]:4.2f}x)\n"
            f"{'':16}live without a stored census {bare[n] * 1e3:5.1f} ms ({bare[n] / bare[base]:4.2f}x); "
            f"the analysis pass that stores it {passes[n] * 1e3:5.0f} ms per window, "
            f"the summaries in it {summarised[n] * 1e3:4.1f} ms"
        )
    ratio, met = verdict(live[base], live[largest])
    mark = "met" if met else "MISSED"
    print(
        f"  live run (a window stored and analysed before each scrape), {largest:,} vs {base:,} ranks: "
        f"{ratio:.2f}x, {live[largest] * 1e3:.1f} ms: {mark}"
    )
    ratio, met = verdict(scrape[base], scrape[largest])
    mark = "met" if met else "MISSED"
    print(
        f"  census kept (no step stored between scrapes), {largest:,} vs {base:,} ranks: "
        f"{ratio:.2f}x, {scrape[largest] * 1e3:.1f} ms: {mark}"
    )
    return 0 if all(series[n] <= bound for n in sizes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
