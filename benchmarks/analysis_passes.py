"""The analysis worker's pass over runs that sent nothing since its last pass, against
the same pass once each run's rank rows moved, measured alternately in the same run.

    python -m benchmarks.analysis_passes [--ranks 4096] [--runs 4] [--passes 5]

Every pass (each ``STEPWATCH_ANALYSIS_INTERVAL_S``, 5 s) needs every rank of every run
active within the horizon (a week): readiness, hangs, captures. Most passes find a run's
ranks as they were (between its windows, after it ended, for the rest of the horizon),
and the worker reads them again only when their fingerprint moved
(``worker/inputs.py``: ``RankReads``). The runs here: ``--runs`` runs of ``--ranks`` ranks,
two 64-step windows each stored by the collector's ingest code (payloads built by the
agent's code, ``loadgen``) into a fresh PostgreSQL database, analysed by a first pass.
Then, ``--passes`` times: a pass with nothing new (idle), and a pass after one rank of
each run moved its ``last_seen`` (what a heartbeat changes), which reads every rank row
again (what every pass cost before the fingerprint). CPU of this process (the worker's
Python) and of the PostgreSQL server, per run and pass, medians.

Then the pass that analyses new windows, the worker's main work: ``--window-runs`` runs of
``--ranks`` ranks, three 64-step windows each with the comm section a DDP rank sends by
default (staged per-step timing and link samples), stored in this process by the
collector's ingest code (its CPU and PostgreSQL's measured: the storage side of ingest,
without HTTP or validation), then one pass, which analyses the two complete windows of
each run. Both as CPU per rank-window, over ``--window-rounds`` rounds (medians), and
their ratio: how much of a core the worker needs per core of storage. Informational, no
budget.

Budget: an idle run's pass costs <= 0.5x the pass that reads its rank rows: reading the
rows on every pass, as before, gives 1x. What an idle pass still pays is the fingerprint
(one aggregate over the run's ranks in the database), the run's other reads, and the
readiness and hang checks' walk over its ranks in Python (about 15 ms at 4,096 ranks).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from datetime import timedelta

import psycopg
from sqlalchemy import Engine, update

from stepwatch_server.ingest.store import Ingestor
from stepwatch_server.schemas.ingest import IngestPayload
from stepwatch_server.storage.backend import open_storage
from stepwatch_server.storage.engine import make_engine
from stepwatch_server.storage.models import Rank
from stepwatch_server.worker import AnalysisWorker, WorkerConfig

from . import loadgen
from ._cpu import Meter, postgres_server_pid
from ._harness import median, pg_database

BUDGET = 0.5
RANKS = Rank.__table__


def within_budget(idle_s: float, moved_s: float) -> bool:
    """An idle run's pass costs at most :data:`BUDGET` of the pass that reads its rows."""
    return idle_s <= BUDGET * moved_s


def _fill(engine: Engine, runs: int, ranks: int) -> None:
    ingestor = Ingestor(open_storage(engine))
    for i in range(runs):
        fleet = loadgen.Fleet(f"bench-idle-{i}", ranks, 64, seed=i)
        batches = [IngestPayload.model_validate_json(b) for b in fleet.payloads(2)]
        for start in range(0, len(batches), 512):
            ingestor.store_many(batches[start : start + 512])


def _store_windows(
    engine: Engine, name: str, ranks: int, postgres_pid: int | None
) -> tuple[float, float | None]:
    """Three windows of a run with the comm section, stored in groups of 512 batches: the
    CPU of this process and of PostgreSQL while storing them (validated beforehand)."""
    ingestor = Ingestor(open_storage(engine))
    fleet = loadgen.Fleet(name, ranks, 64, seed=7, comm=True)
    batches = [IngestPayload.model_validate_json(b) for b in fleet.payloads(3)]
    meter = Meter(None, postgres_pid)
    meter.start()
    for start in range(0, len(batches), 512):
        ingestor.store_many(batches[start : start + 512])
    _, postgres, own = meter.stop()
    return own, postgres


