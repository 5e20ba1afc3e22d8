"""Retention and downsampling: ``stepwatch db prune``.

Per-rank windows are the bulk of the storage (one row per rank per ~10 s: at 4,096 ranks
about 35 million rows a day, ~200 bytes each with the primary key). The policy:

- ``job_steps`` (one row per step for the whole job) is kept: 259,200 rows for a month
  of 10 s steps, tens of megabytes; every job-level series stays exact.
- ``rank_windows`` older than ``full_days`` are rolled up: ``factor`` consecutive windows
  of a rank become one row (360 windows of 10 s = one hour). Every column rolls up by
  its merge rule (``columns.py``: counts and sums add, minima and maxima stay extreme,
  breakdown means are weighted by their step counts), so a rolled-up row is exactly the
  summary of the steps it covers, and rows stay aligned across ranks (``window`` is the
  first window index of the group).
  The per-group transfer times (``group_transfer_s``) are not kept for rolled-up rows:
  the analysis has long finished with windows that old.
- ``ingested_batches`` (batch ids kept for idempotent retries) older than
  ``batch_id_days`` are deleted: an agent retries within minutes, never after days.
- ``capture_traces`` (a capture's raw trace, up to ``STEPWATCH_CAPTURE_MAX_BYTES`` each)
  older than ``trace_days`` are deleted; the capture and its explanation stay.

Run it daily (cron, a Kubernetes CronJob). Each run's windows are rolled up in chunks,
each chunk in one transaction, so a prune can be stopped and run again at any time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import Connection, delete, func, select, text

from . import columns
from .backend import Storage
from .columns import RANK_WINDOWS, Rule, SqlFunctions, window_of
from .models import CaptureTrace, IngestedBatch, JobStep

JS = JobStep.__table__
IB = IngestedBatch.__table__
CT = CaptureTrace.__table__

#: A window that spans at most ``window_steps`` steps has not been rolled up yet.
_UNROLLED = 'run_id = :run AND "window" >= :lo AND "window" < :hi AND last_step - first_step < :ws'


@dataclass
class PruneReport:
    runs: int = 0
    windows_rolled_up: int = 0
    rows_written: int = 0
    batch_ids_deleted: int = 0
    traces_deleted: int = 0


def prune(
    storage: Storage,
    *,
    full_days: float = 2.0,
    factor: int = 360,
    batch_id_days: float = 7.0,
    trace_days: float = 7.0,
    now: float | None = None,
    chunk_rows: int = 1_000_000,
) -> PruneReport:
    """Apply the retention policy to every run; returns what it did."""
    if factor < 2:
        raise ValueError(f"factor must be at least 2, got {factor}")
    now = time.time() if now is None else now
    engine = storage.engine
    report = PruneReport()
    with engine.connect() as conn:
        runs = conn.execute(text("SELECT id, window_steps, world_size FROM runs ORDER BY id")).all()
    for run_id, ws, world in runs:
        report.runs += 1
        with engine.begin() as conn:
            cut = _cut_window(conn, run_id, ws, factor, now - full_days * 86400)
        span = max(factor, (chunk_rows // max(1, world)) // factor * factor)
        lo = 0
        while lo < cut:
            hi = min(cut, lo + span)
            with engine.begin() as conn:
                rolled, written = _roll_up(conn, storage.functions, run_id, ws, factor, lo, hi)
            report.windows_rolled_up += rolled
            report.rows_written += written
            lo = hi
        old = datetime.fromtimestamp(now - batch_id_days * 86400, timezone.utc)
        with engine.begin() as conn:
            report.batch_ids_deleted += conn.execute(
                delete(IngestedBatch).where(IB.c.run_id == run_id, IB.c.received_at < old)
            ).rowcount
    # Captures' raw traces (up to a few MB each) go after ``trace_days``; their
    # explanations stay with the capture.
    with engine.begin() as conn:
        report.traces_deleted = conn.execute(
            delete(CaptureTrace).where(
                CT.c.created_at < datetime.fromtimestamp(now - trace_days * 86400, timezone.utc)
            )
        ).rowcount
    return report


def _cut_window(conn: Connection, run_id: int, ws: int, factor: int, cutoff: float) -> int:
    """First window index (aligned down to ``factor``) that must stay at full resolution."""
    last_old = conn.execute(
        select(func.max(JS.c.step)).where(JS.c.run_id == run_id, JS.c.wall_end < cutoff)
    ).scalar_one()
    if last_old is None:
        return 0
    return (window_of(int(last_old), ws) + 1) // factor * factor


def _roll_up(
    conn: Connection, fn: SqlFunctions, run_id: int, ws: int, factor: int, lo: int, hi: int
) -> tuple[int, int]:
    params = {"run": run_id, "ws": ws, "lo": lo, "hi": hi, "f": factor}
    rw = RANK_WINDOWS
    names = [c.name for c in rw.columns if c.rolled_up and c.rule is not Rule.KEY]
    cols = ", ".join(columns.quote(n) for n in (*rw.keys, *names))
    aggregates = ", ".join(f"{columns.aggregate_sql(rw, n)} AS {columns.quote(n)}" for n in names)
    conn.execute(text("DROP TABLE IF EXISTS sw_rollup"))
    conn.execute(
        text(
            f"""CREATE TEMPORARY TABLE sw_rollup AS
            SELECT run_id, rank, ("window" / :f) * :f AS "window", {aggregates}
            FROM rank_windows WHERE {_UNROLLED}
            GROUP BY run_id, rank, "window" / :f"""
        ),
        params,
    )
    rolled = conn.execute(text(f"DELETE FROM rank_windows WHERE {_UNROLLED}"), params).rowcount
    # What the analysis summarised of these windows no longer matches their rows.
    conn.execute(
        text('DELETE FROM window_summaries WHERE run_id = :run AND "window" >= :lo AND "window" < :hi'),
        params,
    )
    # A rolled-up row already there (windows that arrived after an earlier prune) merges
    # with the new one by the same rules as ingest.
    written = conn.execute(
        text(
            f"""INSERT INTO rank_windows ({cols}) SELECT {cols} FROM sw_rollup WHERE true
            ON CONFLICT (run_id, rank, "window") DO UPDATE SET
            {columns.set_clause(rw, names, "rank_windows", "excluded", fn)}"""
        )
    ).rowcount
    conn.execute(text("DROP TABLE sw_rollup"))
    return int(rolled), int(written)
