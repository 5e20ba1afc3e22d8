"""Run admission on both backends: the quota holds under concurrency (the database
decides), a run belongs to the token that created it, batch ids are scoped by run, and a
batch's world size must be its run's.

Issue 15: 1,000 simultaneous first batches with a quota of 3 created 1,000 runs; a second
token could post into another's run and make its batch ids answer ``stored: false``.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select

from stepwatch_server.app import create_app
from stepwatch_server.settings import Settings
from stepwatch_server.storage.models import Run, TokenQuota

from ..live import serve_in_thread
from ..payloads import payload

A, B, RELAY = "token-a-0123456789", "token-b-0123456789", "token-relay-0123456789"
TOKENS = f"a={A},b={B},relay={RELAY}"


def _bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


@pytest.fixture
def client(db_url: str, engine: Engine) -> Iterator[TestClient]:
    settings = Settings(
        database_url=db_url, write_tokens=TOKENS, shared_write_tokens="relay", analysis_enabled=False
    )
    with TestClient(create_app(settings, engine=engine)) as c:
        yield c


async def _fire(urls: list[str], n: int) -> Counter[int]:
    """``n`` first batches of ``n`` new runs at once, spread over the collectors, at most
    64 connections to each (bounded, over loopback)."""
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    clients = [httpx.AsyncClient(base_url=u, limits=limits, timeout=120, headers=_bearer(A)) for u in urls]
    bodies = [payload(run=f"burst-{i}") for i in range(n)]
    try:
        rs = await asyncio.gather(
            *(clients[i % len(clients)].post("/api/v1/ingest", json=b) for i, b in enumerate(bodies))
        )
    finally:
        for c in clients:
            await c.aclose()
    return Counter(r.status_code for r in rs)


def test_a_thousand_new_runs_at_once_create_exactly_the_quota(db_url: str, engine: Engine) -> None:
    """Two collectors on one database, so that no in-process state can serialise the
    admissions: only the counter row's lock does."""
    # A kept-alive connection can sit idle past the 5 s default while this one process's
    # event loop works through 1,000 requests on loaded cores; the server then closes it as
    # the client reuses it (httpx.ReadError, no request seen: CI, twice). Likewise the 30 s
    # deadline for reading a request, armed when a connection opens: at load 6 (2026-12-05)
    # the test failed again with httpx.ReadError, most likely this process sending a request
    # more than 30 s after opening its connection, the server's 408 and close then reaching
    # the client as a reset (not shown). Neither is what this test is about.
    opts = {
        "write_tokens": TOKENS,
        "max_runs_per_token": 3,
        "analysis_enabled": False,
        "keep_alive_timeout_s": 300,
        "request_read_timeout_s": 300,
    }
    with serve_in_thread(db_url, **opts) as one, serve_in_thread(db_url, **opts) as two:
        codes = asyncio.run(_fire([one, two], 1000))
    assert codes == Counter({200: 3, 403: 997})
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Run)).scalar_one() == 3
        assert conn.execute(select(TokenQuota.runs_created).where(TokenQuota.token == "a")).scalar_one() == 3


def test_a_run_belongs_to_the_token_that_created_it(client: TestClient) -> None:
    assert client.post("/api/v1/ingest", json=payload(run="mine"), headers=_bearer(A)).status_code == 200
    r = client.post("/api/v1/ingest", json=payload(run="mine"), headers=_bearer(B))
    assert r.status_code == 403 and "belongs to token 'a'" in r.json()["detail"], r.text
    # A token configured as shared may write into it; the owner still may.
    assert client.post("/api/v1/ingest", json=payload(run="mine"), headers=_bearer(RELAY)).status_code == 200
    assert client.post("/api/v1/ingest", json=payload(run="mine"), headers=_bearer(A)).status_code == 200
    ranks = client.get("/api/v1/runs/mine/ranks").json()
    assert len(ranks) == 1 and ranks[0]["last_step"] == 4


def test_batch_ids_are_scoped_by_run(client: TestClient) -> None:
    """Another token that learns a batch id cannot make that batch look like a retry."""
    mine = payload(run="mine", batch_id="shared-batch-id-01")
    theirs = payload(run="theirs", batch_id="shared-batch-id-01")
    r = client.post("/api/v1/ingest", json=theirs, headers=_bearer(B))
    assert r.status_code == 200 and r.json()["stored"] is True
    r = client.post("/api/v1/ingest", json=mine, headers=_bearer(A))
    assert r.status_code == 200 and r.json()["stored"] is True, r.text
    r = client.post("/api/v1/ingest", json=mine, headers=_bearer(A))  # a real retry
    assert r.status_code == 200 and r.json()["stored"] is False
    assert client.get("/api/v1/runs/mine/ranks").json()[0]["last_step"] == 4


def test_a_world_size_change_is_answered_as_a_restart(client: TestClient) -> None:
    """A run has one world size; a batch declaring another (a job restarted at another
    size) is refused with 409 naming the field, and nothing of it is stored."""
    assert (
        client.post("/api/v1/ingest", json=payload(run="sized", world=1), headers=_bearer(A)).status_code
        == 200
    )
    r = client.post("/api/v1/ingest", json=payload(run="sized", rank=3, world=4), headers=_bearer(A))
    assert r.status_code == 409, r.text
    assert r.json()["detail"].startswith("rank.world_size: run 'sized' has 1 ranks")
    runs = client.get("/api/v1/runs").json()
    assert [(x["name"], x["world_size"], x["ranks_reporting"]) for x in runs] == [("sized", 1, 1)]