def _pass(worker: AnalysisWorker, postgres_pid: int | None) -> tuple[float, float | None]:
    """CPU seconds of one pass: this process's (the worker's Python), PostgreSQL's."""
    meter = Meter(None, postgres_pid)
    meter.start()
    worker.run_once()
    _, postgres, own = meter.stop()
    return own, postgres


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--window-runs", type=int, default=2)
    p.add_argument("--window-rounds", type=int, default=3)
    args = p.parse_args(argv)
    with pg_database("stepwatch_bench_passes") as url:
        engine = make_engine(url)
        with psycopg.connect(url.replace("+psycopg", "")) as conn:
            postgres_pid = postgres_server_pid(conn)
        try:
            t0 = time.perf_counter()
            _fill(engine, args.runs, args.ranks)
            filled_s = time.perf_counter() - t0
            worker = AnalysisWorker(open_storage(engine), WorkerConfig())
            worker.run_once()  # the windows analysed: what follows is the passes' own cost
            idle: list[tuple[float, float | None]] = []
            moved: list[tuple[float, float | None]] = []
            for _ in range(args.passes):
                idle.append(_pass(worker, postgres_pid))
                with engine.begin() as c:  # one rank of each run seen a millisecond later
                    c.execute(
                        update(RANKS)
                        .where(RANKS.c.rank == 0)
                        .values(last_seen=RANKS.c.last_seen + timedelta(milliseconds=1))
                    )
                moved.append(_pass(worker, postgres_pid))
            stored: list[tuple[float, float | None]] = []
            analysed: list[tuple[float, float | None]] = []
            for r in range(args.window_rounds):
                fills = [
                    _store_windows(engine, f"bench-windows-{r}-{i}", args.ranks, postgres_pid)
                    for i in range(args.window_runs)
                ]
                stored.append((sum(f[0] for f in fills), _sum_known([f[1] for f in fills])))
                analysed.append(_pass(worker, postgres_pid))
        finally:
            engine.dispose()

    def per_run_ms(rows: list[tuple[float, float | None]], i: int) -> float | None:
        values = [r[i] for r in rows]
        known = [v for v in values if v is not None]
        return median(known) / args.runs * 1e3 if len(known) == len(values) else None

    print(
        f"analysis passes: {args.runs} runs of {args.ranks} ranks (two 64-step windows each, "
        f"stored in {filled_s:.0f} s), {args.passes} passes of each kind; CPU per run and pass"
    )
    totals = {}
    for label, rows in (("idle (nothing new)", idle), ("one rank moved (rows read)", moved)):
        own, pg = per_run_ms(rows, 0), per_run_ms(rows, 1)
        assert own is not None
        totals[label] = own + (pg or 0.0)
        pg_text = f"{pg:8.2f} ms" if pg is not None else "       -"
        print(f"  {label:<28} worker {own:8.2f} ms   PostgreSQL {pg_text}")
    idle_ms, moved_ms = totals["idle (nothing new)"], totals["one rank moved (rows read)"]
    ok = within_budget(idle_ms, moved_ms)
    print(
        f"  ratio idle / rows read       {idle_ms / moved_ms:9.3f}"
        f"   budget: idle <= {BUDGET}x the read {'met' if ok else 'MISSED'}"
    )
    rank_windows = args.window_runs * args.ranks
    us = {
        label: _per_rank_window_us(rows, rank_windows * n)
        for label, rows, n in (("stored", stored, 3), ("analysed", analysed, 2))
    }
    print(
        f"  new windows with the comm section ({args.window_runs} runs x {args.ranks} ranks, "
        f"{args.window_rounds} rounds), CPU per rank-window:"
    )
    for label, text_ in (
        ("stored", "storing them (ingest's storage side)"),
        ("analysed", "the pass analysing them"),
    ):
        own, pg = us[label]
        print(f"    {text_:<38} this process {own:8.1f} us   PostgreSQL {_cell(pg)}")
    ratio = (us["analysed"][0] + (us["analysed"][1] or 0.0)) / (us["stored"][0] + (us["stored"][1] or 0.0))
    print(f"  ratio analysis / storage     {ratio:9.2f}   (both sides' CPU; informational)")
    return 0


def _sum_known(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def _per_rank_window_us(rows: list[tuple[float, float | None]], n: int) -> tuple[float, float | None]:
    """The median round's CPU (this process, PostgreSQL) per rank-window, microseconds."""
    pgs = [r[1] for r in rows]
    pg = None if any(v is None for v in pgs) else median([v for v in pgs if v is not None]) / n * 1e6
    return median([r[0] for r in rows]) / n * 1e6, pg


def _cell(value: float | None) -> str:
    return f"{value:8.1f} us" if value is not None else "       -"


if __name__ == "__main__":
    raise SystemExit(main())
