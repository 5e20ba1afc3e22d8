"""Job-step buckets (``storage/rollups.py``): the series and overview read from them give
what the raw steps give, on both backends, and concurrent writers of one bucket on
PostgreSQL cannot lose each other's steps."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, select, text

from stepwatch_server.app import create_app
from stepwatch_server.ingest import fold
from stepwatch_server.ingest.store import Ingestor
from stepwatch_server.schemas.ingest import IngestPayload
from stepwatch_server.settings import Settings
from stepwatch_server.storage.backend import open_storage
from stepwatch_server.storage.models import JobStep, JobStepBucket, Run

from ..payloads import payload
from ..wait import wait_until

STEPS = 700


def _time(step: int) -> float:
    return 0.25 + (step * 7 % 13) / 64


@pytest.fixture
def client(db_url: str, engine: Engine) -> Any:
    app = create_app(Settings(database_url=db_url, window_seconds=2.0), engine=engine)
    with TestClient(app) as c:
        for first in range(1, STEPS + 1, 100):
            steps = range(first, first + 100)
            tags = ["warmup" if s <= 5 else ("checkpoint" if s % 97 == 0 else None) for s in steps]
            for rank in range(2):
                body = payload(
                    rank=rank,
                    world=2,
                    first=first,
                    times=[_time(s) + rank / 64 for s in steps],
                    tokens=[1000 + s % 5 for s in steps],
                    tags=tags,
                )
                assert c.post("/api/v1/ingest", json=body).status_code == 200
        yield c


def _steps(engine: Engine) -> dict[int, Any]:
    with engine.connect() as conn:
        return {r.step: r for r in conn.execute(select(JobStep.__table__))}


@pytest.mark.parametrize(
    ("from_step", "to_step", "max_points"),
    [
        (None, None, 500),
        (None, None, 7),
        (None, None, 1),
        (3, 650, 9),
        (130, 300, 2),
        (0, 1000, 40),
        (70, 90, 3),
    ],
)
def test_series_points_are_the_steps_they_cover(
    client: TestClient, engine: Engine, from_step: int | None, to_step: int | None, max_points: int
) -> None:
    params: dict[str, Any] = {"metric": "step_time_s", "max_points": max_points}
    if from_step is not None:
        params |= {"from_step": from_step, "to_step": to_step}
    points = client.get("/api/v1/runs/test-run/series", params=params).json()["points"]
    steps = _steps(engine)
    lo, hi = (1, STEPS) if from_step is None else (max(1, from_step), min(STEPS, to_step or 0))
    assert 0 < len(points) <= max_points
    assert sum(p["count"] for p in points) == hi - lo + 1  # every step once
    for p, q in itertools.pairwise(points):
        assert p["step_to"] < q["step_from"]
    for p in points:
        values = [steps[s].step_time_sum / steps[s].ranks for s in range(p["step_from"], p["step_to"] + 1)]
        assert p["count"] == len(values)
        assert p["min"] == pytest.approx(min(values)) and p["max"] == pytest.approx(max(values))
        assert p["mean"] == pytest.approx(sum(values) / len(values), rel=1e-12)


def test_tokens_per_s_and_mfu_from_buckets(client: TestClient, engine: Engine) -> None:
    steps = _steps(engine)
    tps = [s.tokens * 2 / s.token_ranks / (s.step_time_sum / s.ranks) for s in steps.values()]
    got = client.get(
        "/api/v1/runs/test-run/series", params={"metric": "tokens_per_s", "max_points": 1}
    ).json()
    (point,) = got["points"]
    assert point["max"] == pytest.approx(max(tps)) and point["min"] == pytest.approx(min(tps))
    assert point["mean"] == pytest.approx(sum(tps) / len(tps), rel=1e-12)
    mfu = client.get("/api/v1/runs/test-run/series", params={"metric": "mfu", "max_points": 1}).json()
    assert mfu["points"][0]["max"] == pytest.approx(max(tps) * 1e9 / (2 * 1e14))


def test_overview_totals_from_buckets(client: TestClient, engine: Engine) -> None:
    steps = _steps(engine)
    ov = client.get("/api/v1/runs/test-run").json()
    steady = [s for s in steps.values() if s.tag == 0]
    assert ov["steps_stored"] == STEPS and (ov["first_step"], ov["last_step"]) == (1, STEPS)
    assert ov["tokens_total"] == sum(s.tokens for s in steps.values())
    mean = sum(s.step_time_sum / s.ranks for s in steady) / len(steady)
    assert ov["step_time_s"]["mean"] == pytest.approx(mean, rel=1e-12)
    assert ov["tokens_per_s"]["mean"] == pytest.approx(
        sum(s.tokens for s in steady) / sum(s.step_time_sum / s.ranks for s in steady), rel=1e-12
    )


def test_writers_of_one_bucket_take_turns(pg_engine: Engine) -> None:
    """Two collectors write disjoint steps of one bucket at the same time: the second
    waits for the first to commit, so its recompute counts the first one's steps (a
    recompute from its own snapshot would overwrite them)."""
    engine = pg_engine
    storage = open_storage(engine)
    ingestor = Ingestor(storage, window_seconds=2.0)
    ingestor.store(IngestPayload.model_validate(payload(run="r", rank=0, world=2, first=1)))
    with engine.connect() as conn:
        run_id, ws = conn.execute(select(Run.id, Run.window_steps)).one()

    def rows(rank: int, first: int) -> fold.Rows:
        p = IngestPayload.model_validate(payload(run="r", rank=rank, world=2, first=first))
        return fold.fold([p], [run_id], [ws])

    a = engine.connect()
    tx = a.begin()
    storage.write(a, storage.prepare(rows(0, 5)))  # steps 5-8 of bucket 0, not committed yet
    done = threading.Event()

    def other() -> None:
        with engine.begin() as conn:
            storage.write(conn, storage.prepare(rows(1, 1)))  # steps 1-4 of the same bucket
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with engine.connect() as conn:
        wait_until(
            lambda: conn.execute(
                text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
            ).scalar(),
            "the second writer waiting for the bucket",
        )
    assert not done.is_set()
    tx.commit()
    a.close()
    thread.join(30)
    assert done.is_set()
    with engine.connect() as conn:
        n, st = conn.execute(select(JobStepBucket.n_steps, JobStepBucket.step_time_sum)).one()
    assert n == 8 and st == pytest.approx(8 * 0.5)
