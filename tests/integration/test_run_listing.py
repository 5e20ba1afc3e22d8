"""``GET /api/v1/runs`` and the page at ``/`` list runs one page at a time, on both backends.

Issue 15: at 10,000 runs the list was 10,001 entries (0.97 MB) and ``?limit=`` was ignored.
Issue 14's audit: ``?status=`` took only ``running`` or ``finished``, not the statuses the
list shows (``?status=hung`` was a 422).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from stepwatch_server.analysis.types import Finding, Status
from stepwatch_server.app import create_app
from stepwatch_server.ingest.store import Ingestor
from stepwatch_server.schemas.ingest import IngestPayload
from stepwatch_server.settings import Settings
from stepwatch_server.storage.backend import open_storage

from ..payloads import payload
from ..runstate import store_finding

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


#: The runs of the status tests by the status each must have, oldest first (ids ascend).
#: ``partial``: one of two ranks sent its final batch, the other none yet (not finished);
#: ``done-hung``: finished with a hang still open (finished takes precedence);
#: ``closed-hang``: a hang that closed leaves the run live; ``quiet-hung``: silent and hung.
STATUS_RUNS: dict[str, list[str]] = {"live": [], "finished": [], "stalled": [], "hung": []}
for _i in range(14):
    STATUS_RUNS[("live", "finished", "stalled", "hung")[_i % 4]].append(f"r{_i:02d}")
STATUS_RUNS["live"] += ["partial", "closed-hang"]
STATUS_RUNS["finished"].append("done-hung")
STATUS_RUNS["hung"].append("quiet-hung")
#: The hang threshold of the status tests' app: an hour, so that the runs that reported at
#: ``NOW`` stay live whatever the test's duration, and those a day back are stalled.
FLOOR_S = 3600.0


def _hang(engine: Engine, run: str, status: Status) -> None:
    """A hang flag as the analysis worker writes it (``worker.outputs.write_findings``)."""
    store_finding(
        engine,
        Finding(
            kind="hang", run=run, key="hang:run", cause=None, ranks=(0,), hosts=("node0",),
            first_step=4, last_step=4, status=status, evidence={}, cost_seconds=90.0, cost_ratio=1.0,
            message="no step",
        ),
    )  # fmt: skip


@pytest.fixture
def status_client(db_url: str, engine: Engine) -> Iterator[TestClient]:
    """The runs of :data:`STATUS_RUNS`, stored in the order of their names' numbers (so
    their ids interleave the statuses) through the real ingest and the worker's writer."""
    ingestor = Ingestor(open_storage(engine))

    def store(**kwargs: object) -> None:
        assert ingestor.store(IngestPayload.model_validate(payload(**kwargs)))  # type: ignore[arg-type]

    for i in range(14):
        name, status = f"r{i:02d}", ("live", "finished", "stalled", "hung")[i % 4]
        store(run=name, wall_end=NOW - 86_400 if status == "stalled" or i == 7 else NOW)
        if status == "finished":
            store(run=name, first=5, times=[], final=True, wall_end=NOW - 86_400 * (i % 2))
        if status == "hung":
            _hang(engine, name, "open")  # r07 a day silent, r03 and r11 still stepping
    store(run="partial", world=2, rank=0, final=True, wall_end=NOW)
    store(run="done-hung", final=True, wall_end=NOW)
    _hang(engine, "done-hung", "open")
    store(run="closed-hang", wall_end=NOW)
    _hang(engine, "closed-hang", "closed")
    store(run="quiet-hung", wall_end=NOW - 86_400)
    _hang(engine, "quiet-hung", "open")
    settings = Settings(database_url=db_url, analysis_enabled=False, hang_floor_s=FLOOR_S)
    with TestClient(create_app(settings, engine=engine)) as c:
        yield c


def _newest_first(names: list[str]) -> list[str]:
    order = sorted(n for runs in STATUS_RUNS.values() for n in runs if n.startswith("r"))
    order += ["partial", "done-hung", "closed-hang", "quiet-hung"]  # stored last, in this order
    return sorted(names, key=order.index, reverse=True)


def _pages(client: TestClient, **params: object) -> tuple[list[str], list[str], set[str]]:
    """Every page of a listing followed by its ``Link``: the names, the statuses shown
    and the ``X-Total-Count`` of each page."""
    r = client.get("/api/v1/runs", params=params)  # type: ignore[arg-type]
    names: list[str] = []
    statuses: list[str] = []
    totals: set[str] = set()
    while True:
        assert r.status_code == 200, r.text
        names += _names(r)
        statuses += [x["status"] for x in r.json()]
        totals.add(r.headers["x-total-count"])
        nxt = re.fullmatch(r"<(.+)>; rel=\"next\"", r.headers.get("link", ""))
        if nxt is None:
            return names, statuses, totals
        r = client.get(nxt.group(1))


@pytest.mark.parametrize("status", ["live", "finished", "stalled", "hung"])
def test_each_status_filter_lists_exactly_its_runs_in_pages(status_client: TestClient, status: str) -> None:
    expected = _newest_first(STATUS_RUNS[status])
    names, statuses, totals = _pages(status_client, status=status, limit=2)
    assert names == expected and statuses == [status] * len(expected)
    assert totals == {str(len(expected))}
    # A page past the end: empty, the same total, no next page.
    r = status_client.get("/api/v1/runs", params={"status": status, "offset": len(expected), "limit": 2})
    assert r.json() == [] and r.headers["x-total-count"] == str(len(expected)) and "link" not in r.headers
    # With the other filters: a prefix, and since (the runs that reported in the last hour).
    r = status_client.get("/api/v1/runs", params={"status": status, "prefix": "r1"})
    assert _names(r) == [n for n in expected if n.startswith("r1")]
    assert r.headers["x-total-count"] == str(len(_names(r)))
    since = status_client.get("/api/v1/runs", params={"status": status, "since": NOW - FLOOR_S})
    recent = {x["name"] for x in status_client.get("/api/v1/runs", params={"since": NOW - FLOOR_S}).json()}
    assert _names(since) == [n for n in expected if n in recent]


def test_running_is_every_run_not_finished(status_client: TestClient) -> None:
    shown = {x["name"]: x["status"] for x in status_client.get("/api/v1/runs").json()}
    assert shown == {n: s for s, runs in STATUS_RUNS.items() for n in runs}  # the runs as built
    names, statuses, totals = _pages(status_client, status="running", limit=3)
    expected = _newest_first(STATUS_RUNS["live"] + STATUS_RUNS["stalled"] + STATUS_RUNS["hung"])
    assert names == expected and "partial" in names and "finished" not in statuses
    assert totals == {str(len(expected))}


def test_an_unknown_status_is_refused_naming_the_field_and_the_values(status_client: TestClient) -> None:
    for bad in ("bogus", "HUNG", "running,hung", ""):
        r = status_client.get("/api/v1/runs", params={"status": bad})
        assert r.status_code == 422, bad
        assert [e["loc"] for e in r.json()["errors"]] == [["query", "status"]]
        detail = r.json()["detail"]
        assert "status" in detail and all(f"'{s}'" in detail for s in (*STATUS_RUNS, "running")), detail
