"""Profiler windows through the collector: storage, the wait/transfer split across ranks,
the reads, and validation, on a real database (SQLite and PostgreSQL), in process."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import TypeAdapter
from sqlalchemy import Engine, func, select

from stepwatch_server.app import create_app
from stepwatch_server.ingest.profiles import PENDING_KEEP
from stepwatch_server.reads import queries
from stepwatch_server.schemas.responses import RankSummary
from stepwatch_server.settings import Settings
from stepwatch_server.storage.models import (
    CollectiveStat,
    IngestedBatch,
    ProfileArrival,
    ProfilePending,
    ProfileWindow,
    RankWindow,
)

from ..payloads import payload, profile_entry

WORLD = 4
RW = RankWindow.__table__


@pytest.fixture
def client(db_url: str, engine: Engine) -> Iterator[TestClient]:
    app = create_app(
        Settings(database_url=db_url, window_seconds=2.0, max_body_bytes=256 * 1024), engine=engine
    )
    with TestClient(app) as c:
        yield c


def _count(engine: Engine, table: type) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())


def _enter(rank: int, j: int) -> float:
    """Rank 2 is a compute straggler: it enters each all-reduce 50 ms after rank 0."""
    return 0.10 + (0.05 if rank == 2 else 0.002 * rank) + 0.5 * j


def _end(rank: int, j: int) -> float:
    return 0.16 + 0.001 * rank + 0.5 * j


def _post(client: TestClient, rank: int, *, compute: float = 0.3, **kw: Any) -> dict[str, Any]:
    entry = profile_entry(
        first_step=5,
        enter=[_enter(rank, j) for j in range(2)],
        end=[_end(rank, j) for j in range(2)],
        compute=compute,
    )
    p = payload(rank=rank, world=WORLD, first=1, times=[0.5] * 8, profiles=[entry], **kw)
    r = client.post("/api/v1/ingest", json=p)
    assert r.status_code == 200, r.text
    return p


def _windows(engine: Engine) -> dict[int, Any]:
    with engine.connect() as conn:
        rows = conn.execute(select(RW).where(RW.c.window == 1)).all()
    return {r.rank: r for r in rows}


def test_wait_and_transfer_are_split_once_every_rank_reported(client: TestClient, engine: Engine) -> None:
    for rank in (0, 1, 3):
        _post(client, rank, compute=0.3)
    # Three of four ranks: the breakdown is stored, the split waits for rank 2.
    w = _windows(engine)
    assert all(w[r].profiled_steps == 2 and w[r].compute_s == pytest.approx(0.3) for r in (0, 1, 3))
    assert all(w[r].comm_wait_s is None for r in (0, 1, 3))
    assert _count(engine, ProfilePending) == 1 and _count(engine, ProfileArrival) == 3
    first = client.get("/api/v1/runs/test-run/ranks").json()
    assert first[0]["collectives"][0]["wait_s"] is None and first[0]["profile"]["comm_wait_s"] is None

    _post(client, 2, compute=0.38)
    w = _windows(engine)
    expected_wait = {0: 0.05, 1: 0.048, 2: 0.0, 3: 0.044}
    for r in range(WORLD):
        assert w[r].skew_steps == 2
        assert w[r].comm_wait_s == pytest.approx(expected_wait[r], abs=1e-6)
        assert w[r].comm_transfer_s == pytest.approx(0.01 + 0.001 * r, abs=1e-6)
    assert _count(engine, ProfilePending) == 0 and _count(engine, ProfileArrival) == 0, "staging cleaned up"

    ranks = {r["rank"]: r for r in client.get("/api/v1/runs/test-run/ranks").json()}
    p2 = ranks[2]["profile"]
    assert (p2["first_step"], p2["n_steps"], p2["device"]) == (5, 2, "cpu")
    assert p2["compute_s"] == pytest.approx(0.38) and p2["step_s"] == pytest.approx(0.5)
    assert p2["overlap_ratio"] == pytest.approx(0.5)
    assert p2["comm_wait_s"] == pytest.approx(0.0) and ranks[0]["profile"]["comm_wait_s"] == pytest.approx(
        0.05
    )
    assert p2["clock"] == {"offset_s": 0.0, "uncertainty_s": 0.0, "method": "same-host"}
    assert p2["cost_s"] == pytest.approx(0.05) and p2["profile_every"] == 100
    assert p2["top_ops"] == [{"name": "aten::mm", "self_s": pytest.approx(0.19), "count": 12.0}]
    (coll,) = ranks[0]["collectives"]
    assert (coll["op"], coll["windows"], coll["count"], coll["bytes"]) == ("all_reduce", 1, 2, 8192)
    # Quantiles from the sketches, within their 1% relative error.
    assert coll["duration_s"]["max"] == pytest.approx(0.06, rel=0.01)
    assert coll["wait_s"]["p50"] == pytest.approx(0.05, rel=0.01)
    assert coll["transfer_s"]["p99"] == pytest.approx(0.01, rel=0.01)
    assert ranks[2]["collectives"][0]["wait_s"]["max"] == 0.0


def test_breakdown_series_is_the_mean_over_ranks_per_window(client: TestClient) -> None:
    for rank in range(WORLD):
        _post(client, rank, compute=0.3 + 0.08 * (rank == 2))

    def series(metric: str) -> list[dict[str, Any]]:
        r = client.get("/api/v1/runs/test-run/series", params={"metric": metric})
        assert r.status_code == 200, r.text
        body: list[dict[str, Any]] = r.json()["points"]
        return body

    (pt,) = series("compute_s")
    assert (pt["step_from"], pt["step_to"], pt["count"]) == (5, 8, 1)
    assert pt["mean"] == pytest.approx((0.3 * 3 + 0.38) / 4)
    (wait,) = series("comm_wait_s")
    assert wait["mean"] == pytest.approx((0.05 + 0.048 + 0.0 + 0.044) / 4, abs=1e-6)
    (ratio,) = series("overlap_ratio")
    assert ratio["mean"] == pytest.approx(0.5)
    assert series("idle_s")[0]["mean"] == pytest.approx(0.5 - 0.32 - 0.05 - 0.05 - 0.01)


def test_a_retried_batch_counts_once(client: TestClient, engine: Engine) -> None:
    p = _post(client, 0)
    again = client.post("/api/v1/ingest", json=p)
    assert again.status_code == 200 and again.json()["stored"] is False
    assert _windows(engine)[0].profiled_steps == 2
    with engine.connect() as conn:
        assert conn.execute(select(ProfilePending.__table__.c.arrivals)).scalar_one() == 1


def test_a_skipped_window_is_reported_and_still_completes_the_split(
    client: TestClient, engine: Engine
) -> None:
    for rank in (0, 1, 2):
        _post(client, rank)
    skipped = {"first_step": 5, "n_steps": 0, "skipped": "another profiler active"}
    r = client.post("/api/v1/ingest", json=payload(rank=3, world=WORLD, times=[0.5] * 8, profiles=[skipped]))
    assert r.status_code == 200, r.text
    assert _count(engine, ProfilePending) == 0, "every rank reported, the window is done"
    # Rank 3's missing arrivals make the group incomplete: no split rather than a wrong one.
    assert all(w.comm_wait_s is None for w in _windows(engine).values())
    ranks = {r["rank"]: r for r in client.get("/api/v1/runs/test-run/ranks").json()}
    assert ranks[3]["profile"] is None and ranks[3]["profile_skipped"] == "another profiler active"
    assert ranks[0]["profile_skipped"] is None and ranks[0]["profile"]["compute_s"] == pytest.approx(0.3)


def test_windows_that_never_complete_are_pruned(client: TestClient, engine: Engine) -> None:
    n = PENDING_KEEP + 3
    for k in range(n):
        first = 1 + 4 * k
        entry = profile_entry(first_step=first + 1, enter=[0.1], end=[0.2])
        p = payload(rank=0, world=WORLD, first=first, times=[0.5] * 4, profiles=[entry])
        assert client.post("/api/v1/ingest", json=p).status_code == 200
    assert _count(engine, ProfilePending) == PENDING_KEEP
    assert _count(engine, ProfileArrival) == PENDING_KEEP
    assert _count(engine, ProfileWindow) == n and _count(engine, CollectiveStat) == n, (
        "the rank's own data stays"
    )


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(p: dict[str, Any]) -> None:
        node: Any = p
        keys = path.split(".")
        for k in keys[:-1]:
            node = node[int(k)] if k.isdigit() else node[k]
        last = keys[-1]
        node[int(last) if last.isdigit() else last] = value

    return mutate


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (_set("profiles.0.collectives.0.duration.count", 5), "duration"),
        (_set("profiles.0.collectives.0.duration.counts", [1, -1]), "counts"),
        (_set("profiles.0.arrivals.0.enter", [0.1]), "enter"),
        (_set("profiles.0.compute_s", [0.9, 0.9]), "parts sum"),
        (_set("profiles.0.arrivals.0.step", [5, 9]), "outside the profiled steps"),
        (_set("profiles.0.n_steps", 17), "n_steps"),
        (_set("profiles.0.collectives.0.op", "allreduce_fancy"), "op"),
        (_set("profiles.0.clock.offset_s", float("1e9")), "offset_s"),
        (_set("schema_version", 1), "schema_version 2"),
    ],
)
def test_bad_profiles_are_rejected_whole_naming_the_field(
    client: TestClient, engine: Engine, mutate: Callable[[dict[str, Any]], None], field: str
) -> None:
    entry = profile_entry(first_step=5, enter=[0.1, 0.6], end=[0.2, 0.7])
    p = payload(rank=0, world=WORLD, times=[0.5] * 8, profiles=[entry])
    mutate(p)
    r = client.post("/api/v1/ingest", json=p)
    assert r.status_code == 422, r.text
    assert field in r.text
    assert _count(engine, IngestedBatch) == 0 and _count(engine, ProfileWindow) == 0


def test_ranks_rows_serialise_as_the_models_would(client: TestClient, engine: Engine) -> None:
    """``/ranks`` serialises plain rows (``queries.rank_rows``) without validating them
    into ``RankSummary`` models: the bytes must be those of the validated models, for
    ranks with a profile and collectives, one whose wait split is pending, and one whose
    final batch moved its last step past its windows."""
    for rank in (0, 1, 3):
        _post(client, rank, compute=0.3)
    r = client.post("/api/v1/ingest", json=payload(rank=2, world=WORLD, first=1, times=[0.5] * 8))
    assert r.status_code == 200, r.text
    r = client.post("/api/v1/ingest", json=payload(rank=2, world=WORLD, first=13, times=[], final=True))
    assert r.status_code == 200, r.text
    with engine.connect() as conn:
        rows = queries.rank_rows(conn, "test-run")
    models = [RankSummary.model_validate(r) for r in rows]
    body = client.get("/api/v1/runs/test-run/ranks").content
    assert body == TypeAdapter(list[RankSummary]).dump_json(models)
    ranks = {r["rank"]: r for r in json.loads(body)}
    assert ranks[0]["profile"]["compute_s"] == pytest.approx(0.3) and ranks[0]["collectives"]
    assert ranks[2]["profile"] is None and ranks[2]["collectives"] == []
    assert (ranks[2]["last_step"], ranks[2]["window_last_step"]) == (12, 8), "its newest stored window"
    assert ranks[2]["step_time_s"] == pytest.approx(0.5)
