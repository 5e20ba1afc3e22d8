"""Collector hardening: tokens (401/403), configurable limits, label bounds, runs per
token, CORS off by default. Each refusal is a clear 4xx that names the problem and
stores nothing."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select

from stepwatch_server.api.auth import parse_tokens
from stepwatch_server.app import create_app
from stepwatch_server.ingest.store import RunKey
from stepwatch_server.schemas.ingest import IngestPayload
from stepwatch_server.settings import Settings
from stepwatch_server.storage import migrate
from stepwatch_server.storage.engine import make_engine
from stepwatch_server.storage.models import IngestedBatch, Run

from ..payloads import payload

WRITE = "agent-secret-0123456789"
READ = "grafana-secret-0123456789"
READ_SHA = hashlib.sha256(READ.encode()).hexdigest()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'hardening.db'}"
    migrate.upgrade(url)
    return url


def _client(url: str, **settings: Any) -> TestClient:
    return TestClient(create_app(Settings(database_url=url, **settings)))


@pytest.fixture
def secured(sqlite_url: str) -> Iterator[TestClient]:
    with _client(
        sqlite_url, write_tokens=f"agents={WRITE}", read_tokens=f"grafana=sha256:{READ_SHA}"
    ) as client:
        yield client


def _bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def test_writes_need_a_write_token(secured: TestClient) -> None:
    r = secured.post("/api/v1/ingest", json=payload())
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    assert "bearer token to write" in r.json()["detail"]
    r = secured.post("/api/v1/ingest", json=payload(), headers=_bearer("not-a-token"))
    assert r.status_code == 401 and r.json()["detail"] == "unknown bearer token"
    r = secured.post("/api/v1/ingest", json=payload(), headers=_bearer(READ))
    assert r.status_code == 403 and r.json()["detail"] == "token 'grafana' may read but not write"
    r = secured.post("/api/v1/ingest", json=payload(), headers=_bearer(WRITE))
    assert r.status_code == 200 and r.json()["stored"] is True


def test_reads_need_a_read_token(secured: TestClient) -> None:
    secured.post("/api/v1/ingest", json=payload(), headers=_bearer(WRITE))
    for path in ("/api/v1/runs", "/api/v1/runs/test-run", "/api/v1/runs/test-run/ranks"):
        assert secured.get(path).status_code == 401, path
        r = secured.get(path, headers=_bearer(WRITE))
        assert r.status_code == 403 and "may write but not read" in r.json()["detail"], path
        assert secured.get(path, headers=_bearer(READ)).status_code == 200, path


def test_probes_metrics_and_openapi_stay_open(secured: TestClient, sqlite_url: str) -> None:
    for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
        assert secured.get(path).status_code == 200, path
    schemes = secured.get("/openapi.json").json()["components"]["securitySchemes"]
    assert schemes["HTTPBearer"]["scheme"] == "bearer"
    with _client(sqlite_url, read_tokens=f"prom={READ}", metrics_require_token=True) as c:
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers=_bearer(READ)).status_code == 200


def test_open_collector_ignores_tokens(sqlite_url: str) -> None:
    with _client(sqlite_url) as c:
        assert c.post("/api/v1/ingest", json=payload(), headers=_bearer("whatever")).status_code == 200
        assert c.get("/api/v1/runs").status_code == 200


def test_token_specs_are_parsed_and_checked() -> None:
    (plain,) = parse_tokens(f"  {WRITE} ", "write")
    assert plain.digest == hashlib.sha256(WRITE.encode()).digest() and len(plain.name) == 12
    named, hashed = parse_tokens(f"a={WRITE},b=sha256:{READ_SHA}", "read")
    assert (named.name, hashed.name, hashed.digest.hex()) == ("a", "b", READ_SHA)
    with pytest.raises(ValueError, match="at least 16 characters"):
        parse_tokens("x=short", "write")
    with pytest.raises(ValueError, match="64 hex digits"):
        parse_tokens("x=sha256:abc", "write")


@pytest.mark.parametrize("variable", ["STEPWATCH_WRITE_TOKENS", "STEPWATCH_READ_TOKENS"])
def test_a_short_token_stops_serve_with_one_line_before_migrating(tmp_path: Path, variable: str) -> None:
    db = tmp_path / "never.db"
    env = {**os.environ, variable: "team=short", "STEPWATCH_DATABASE_URL": f"sqlite:///{db}"}
    done = subprocess.run(
        [sys.executable, "-m", "stepwatch", "serve", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert variable in lines[0] and "at least 16 characters" in lines[0] and "team" in lines[0]
    assert not db.exists()  # refused before the migrations touched the database


@pytest.mark.parametrize(
    ("settings", "mutate", "field", "says"),
    [
        ({"max_steps_per_batch": 100}, lambda p: None, "steps.time_s", "STEPWATCH_MAX_STEPS_PER_BATCH"),
        ({"max_ranks_per_run": 2}, lambda p: None, "rank.world_size", "STEPWATCH_MAX_RANKS_PER_RUN"),
        ({}, lambda p: p.__setitem__("run", "r" * 129), "run", "pattern"),
        ({}, lambda p: p.__setitem__("run", "run\nname"), "run", "pattern"),
        ({}, lambda p: p["rank"].__setitem__("host", "host name"), "rank.host", "pattern"),
        ({}, lambda p: p["rank"].__setitem__("host", "h" * 256), "rank.host", "at most 255"),
        ({}, lambda p: p["agent"].__setitem__("version", "1.0; rm -rf"), "agent.version", "pattern"),
        ({}, lambda p: p["steps"]["time_s"].__setitem__(0, 1e300), "steps.time_s.0", "less than or equal"),
        ({}, lambda p: p["steps"]["tokens"].__setitem__(0, 2**41), "steps.tokens.0", "less than or equal"),
        ({}, lambda p: p["steps"].__setitem__("wall_end", 1e300), "steps.wall_end", "less than or equal"),
        ({}, lambda p: p["convention"].__setitem__("notes", "x" * 300), "convention", "longer than 256"),
        ({}, lambda p: p["convention"].__setitem__("nested", {"a": 1}), "convention", "must be a number"),
    ],
)
def test_limits_answer_422_naming_the_field(
    sqlite_url: str, settings: dict[str, Any], mutate: Any, field: str, says: str
) -> None:
    p = payload(world=4, times=[0.5] * 150)
    mutate(p)
    with _client(sqlite_url, **settings) as c:
        r = c.post("/api/v1/ingest", json=p)
        assert r.status_code == 422, r.text
        assert field in r.json()["detail"] and says in r.json()["detail"], r.json()["detail"]
    engine = make_engine(sqlite_url)
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(IngestedBatch)).scalar_one() == 0
    engine.dispose()


def test_sub_nanosecond_durations_count_as_zero(sqlite_url: str) -> None:
    with _client(sqlite_url) as c:
        assert (
            c.post("/api/v1/ingest", json=payload(times=[1e-300, 0.5], waits=[1e-12, 0.0])).status_code == 200
        )
        s = c.get("/api/v1/runs/test-run/series", params={"metric": "tokens_per_s"}).json()
        assert [pt["max"] for pt in s["points"]] == [2000.0]  # the 0 s step is not a rate


def test_runs_per_token_are_limited(db_url: str, engine: Engine) -> None:
    app = create_app(
        Settings(database_url=db_url, write_tokens=f"a={WRITE},b={WRITE}-b", max_runs_per_token=2),
        engine=engine,
    )
    with TestClient(app) as c:
        for run in ("run-1", "run-2"):
            assert c.post("/api/v1/ingest", json=payload(run=run), headers=_bearer(WRITE)).status_code == 200
        r = c.post("/api/v1/ingest", json=payload(run="run-3"), headers=_bearer(WRITE))
        assert r.status_code == 403
        assert r.json()["detail"] == (
            "run 'run-3' refused: token 'a' created 2 runs, the limit is 2 (STEPWATCH_MAX_RUNS_PER_TOKEN)"
        )
        # Its existing runs still take batches, and another token has its own quota.
        assert c.post("/api/v1/ingest", json=payload(run="run-1"), headers=_bearer(WRITE)).status_code == 200
        assert (
            c.post("/api/v1/ingest", json=payload(run="run-3"), headers=_bearer(WRITE + "-b")).status_code
            == 200
        )
    with engine.connect() as conn:
        owners = dict(conn.execute(select(Run.name, Run.created_by)).all())
    assert owners == {"run-1": "a", "run-2": "a", "run-3": "b"}


def test_cors_is_off_unless_configured(sqlite_url: str) -> None:
    origin = {"origin": "https://grafana.example"}
    with _client(sqlite_url) as c:
        assert "access-control-allow-origin" not in c.get("/api/v1/runs", headers=origin).headers
    with _client(sqlite_url, cors_origins="https://grafana.example") as c:
        r = c.get("/api/v1/runs", headers=origin)
        assert r.headers["access-control-allow-origin"] == "https://grafana.example"
        assert (
            "access-control-allow-origin"
            not in c.get("/api/v1/runs", headers={"origin": "https://x"}).headers
        )


def test_a_new_runs_first_batches_share_one_quota_check(sqlite_url: str) -> None:
    """All ranks of a starting job post at once: one database check admits the run."""
    from concurrent.futures import ThreadPoolExecutor

    app = create_app(Settings(database_url=sqlite_url, write_tokens=f"a={WRITE}"))
    ingestor = app.state.ingestor
    calls: list[str] = []
    check = ingestor.admit

    def counted(p: IngestPayload, owner: str | None, limit: int) -> RunKey:
        calls.append(p.run)
        return check(p, owner, limit)

    ingestor.admit = counted
    with TestClient(app) as c, ThreadPoolExecutor(16) as pool:
        codes = list(
            pool.map(
                lambda r: (
                    c.post(
                        "/api/v1/ingest",
                        json=payload(run="starting", rank=r, world=16),
                        headers=_bearer(WRITE),
                    ).status_code
                ),
                range(16),
            )
        )
    assert codes == [200] * 16
    assert calls == ["starting"]
