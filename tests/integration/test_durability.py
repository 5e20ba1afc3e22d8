"""Durability: an acknowledged batch is stored, once, whatever happens after the 2xx.

- The collector process is SIGKILLed in the middle of a load, restarted on the same
  port, and the unacknowledged batches are sent again (as agents do): every acknowledged
  batch is found, and every batch is counted exactly once in the additive rows.
- The PostgreSQL server (a private cluster, never the machine's shared one) crashes
  (``pg_ctl stop -m immediate``) mid-run: the collector answers 503 with Retry-After, the
  agent keeps its windows, and after the restart everything arrives exactly once.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from sqlalchemy import Engine, func, select, text

import stepwatch
from stepwatch._env import detect
from stepwatch._sender import Sender
from stepwatch.config import AgentConfig
from stepwatch.demo.launch import free_port
from stepwatch_server.storage import migrate
from stepwatch_server.storage.engine import make_engine
from stepwatch_server.storage.models import IngestedBatch, JobStep, Rank, RankWindow

from .. import pg
from ..live import CollectorProcess, serve_in_thread
from ..payloads import payload
from ..wait import wait_until

RANKS, WINDOWS, STEPS = 32, 12, 8


def _batches() -> list[dict[str, Any]]:
    # Window-major, as a job produces them; each batch covers its own (rank, steps).
    return [
        payload(run="kill-test", rank=r, world=RANKS, first=w * STEPS + 1, times=[0.25] * STEPS)
        for w in range(WINDOWS)
        for r in range(RANKS)
    ]


def _assert_each_batch_once(engine: Engine, n_batches: int) -> None:
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(IngestedBatch)).scalar_one() == n_batches
        # Additive rows: a batch merged twice would push these sums past the totals.
        assert conn.execute(select(func.sum(JobStep.ranks))).scalar_one() == n_batches * STEPS
        assert conn.execute(select(func.sum(RankWindow.n_steps))).scalar_one() == n_batches * STEPS
        assert conn.execute(select(func.count()).select_from(JobStep)).scalar_one() == WINDOWS * STEPS
        last = conn.execute(select(func.min(Rank.last_step), func.max(Rank.last_step))).one()
        assert tuple(last) == (WINDOWS * STEPS, WINDOWS * STEPS)


def test_sigkill_mid_load_loses_no_acknowledged_batch(db_url: str, engine: Engine, tmp_path: Path) -> None:
    batches = _batches()
    acked: dict[str, bool] = {}  # batch id -> stored (True) or already there (False)
    lock = threading.Lock()
    collector = CollectorProcess(db_url, str(tmp_path / "collector.log"))
    collector.start()
    try:
        with httpx.Client(base_url=collector.url, timeout=10) as client:

            def post(p: dict[str, Any]) -> None:
                try:
                    r = client.post("/api/v1/ingest", json=p)
                except httpx.HTTPError:
                    return  # not acknowledged: the sender would retry it
                if r.is_success:
                    with lock:
                        acked[p["batch_id"]] = r.json()["stored"]

            with ThreadPoolExecutor(8) as pool:
                for p in batches:
                    pool.submit(post, p)
                wait_until(
                    lambda: len(acked) >= len(batches) // 3,
                    "the load to start",
                    timeout_s=60,
                    every_s=0.005,
                )
                collector.kill()  # mid-load: requests are in flight and in transactions
        before_kill = dict(acked)
        assert 0 < len(before_kill) < len(batches)

        collector.start()  # same port, as the agents expect
        with httpx.Client(base_url=collector.url, timeout=10) as client:
            resent = [
                client.post("/api/v1/ingest", json=p) for p in batches if p["batch_id"] not in before_kill
            ]
    finally:
        collector.stop()
    assert all(r.status_code == 200 for r in resent)
    with engine.connect() as conn:
        stored_ids = set(conn.execute(select(IngestedBatch.batch_id)).scalars())
    assert set(before_kill) <= stored_ids, "an acknowledged batch was lost"
    _assert_each_batch_once(engine, len(batches))


def _agent(url: str) -> stepwatch.Stepwatch:
    cfg = AgentConfig(run="pg-restart", url=url, max_window_steps=10, send_interval_s=1e9, warmup_steps=0)
    holder: dict[str, stepwatch.Stepwatch] = {}
    sender = Sender(
        url, lambda w, s: holder["sw"]._encode(w, s), backoff_base_s=0.05, backoff_max_s=0.2, poll_s=0.05
    )
    holder["sw"] = stepwatch.Stepwatch(cfg, detect({}, host="h"), convention=None, sender=sender)
    return holder["sw"]


def test_postgres_crash_and_restart_mid_run(tmp_path: Path) -> None:
    with pg.cluster(free_port()) as cluster:
        with psycopg.connect(cluster.url, autocommit=True) as conn:
            conn.execute("CREATE DATABASE stepwatch")
        db_url = cluster.url.rsplit("/", 1)[0] + "/stepwatch"
        migrate.upgrade(db_url)
        engine = make_engine(db_url)
        try:
            with serve_in_thread(db_url, retry_after_s=1) as url:
                sw = _agent(url)
                for _ in range(30):
                    sw.step(tokens=100)
                assert sw.flush(timeout_s=20)

                cluster.stop("immediate")  # a crash: recovery from the WAL at the next start
                r = httpx.post(f"{url}/api/v1/ingest", json=payload(run="pg-restart"), timeout=10)
                assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
                assert "database unavailable" in r.json()["detail"]
                ready = httpx.get(f"{url}/readyz", timeout=10)
                assert ready.status_code == 503 and ready.headers["retry-after"] == "1"
                for _ in range(50):
                    sw.step(tokens=100)
                assert not sw.flush(timeout_s=1.0)  # buffered, not lost, not rejected
                stats = sw.stats
                assert stats["failed_attempts"] >= 1 and stats["pending_windows"] >= 1
                assert (stats["rejected_batches"], stats["dropped_windows"]) == (0, 0)

                cluster.start()
                assert sw.flush(timeout_s=30)
                ov = httpx.get(f"{url}/api/v1/runs/pg-restart", timeout=10).json()
                sw.close()
            assert sw.stats["sent_steps"] == 80 and ov["steps_stored"] == 80
            with engine.connect() as conn:
                assert conn.execute(select(func.sum(JobStep.ranks))).scalar_one() == 80  # each step once
                # 8 windows of 10 steps, and the final batch close() sends (no step).
                assert conn.execute(select(func.count()).select_from(IngestedBatch)).scalar_one() == 9
        finally:
            engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite"])
def test_sqlite_commits_are_durable_before_the_answer(tmp_path: Path, backend: str) -> None:
    engine = make_engine(f"{backend}:///{tmp_path / 'd.db'}")
    with engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar_one() == "wal"
        assert conn.execute(text("PRAGMA synchronous")).scalar_one() == 2  # FULL: fsync at each commit
    engine.dispose()
