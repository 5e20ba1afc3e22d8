"""Retention: old per-rank windows are rolled up without changing what they summarise,
recent ones are kept, old batch ids are forgotten; pruning twice changes nothing."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, delete, func, insert, select, update

from stepwatch_server.app import create_app
from stepwatch_server.settings import Settings
from stepwatch_server.storage.backend import open_storage
from stepwatch_server.storage.models import IngestedBatch, JobStep, RankWindow, Run, WindowSummary
from stepwatch_server.storage.retention import prune

from ..payloads import payload

DAY = 86400.0
FACTOR = 8


def _per_rank(engine: Engine) -> list[tuple[Any, ...]]:
    rw = RankWindow
    with engine.connect() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                select(
                    rw.rank,
                    func.sum(rw.n_steps),
                    func.sum(rw.tokens_sum),
                    func.sum(rw.step_time_sum),
                    func.min(rw.step_time_min),
                    func.max(rw.step_time_max),
                    func.min(rw.first_step),
                    func.max(rw.last_step),
                )
                .group_by(rw.rank)
                .order_by(rw.rank)
            )
        ]


def _rows(engine: Engine) -> list[tuple[int, int, int, int, int]]:
    rw = RankWindow
    with engine.connect() as conn:
        q = select(rw.rank, rw.window, rw.first_step, rw.last_step, rw.n_steps).order_by(rw.rank, rw.window)
        return [(a, b, c, d, e) for a, b, c, d, e in conn.execute(q)]


def test_prune_rolls_up_old_windows_and_keeps_their_sums(db_url: str, engine: Engine) -> None:
    now = time.time()
    # 0.5 s steps with 0.5 s windows: one window per step, as 10 s steps give in production.
    app = create_app(Settings(database_url=db_url, window_seconds=0.5), engine=engine)
    with TestClient(app) as c:
        for rank in range(2):
            times = [0.5 + 0.01 * (i % 5) for i in range(40)]
            old = payload(rank=rank, world=2, first=1, times=times, tokens=[100 + i for i in range(40)])
            old["steps"]["wall_end"] = now - 10 * DAY
            recent = payload(rank=rank, world=2, first=41, times=[0.5] * 10, tokens=[7] * 10)
            recent["steps"]["wall_end"] = now
            for p in (old, recent):
                assert c.post("/api/v1/ingest", json=p).status_code == 200
        overview_before = c.get("/api/v1/runs/test-run").json()
        ranks_before = c.get("/api/v1/runs/test-run/ranks").json()
    sums_before = _per_rank(engine)
    with engine.begin() as conn:  # what the analysis stored of an old window and a recent one
        rid = conn.execute(select(Run.id)).scalar_one()
        conn.execute(delete(WindowSummary))
        for kind, window in (("census", 3), ("profiled", 45)):
            conn.execute(
                insert(WindowSummary).values(
                    run_id=rid, kind=kind, window=window, steps=1, rank_steps=2, summary={}
                )
            )
    with engine.begin() as conn:  # the first rank's batches were received long ago
        conn.execute(
            update(IngestedBatch)
            .where(IngestedBatch.rank == 0)
            .values(received_at=datetime.now(timezone.utc) - timedelta(days=30))
        )

    report = prune(open_storage(engine), full_days=2, factor=FACTOR, batch_id_days=7, now=now)

    rows = _rows(engine)
    # Steps 1..40 are old: windows 0..39, rolled up in whole groups of 8 (0-7, ..., 32-39).
    assert (report.windows_rolled_up, report.rows_written, report.batch_ids_deleted) == (80, 10, 2)
    for rank in range(2):
        mine = [r[1:] for r in rows if r[0] == rank]
        assert mine[:5] == [(w, w + 1, w + FACTOR, FACTOR) for w in range(0, 40, FACTOR)]
        assert mine[5:] == [(w, w + 1, w + 1, 1) for w in range(40, 50)]  # recent: full resolution
    after = _per_rank(engine)
    for b, a in zip(sums_before, after, strict=True):
        assert a[:3] == b[:3] and a[4:] == b[4:] and a[3] == pytest.approx(b[3], rel=1e-12)
    with TestClient(app) as c:
        assert c.get("/api/v1/runs/test-run").json() == overview_before  # job steps untouched
        assert c.get("/api/v1/runs/test-run/ranks").json() == ranks_before
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(IngestedBatch)).scalar_one() == 2
        # The rolled-up window's summary no longer matches its rows: gone; the recent one stays.
        kept = conn.execute(select(WindowSummary.kind, WindowSummary.window)).all()
        assert [tuple(k) for k in kept] == [("profiled", 45)]
        assert conn.execute(select(func.count()).select_from(JobStep)).scalar_one() == 50

    again = prune(open_storage(engine), full_days=2, factor=FACTOR, batch_id_days=7, now=now)
    assert (again.windows_rolled_up, again.batch_ids_deleted) == (0, 0)
    assert _rows(engine) == rows


def test_prune_command(tmp_path: Any) -> None:
    url = f"sqlite:///{tmp_path / 'p.db'}"
    subprocess.run([sys.executable, "-m", "stepwatch", "db", "upgrade", "--database-url", url], check=True)
    r = subprocess.run(
        [sys.executable, "-m", "stepwatch", "db", "prune", "--database-url", url, "--full-days", "1"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "0 run(s): 0 rank windows older than 1 days rolled up" in r.stdout
