"""``GET /api/v1/runs`` and the page at ``/`` list runs one page at a time, on both backends.

Issue 15: at 10,000 runs the list was 10,001 entries (0.97 MB) and ``?limit=`` was ignored.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from stepwatch_server.app import create_app
from stepwatch_server.ingest.store import Ingestor
from stepwatch_server.schemas.ingest import IngestPayload
from stepwatch_server.settings import Settings
from stepwatch_server.storage.backend import open_storage

from ..payloads import payload

N = 230
NOW = time.time()


@pytest.fixture
def client(db_url: str, engine: Engine) -> Iterator[TestClient]:
    ingestor = Ingestor(open_storage(engine))
    batches = []
    for i in range(N):  # old-000 ... : every third finished; the last 30 reported a day ago
        name = f"{'old' if i < 30 else 'new'}-{i:03d}"
        wall = NOW - 86_400 if i < 30 else NOW
        batches.append(payload(run=name, wall_end=wall, final=i % 3 == 0))
    ingestor.store_many([IngestPayload.model_validate(b) for b in batches])
    with TestClient(create_app(Settings(database_url=db_url, analysis_enabled=False), engine=engine)) as c:
        yield c


def _names(r: object) -> list[str]:
    return [x["name"] for x in r.json()]  # type: ignore[attr-defined]


def test_the_default_page_is_bounded_and_gives_the_total(client: TestClient) -> None:
    r = client.get("/api/v1/runs")
    assert r.status_code == 200 and r.headers["x-total-count"] == str(N)
    assert _names(r) == [f"new-{i:03d}" for i in range(N - 1, N - 101, -1)]  # newest first
    nxt = re.fullmatch(r"<(.+)>; rel=\"next\"", r.headers["link"])
    assert nxt is not None
    seen = _names(r)
    while nxt is not None:  # following the links lists every run once
        r = client.get(nxt.group(1))
        seen += _names(r)
        nxt = re.fullmatch(r"<(.+)>; rel=\"next\"", r.headers.get("link", ""))
    assert len(seen) == N and len(set(seen)) == N
    r = client.get("/api/v1/runs", params={"limit": 5, "offset": 225})
    assert _names(r) == [f"old-{i:03d}" for i in range(4, -1, -1)] and "link" not in r.headers
    assert client.get("/api/v1/runs", params={"limit": 1001}).status_code == 422


def test_runs_are_filtered_by_status_prefix_and_since(client: TestClient) -> None:
    finished = client.get("/api/v1/runs", params={"status": "finished", "limit": 1000})
    assert set(_names(finished)) == {n for n in _all() if int(n[-3:]) % 3 == 0}
    assert finished.headers["x-total-count"] == str(len(range(0, N, 3)))
    running = client.get("/api/v1/runs", params={"status": "running", "limit": 1000})
    assert set(_names(running)) == {n for n in _all() if int(n[-3:]) % 3 != 0}
    old = client.get("/api/v1/runs", params={"prefix": "old-"})
    assert old.headers["x-total-count"] == "30" and all(n.startswith("old-") for n in _names(old))
    assert client.get("/api/v1/runs", params={"prefix": "OLD-"}).headers["x-total-count"] == "0"
    recent = client.get("/api/v1/runs", params={"since": NOW - 3600, "prefix": "new-1", "status": "finished"})
    assert set(_names(recent)) == {n for n in _all() if n.startswith("new-1") and int(n[-3:]) % 3 == 0}


def _all() -> list[str]:
    return [f"{'old' if i < 30 else 'new'}-{i:03d}" for i in range(N)]


def test_the_page_lists_with_the_same_pagination(client: TestClient) -> None:
    first = client.get("/")
    assert first.status_code == 200
    rows = re.findall(r'<a href="[^"]*/runs/([^"]+)">', first.text)
    assert rows == [f"new-{i:03d}" for i in range(N - 1, N - 101, -1)]
    assert f"runs 1–100 of {N}" in first.text and 'href="?offset=100" rel="next"' in first.text
    last = client.get("/", params={"offset": 200})
    assert re.findall(r'<a href="[^"]*/runs/([^"]+)">', last.text)[-1] == "old-000"
    assert 'rel="next"' not in last.text and 'href="?offset=100" rel="prev"' in last.text
