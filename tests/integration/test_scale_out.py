"""Two collector processes on one PostgreSQL store the same rows as one collector.

The same batches go once to a single collector and once, interleaved and concurrently,
to two collectors sharing a database (what N replicas behind a load balancer do). The
stored runs, ranks, rank windows and job steps must agree: integers exactly, float sums
to rounding (additions in another order).
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, select

from stepwatch_server.storage import migrate
from stepwatch_server.storage.engine import make_engine
from stepwatch_server.storage.models import JobStep, Rank, RankWindow, Run

from .. import pg
from ..live import collector_process
from ..payloads import payload

RANKS, WINDOWS, STEPS = 16, 10, 8


def _batches() -> list[dict[str, Any]]:
    rng = random.Random(7)
    out = []
    for w in range(WINDOWS):
        for r in range(RANKS):
            n = STEPS
            out.append(
                payload(
                    run="scale-out",
                    rank=r,
                    world=RANKS,
                    first=w * n + 1,
                    times=[0.5 * (1 + 0.05 * rng.random()) for _ in range(n)],
                    waits=[0.01 * rng.random() for _ in range(n)],
                    tokens=[rng.randint(500, 1000) for _ in range(n)],
                    padded=[1024] * n,
                    tags=["warmup"] * n if w == 0 else None,
                )
            )
    return out


def _snapshot(engine: Engine) -> dict[str, list[tuple[Any, ...]]]:
    with engine.connect() as conn:
        return {
            "runs": [
                tuple(r)
                for r in conn.execute(select(Run.name, Run.world_size, Run.dp_size, Run.window_steps))
            ],
            "ranks": [
                tuple(r)
                for r in conn.execute(
                    select(Rank.rank, Rank.host, Rank.last_step, Rank.dropped_windows).order_by(Rank.rank)
                )
            ],
            "windows": [
                tuple(r)
                for r in conn.execute(
                    select(
                        RankWindow.rank,
                        RankWindow.window,
                        RankWindow.first_step,
                        RankWindow.last_step,
                        RankWindow.n_steps,
                        RankWindow.tokens_sum,
                        RankWindow.padded_tokens_sum,
                        RankWindow.step_time_sum,
                        RankWindow.step_time_min,
                        RankWindow.step_time_max,
                        RankWindow.data_wait_sum,
                    ).order_by(RankWindow.rank, RankWindow.window)
                )
            ],
            "job_steps": [
                tuple(r)
                for r in conn.execute(
                    select(
                        JobStep.step,
                        JobStep.ranks,
                        JobStep.token_ranks,
                        JobStep.tokens,
                        JobStep.padded_tokens,
                        JobStep.tag,
                        JobStep.step_time_sum,
                        JobStep.step_time_max,
                        JobStep.data_wait_max,
                    ).order_by(JobStep.step)
                )
            ],
        }


def _same(a: dict[str, list[tuple[Any, ...]]], b: dict[str, list[tuple[Any, ...]]]) -> None:
    for table in a:
        assert len(a[table]) == len(b[table]) > 0, table
        for x, y in zip(a[table], b[table], strict=True):
            exact = [v for v in x if not isinstance(v, float)], [v for v in y if not isinstance(v, float)]
            assert exact[0] == exact[1], (table, x, y)
            floats = [v for v in x if isinstance(v, float)], [v for v in y if isinstance(v, float)]
            assert floats[0] == pytest.approx(floats[1], rel=1e-12), (table, x, y)


def test_two_collectors_store_what_one_stores(pg_admin: str, tmp_path: Path) -> None:
    batches = _batches()
    with pg.fresh_database(pg_admin) as one_url, pg.fresh_database(pg_admin) as two_url:
        migrate.upgrade(one_url)
        migrate.upgrade(two_url)
        with collector_process(one_url, str(tmp_path / "one.log")) as one:
            with httpx.Client(base_url=one.url, timeout=30) as c, ThreadPoolExecutor(8) as pool:
                codes = pool.map(lambda p: c.post("/api/v1/ingest", json=p).status_code, batches)
                assert set(codes) == {200}
            overview_one = httpx.get(f"{one.url}/api/v1/runs/scale-out", timeout=10).json()

        with (
            collector_process(two_url, str(tmp_path / "a.log")) as a,
            collector_process(two_url, str(tmp_path / "b.log")) as b,
            httpx.Client(timeout=30) as c,
        ):
            urls = [a.url, b.url]

            def post(i: int) -> int:
                return c.post(f"{urls[i % 2]}/api/v1/ingest", json=batches[i]).status_code

            with ThreadPoolExecutor(8) as pool:  # concurrent writers of the same job steps
                assert set(pool.map(post, range(len(batches)))) == {200}
            overview_two = httpx.get(f"{b.url}/api/v1/runs/scale-out", timeout=10).json()

        engines = [make_engine(one_url), make_engine(two_url)]
        try:
            _same(_snapshot(engines[0]), _snapshot(engines[1]))
        finally:
            for e in engines:
                e.dispose()
    for key in ("steps_stored", "tokens_total", "first_step", "last_step", "ranks_reporting"):
        assert overview_one[key] == overview_two[key], key
    assert overview_one["mfu"]["mean"] == pytest.approx(overview_two["mfu"]["mean"], rel=1e-12)
