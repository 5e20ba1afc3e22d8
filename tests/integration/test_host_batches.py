"""Per-host batching (``POST /api/v1/ingest/batches``) on both backends: the windows of
several ranks in one request, each entry checked exactly as a payload posted alone (the
same 422 bodies, named ``batches.<i>.<field>``), nothing stored when any entry is
refused, each window stored once however often the request is retried."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select

from stepwatch import wire
from stepwatch_server.app import create_app
from stepwatch_server.settings import Settings
from stepwatch_server.storage.models import IngestedBatch, JobStep, Rank, RankWindow, Run

from ..payloads import comm_section, payload

WRITE = "agent-secret-0123456789"
READ = "grafana-secret-0123456789"
Mutation = Callable[[dict[str, Any]], Any]


def _client(db_url: str, engine: Engine, **settings: Any) -> TestClient:
    app = create_app(
        Settings(database_url=db_url, window_seconds=2.0, max_body_bytes=256 * 1024, **settings),
        engine=engine,
    )
    return TestClient(app)


@pytest.fixture
def client(db_url: str, engine: Engine) -> Iterator[TestClient]:
    with _client(db_url, engine) as c:
        yield c


def _count(engine: Engine, table: type) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())


def _host(n: int = 4, world: int = 4, **kw: Any) -> list[dict[str, Any]]:
    return [payload(rank=r, world=world, **kw) for r in range(n)]


def test_a_host_batch_stores_every_window_once(client: TestClient, engine: Engine) -> None:
    entries = _host(times=[0.2] * 5)
    first = client.post(wire.HOST_BATCH_PATH, json={"batches": entries})
    again = client.post(wire.HOST_BATCH_PATH, json={"batches": entries})
    assert (first.status_code, again.status_code) == (200, 200), first.text
    assert [r["batch_id"] for r in first.json()["results"]] == [e["batch_id"] for e in entries]
    assert [r["stored"] for r in first.json()["results"]] == [True] * 4
    assert [r["stored"] for r in again.json()["results"]] == [False] * 4
    # The same window posted alone afterwards is a retry too.
    alone = client.post(wire.INGEST_PATH, json=entries[2])
    assert alone.status_code == 200 and alone.json()["stored"] is False
    assert _count(engine, IngestedBatch) == 4 and _count(engine, Rank) == 4
    assert _count(engine, RankWindow) == 4 and _count(engine, JobStep) == 5
    with engine.connect() as conn:
        assert conn.execute(select(func.sum(JobStep.ranks))).scalar_one() == 4 * 5
    # Counted per batch (one increment per request and counter): 4 stored with their 20
    # rank-steps, 5 duplicates, a latency for each of the 9.
    scrape = client.get("/metrics").text
    assert 'stepwatch_ingest_batches_total{outcome="stored"} 4.0' in scrape
    assert 'stepwatch_ingest_batches_total{outcome="duplicate"} 5.0' in scrape
    assert "stepwatch_ingest_rank_steps_total 20.0" in scrape
    assert "stepwatch_ingest_duration_seconds_count 9.0" in scrape


def test_an_entry_repeated_in_one_host_batch_is_stored_once(client: TestClient, engine: Engine) -> None:
    p = payload(world=4)
    r = client.post(wire.HOST_BATCH_PATH, json={"batches": [p, p]})
    assert r.status_code == 200, r.text
    assert [x["stored"] for x in r.json()["results"]] == [True, False]
    assert _count(engine, IngestedBatch) == 1 and _count(engine, JobStep) == 4


#: Bad payloads, each refused alone with a 422 naming a field (schema, cross-field rules,
#: configurable limits, a NUL in text): a host batch carrying one must be refused with
#: the same errors, located inside its entry.
BAD: list[tuple[str, Mutation]] = [
    ("negative tokens", lambda p: p["steps"]["tokens"].__setitem__(2, -5)),
    ("short data_wait_s", lambda p: p["steps"]["data_wait_s"].pop()),
    ("run name", lambda p: p.__setitem__("run", "bad name!")),
    ("rank outside world", lambda p: p["rank"].__setitem__("rank", 9)),
    ("schema_version", lambda p: p.__setitem__("schema_version", 99)),
    ("schema_version float", lambda p: p.__setitem__("schema_version", 2.0)),
    ("no steps", lambda p: p["steps"].__setitem__("time_s", [])),
    ("no batch_id", lambda p: p.pop("batch_id")),
    ("extra field", lambda p: p.__setitem__("surprise", 1)),
    ("string count", lambda p: p["agent"].__setitem__("dropped_steps", "0")),
    ("infinite wall_end", lambda p: p["steps"].__setitem__("wall_end", 1e300)),
    ("comm length", lambda p: p.__setitem__("comm", {**comm_section(4), "sync_us": [100]})),
    ("comm null list", lambda p: p.__setitem__("comm", {**comm_section(4), "cpu_us": None})),
    ("comm version", lambda p: p.__setitem__("comm", {**comm_section(4), "version": 7})),
    ("NUL in host", lambda p: p["rank"].__setitem__("host", "node\x000")),
    ("NUL in convention", lambda p: p["convention"].__setitem__("notes", "a\x00b")),
    ("too many steps", lambda p: p["steps"].update(payload(world=4, times=[0.1] * 40)["steps"])),
    ("removed summary", lambda p: p.__setitem__("profile", {})),
]


@pytest.mark.parametrize(("name", "mutate"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_entry_gets_its_alone_422_and_nothing_is_stored(
    db_url: str, engine: Engine, name: str, mutate: Mutation
) -> None:
    bad = payload(world=4, rank=1)
    mutate(bad)
    with _client(db_url, engine, max_steps_per_batch=32) as c:
        alone = c.post(wire.INGEST_PATH, json=bad)
        assert alone.status_code == 422, (name, alone.text)
        batched = c.post(wire.HOST_BATCH_PATH, json={"batches": [payload(world=4), bad, payload(world=4)]})
        assert batched.status_code == 422, (name, batched.text)
    want = [{**e, "loc": ["batches", 1, *e["loc"]]} for e in alone.json()["errors"]]
    assert batched.json()["errors"] == want, name
    # The same messages, each located inside the entry (a whole-entry error at ``batches.1``).
    assert batched.json()["detail"] == "invalid request: " + "; ".join(
        ".".join(str(x) for x in e["loc"] if x != "body") + f": {e['msg']}" for e in want
    )
    assert _count(engine, IngestedBatch) == 0 and _count(engine, JobStep) == 0
    # Not even the run of the good entry before it (admission comes after every check).
    assert _count(engine, Run) == 0


def test_the_envelope_is_validated(client: TestClient, engine: Engine) -> None:
    for body, field in [
        ({"batches": []}, "batches"),
        ({"batches": [payload(world=4)] * (wire.MAX_HOST_BATCHES + 1)}, "batches"),
        ({"batches": payload(world=4)}, "batches"),
        ({"windows": [payload(world=4)]}, "batches"),
        ([payload(world=4)], "body"),
    ]:
        r = client.post(wire.HOST_BATCH_PATH, json=body)
        assert r.status_code == 422, r.text
        assert r.json()["detail"].startswith(f"invalid request: {field}"), r.json()["detail"]
    assert _count(engine, IngestedBatch) == 0


def test_a_refused_entry_is_named_with_its_status(db_url: str, engine: Engine) -> None:
    with _client(db_url, engine) as c:
        assert c.post(wire.INGEST_PATH, json=payload(world=4)).status_code == 200
        r = c.post(wire.HOST_BATCH_PATH, json={"batches": [payload(world=4), payload(world=8, rank=5)]})
    assert r.status_code == 409, r.text
    assert r.json()["detail"].startswith("batches.1: rank.world_size: run 'test-run' has 4 ranks")
    assert _count(engine, IngestedBatch) == 1  # the earlier POST's only


def test_host_batches_need_a_write_token(db_url: str, engine: Engine) -> None:
    body = {"batches": _host(2)}
    with _client(db_url, engine, write_tokens=f"agents={WRITE}", read_tokens=f"grafana={READ}") as c:
        r = c.post(wire.HOST_BATCH_PATH, json=body)
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        r = c.post(wire.HOST_BATCH_PATH, json=body, headers={"authorization": "Bearer not-a-token"})
        assert r.status_code == 401
        r = c.post(wire.HOST_BATCH_PATH, json=body, headers={"authorization": f"Bearer {READ}"})
        assert r.status_code == 403 and r.json()["detail"] == "token 'grafana' may read but not write"
        assert _count(engine, IngestedBatch) == 0
        r = c.post(wire.HOST_BATCH_PATH, json=body, headers={"authorization": f"Bearer {WRITE}"})
        assert r.status_code == 200, r.text
    assert _count(engine, IngestedBatch) == 2


def test_a_host_batch_over_the_body_limit_is_413(client: TestClient, engine: Engine) -> None:
    r = client.post(wire.HOST_BATCH_PATH, json={"batches": _host(8, world=8, times=[0.1] * 5000)})
    assert r.status_code == 413 and "larger than" in r.json()["detail"]
    assert _count(engine, IngestedBatch) == 0


def test_the_host_batch_route_is_in_the_openapi_document(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    body = doc["paths"][wire.HOST_BATCH_PATH]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/IngestBatches"}
    assert "IngestPayload" in doc["components"]["schemas"]
    assert doc["components"]["schemas"]["IngestBatches"]["properties"]["batches"]["maxItems"] == (
        wire.MAX_HOST_BATCHES
    )
